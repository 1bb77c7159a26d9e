"""How ranks post their communication so that NCCL can run it, and a check under NCCL's rules.

NCCL matches the point-to-point messages of a pair in posting order (tags are ignored), runs
both directions of a pair on one ordered channel, and a large send completes only once its
receive is posted. Posted one action at a time, the lowered lists of 1F1B deadlock under those
rules: in the steady state both ends of a pair post a SEND before the RECV that would meet the
other's, and each send waits for a receive queued behind the other's send. So the runtime posts
every run of consecutive communication actions of a list as one group (torch's
``batch_isend_irecv``): the operations of a group become active together, and the two ends of a
pair post matching groups, as both derive them from the same plan.

Grouping is not enough where a rank's list receives from a peer later than that peer sent:
in some interleaved lists a pair's two ends would take the pair's messages in different orders.
``nccl_order`` makes both ends agree on one order per pair, the order in which the messages are
sent in a dry run of the step, by posting each RECV before the first SEND to the same peer that
comes after it in that order (never later than the lowering put it: a receive posted early only
holds its buffer longer). ``exchange_plan`` is the grouping; ``nccl_deadlock`` runs every rank's
plan under NCCL's rules (which tidal_agent's ``nccl-model`` transport enforces at run time) and
says where it stops.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tidal_api.layout import Layout
from tidal_plan.dryrun import dry_run
from tidal_plan.ir import Action, Kind, format_actions
from tidal_plan.lowering import Message, message

# One step of a rank's posting plan: a compute action, or a group of communication actions
# posted together (a plain tuple of actions; an Action is a NamedTuple, so tell them apart with
# ``isinstance(step, Action)``).
Step = Action | tuple[Action, ...]

_SENDS = frozenset({Kind.SEND_F, Kind.SEND_B})
_RECEIVES = frozenset({Kind.RECV_F, Kind.RECV_B})


def nccl_order(layout: Layout, lowered: Mapping[int, Sequence[Action]]) -> dict[int, list[Action]]:
    """``lowered`` with receives moved earlier so that, for every pair, both ends post the
    pair's messages in one order: by send time in a unit-cost dry run, then producing rank,
    then place in its list (both ends compute the same plan, so they agree)."""
    timeline = dry_run(layout, lowered).raise_on_deadlock().timeline
    order: dict[Message, tuple[float, int, int]] = {}
    for rank, spans in enumerate(timeline):
        for place, span in enumerate(spans):
            if span.action.kind in _SENDS:
                order[message(span.action)] = (span.start, rank, place)
    out = {}
    for rank, actions in lowered.items():
        out[rank] = list(actions)
        receives = [a for a in actions if a.kind in _RECEIVES]
        for recv in receives:
            key, peer = order[message(recv)], _rank_of(layout, recv)
            current = out[rank].index(recv)
            before = next((i for i, a in enumerate(out[rank][:current])
                           if a.kind in _SENDS and _rank_of(layout, a) == peer
                           and order[message(a)] > key), None)
            if before is not None:
                del out[rank][current]
                out[rank].insert(before, recv)
    return out


def _rank_of(layout: Layout, action: Action) -> int:
    """The pipeline rank at the other end of a communication action."""
    return layout.stage_rank(peer_stage(action))


def exchange_plan(actions: Sequence[Action], *, grouped: bool = True) -> list[Step]:
    """``actions`` with each run of consecutive communication actions as one group (a tuple);
    ``grouped=False`` posts each on its own, as the runtime did before NCCL's rules were kept
    (a test's foil)."""
    out: list[Step] = []
    run: list[Action] = []
    for action in actions:
        if action.kind.is_comm:
            run.append(action)
            continue
        if run:
            out.extend([tuple(run)] if grouped else [(a,) for a in run])
            run = []
        out.append(action)
    if run:
        out.extend([tuple(run)] if grouped else [(a,) for a in run])
    return out


def peer_stage(action: Action) -> int:
    """The stage at the other end of a communication action."""
    return action.stage + (1 if action.kind in (Kind.SEND_F, Kind.RECV_B) else -1)


@dataclass(slots=True)
class _Op:
    action: Action
    send: bool
    rank: int
    peer: int
    index: int  # its place among the messages of its direction of the pair
    active: bool = False
    done: bool = False


@dataclass(slots=True)
class _Rank:
    plan: Sequence[Step]
    pc: int = 0
    ops: list[_Op] = field(default_factory=list)
    # The operations of the group each RECV action was posted in: waiting for a receive waits
    # for its whole group (a coalesced NCCL group completes as one).
    received: dict[Action, list[_Op]] = field(default_factory=dict)


def nccl_deadlock(layout: Layout, plans: Mapping[int, Sequence[Step]]) -> str | None:
    """Run one step of every pipeline rank's posting plan under NCCL's rules; None where it
    finishes, else what each rank waits for.

    A group's operations with one peer join the pair's channel at once; the channel's groups
    become active one after the other, each once the one before it is done. The k-th send from
    a to b meets the k-th receive of b from a, whatever their tags; they complete together,
    once both are active. A compute action waits for the groups of the receives it consumes
    (a group completes as one); a rank's step ends once all its operations are done. Messages met out of order are reported too: NCCL
    would deliver the wrong tensor.
    """
    ranks = {r: _Rank(plan) for r, plan in plans.items()}
    channels: dict[tuple[int, int], deque[list[_Op]]] = {}
    counts: dict[tuple[int, int, bool], int] = {}
    peers: dict[tuple[int, int, int, bool], _Op] = {}  # (src, dst, index, send) -> op
    mismatch: list[str] = []

    def post(rank: int, group: tuple[Action, ...]) -> None:
        parts: dict[int, list[_Op]] = {}
        posted: list[_Op] = []
        for action in group:
            send = action.kind in _SENDS
            peer = _rank_of(layout, action)
            key = (rank, peer, send)
            index = counts.get(key, 0)
            counts[key] = index + 1
            op = _Op(action, send, rank, peer, index)
            src, dst = (rank, peer) if send else (peer, rank)
            peers[(src, dst, index, send)] = op
            other = peers.get((src, dst, index, not send))
            if other is not None:
                sent, got = (op, other) if send else (other, op)
                if message(sent.action) != message(got.action):
                    mismatch.append(f"rank {src}'s message {index} to rank {dst} is "
                                    f"{sent.action}, but rank {dst} receives it as {got.action}")
            parts.setdefault(peer, []).append(op)
            ranks[rank].ops.append(op)
            posted.append(op)
            if not send:
                ranks[rank].received[action] = posted
        for peer, ops in parts.items():
            channel = channels.setdefault((rank, peer), deque())
            channel.append(ops)
            if len(channel) == 1:
                for op in ops:
                    op.active = True

    def settle() -> bool:
        """Complete every matched pair of active operations, and pop finished groups."""
        moved = True
        progress = False
        while moved:
            moved = False
            for channel in channels.values():
                if not channel:
                    continue
                for op in channel[0]:
                    if op.done:
                        continue
                    src, dst = (op.rank, op.peer) if op.send else (op.peer, op.rank)
                    other = peers.get((src, dst, op.index, not op.send))
                    if other is not None and other.active:
                        op.done = other.done = True
                        moved = progress = True
                if all(op.done for op in channel[0]):
                    channel.popleft()
                    if channel:
                        for op in channel[0]:
                            op.active = True
                    moved = progress = True
        return progress

    def waits(rank: _Rank, action: Action) -> bool:
        """Whether compute ``action`` still waits for the group of a receive it consumes."""
        kind = Kind.RECV_F if action.kind is Kind.F else Kind.RECV_B
        group = rank.received.get(Action(action.stage, kind, action.mb), [])
        return not all(op.done for op in group)

    progress = True
    while progress:
        progress = settle()
        for r, state in ranks.items():
            while state.pc < len(state.plan):
                step = state.plan[state.pc]
                if not isinstance(step, Action):
                    post(r, step)
                elif waits(state, step):
                    break
                state.pc += 1
                progress = True
    if mismatch:
        return "messages met out of order: " + "; ".join(mismatch[:3])
    stuck = []
    for r, state in sorted(ranks.items()):
        pending = [op for op in state.ops if not op.done]
        if state.pc == len(state.plan) and not pending:
            continue
        where = (f"at {_step_text(state.plan[state.pc])}" if state.pc < len(state.plan)
                 else "at the step's end")
        heads = [f"{_step_text(tuple(op.action for op in channels[(r, p)][0]))} with rank {p}"
                 for p in sorted({op.peer for op in pending}) if channels.get((r, p))]
        stuck.append(f"rank {r} {where}, its active groups: {', '.join(heads) or 'none'}")
    return ("deadlock under NCCL's rules: " + "; ".join(stuck)) if stuck else None


def _step_text(step: Step) -> str:
    return str(step) if isinstance(step, Action) else format_actions(list(step))

