"""Lowering: add the point-to-point communication that per-rank compute lists imply.

A forward's output goes to the next stage and an input gradient to the previous one; when that
stage sits on another rank, the producer posts a SEND right after computing and the consumer a
RECV right before using it. Stages on the same rank hand tensors over locally, without actions.

The runtime posts SENDs without waiting and blocks on RECVs, and matches messages by their
(kind, stage, micro-batch) tag. Backends that match in posting order instead (NCCL) also need
:func:`fifo_consistent` lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tidal_plan.ir import Action, Kind
from tidal_plan.layout import Layout
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
