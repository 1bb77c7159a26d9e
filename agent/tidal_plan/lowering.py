"""Lowering: add the point-to-point communication that per-rank compute lists imply.

A forward's output goes to the next stage and an input gradient to the previous one; when that
stage sits on another rank, the producer posts a SEND right after computing and the consumer a
RECV right before using it. Stages on the same rank hand tensors over locally, without actions.

A message is named by (kind, producing stage, micro-batch) (:func:`message`); transports match
messages in posting order, so each pair's two ends must post them in the same order
(:func:`fifo_consistent`; tidal_plan.exchanges orders and groups them as NCCL needs).
:func:`validate_lowered` refuses lists no schedule could mean (hand-written ones included)
before the dry run executes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tidal_api.layout import Layout
from tidal_plan.ir import Action, Kind
from tidal_plan.schedules import Schedule

# A message is named by the tag both ends agree on: (kind of payload, producing stage, mb).
Message = tuple[Kind, int, int]


def lower(layout: Layout, compute: Mapping[int, Sequence[Action]]) -> Schedule:
    """Per-rank lists of ``compute`` with SEND_F/RECV_F and SEND_B/RECV_B added."""
    last = layout.num_stages - 1
    rank_of = [layout.stage_rank(stage) for stage in range(layout.num_stages)]
    backward = (Kind.B, Kind.I)
    lowered: Schedule = {}
    for rank, actions in compute.items():
        out: list[Action] = []
        append = out.append
        for action in actions:
            stage, kind, mb = action
            if kind is Kind.F:
                if stage > 0 and rank_of[stage - 1] != rank_of[stage]:
                    append(Action(stage, Kind.RECV_F, mb))
                append(action)
                if stage < last and rank_of[stage + 1] != rank_of[stage]:
                    append(Action(stage, Kind.SEND_F, mb))
            elif kind in backward:
                if stage < last and rank_of[stage + 1] != rank_of[stage]:
                    append(Action(stage, Kind.RECV_B, mb))
                append(action)
                if stage > 0 and rank_of[stage - 1] != rank_of[stage]:
                    append(Action(stage, Kind.SEND_B, mb))
            else:
                append(action)
        lowered[rank] = out
    return lowered


def message(action: Action) -> Message:
    """The tag a communication action sends or waits for.

    ``1SEND_F0`` and ``2RECV_F0`` are both (F, 1, 0): the forward output of stage 1;
    ``2SEND_B0`` and ``1RECV_B0`` both (B, 2, 0): the input gradient computed by stage 2.
    """
    if action.kind is Kind.SEND_F:
        return (Kind.F, action.stage, action.mb)
    if action.kind is Kind.RECV_F:
        return (Kind.F, action.stage - 1, action.mb)
    if action.kind is Kind.SEND_B:
        return (Kind.B, action.stage, action.mb)
    if action.kind is Kind.RECV_B:
        return (Kind.B, action.stage + 1, action.mb)
    raise ValueError(f"{action} is a compute action and carries no message")


def fifo_consistent(lowered: Mapping[int, Sequence[Action]]) -> bool:
    """Whether every rank pair sees the same message order at both ends.

    True when, for each ordered pair (src, dst), the messages src sends to dst are, in src's
    order, those dst receives from src, in dst's order. A send without a receive (or the other
    way round) makes the lists inconsistent.
    """
    sender: dict[Message, int] = {}
    receiver: dict[Message, int] = {}
    for rank, actions in lowered.items():
        for action in actions:
            if action.kind in (Kind.SEND_F, Kind.SEND_B):
                sender[message(action)] = rank
            elif action.kind in (Kind.RECV_F, Kind.RECV_B):
                receiver[message(action)] = rank
    if sender.keys() != receiver.keys():
        return False
    sent: dict[tuple[int, int], list[Message]] = {}
    received: dict[tuple[int, int], list[Message]] = {}
    for rank, actions in lowered.items():
        for action in actions:
            if action.kind in (Kind.SEND_F, Kind.SEND_B):
                tag = message(action)
                sent.setdefault((rank, receiver[tag]), []).append(tag)
            elif action.kind in (Kind.RECV_F, Kind.RECV_B):
                tag = message(action)
                received.setdefault((sender[tag], rank), []).append(tag)
    return sent == received


def validate_lowered(layout: Layout, lowered: Mapping[int, Sequence[Action]]) -> None:
    """Raise ``ValueError`` for lowered lists no schedule could mean.

    That is: lists for other ranks than the layout's, an action on the wrong rank or twice,
    communication between stages of one rank, or a SEND nobody receives. A RECV nobody sends
    passes: it is a deadlock, which the dry run shows.
    """
    if set(lowered) != set(range(layout.pp)):
        raise ValueError(
            f"lists are given for ranks {sorted(lowered)}; layout {layout.describe()} "
            f"needs exactly ranks 0..{layout.pp - 1}"
        )
    seen: set[Action] = set()
    received: set[Message] = set()
    sends: list[Action] = []
    for rank, actions in lowered.items():
        for action in actions:
            _check_action(layout, rank, action)
            if action in seen:
                raise ValueError(f"{action} appears twice: a stage runs each action once")
            seen.add(action)
            if action.kind in (Kind.RECV_F, Kind.RECV_B):
                received.add(message(action))
            elif action.kind in (Kind.SEND_F, Kind.SEND_B):
                sends.append(action)
    for send in sends:
        if message(send) not in received:
            peer = send.stage + (1 if send.kind is Kind.SEND_F else -1)
            recv = Action(peer, Kind.RECV_F if send.kind is Kind.SEND_F else Kind.RECV_B, send.mb)
            raise ValueError(
                f"{send} is never received: add {recv} on rank {layout.stage_rank(peer)} "
                f"or drop the send"
            )


def _check_action(layout: Layout, rank: int, action: Action) -> None:
    stage, kind = action.stage, action.kind
    last = layout.num_stages - 1
    if not 0 <= stage <= last:
        raise ValueError(f"{action} names a stage outside 0..{last}")
    if not 0 <= action.mb < layout.num_micro_batches:
        raise ValueError(f"{action} names a micro-batch outside 0..{layout.num_micro_batches - 1}")
    if layout.stage_rank(stage) != rank:
        raise ValueError(
            f"{action} is on rank {rank}, but stage {stage} runs on rank "
            f"{layout.stage_rank(stage)}: move it there"
        )
    if kind.is_compute:
        return
    peer = stage + (1 if kind in (Kind.SEND_F, Kind.RECV_B) else -1)
    if not 0 <= peer <= last:
        raise ValueError(f"{action} talks to stage {peer}, which does not exist: drop it")
    if layout.stage_rank(peer) == rank:
        raise ValueError(
            f"{action} talks to stage {peer} on its own rank {rank}: drop it, the runtime "
            f"hands tensors between stages of one rank over locally"
        )
