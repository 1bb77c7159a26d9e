"""The hot switch's data path: moving training state between layouts, in memory.

``state_metadata`` describes every state tensor of the model for the pure planner
(tidal_plan.reshard); ``carry_over`` hands what a worker keeps to its new trainer without a
copy, and moves what leaves to host memory so that the device never holds both states;
``execute_reshard`` runs the plan's buckets over the transition world, each bucket one
exchange (one group of sends and receives, tidal_agent.transport).
Parameters, AdamW moments and AdamW's step move; gradients never do (a switch happens at a step
boundary, where there are none); data position, learning rate and dropout are functions of the
step and need no state.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from tidal_agent.model import global_parameters
from tidal_agent.trainer import STATE_KEYS, Trainer
from tidal_agent.transport import P2P, recv, send
from tidal_agent.world import World
from tidal_api import ModelSpec
from tidal_plan.reshard import ReshardPlan, TensorMeta, bucketize


def state_metadata(model: ModelSpec) -> list[TensorMeta]:
    """Every state tensor of the model, in global order, as the planner sees it."""
    return [TensorMeta(name=name, unit=unit, numel=shape.numel(), itemsize=4)
            for name, shape, unit in _state(model)]


def state_shapes(model: ModelSpec) -> dict[str, torch.Size]:
    """Every state tensor's shape, by global name."""
    return {name: shape for name, shape, _ in _state(model)}


def _state(model: ModelSpec) -> list[tuple[str, torch.Size, int]]:
    """(name, shape, unit) of every state tensor, in global order."""
    out = []
    for name, shape, unit in global_parameters(model):
        out.append((name, shape, unit))
        for key in STATE_KEYS:  # AdamW's step is a scalar; the moments are parameter-shaped
            out.append((f"{name}/{key}", torch.Size(()) if key == "step" else shape, unit))
    return out


@dataclass(frozen=True, slots=True)
class TransferStats:
    seconds: float
    bytes_sent: int
    bytes_received: int
    buckets: int


def execute_reshard(
    plan: ReshardPlan,
    *,
    world: World,
    me: str,
    old_state: Mapping[str, torch.Tensor] | None,
    new_state: dict[str, torch.Tensor] | None,
    bucket_bytes: int,
    senders: Mapping[str, str] | None = None,
    held: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> TransferStats:
    """Run ``plan``'s transfers on this worker: send from ``old_state``, receive into ``new_state``.

    Pieces go straight from and into the live tensors (contiguous regions of them), so no
    staging memory is used. Every member of ``world`` walks the same bucket list; a bucket's
    sends and receives are posted together and waited for before the next bucket, so at most
    ``bucket_bytes`` are in flight per worker and the order cannot deadlock. A joiner has no
    ``old_state``; a leaver has no ``new_state``.

    On the fault path the plan's sources include lost workers: ``senders`` names the survivor
    that sends in each one's place, from the copy of its state it ``held`` (by lost worker; see
    ``tidal_agent.snapshot``); a piece it sends to itself is copied.
    """
    started = time.perf_counter()
    rank = {member: i for i, member in enumerate(world.members)}
    senders, held = senders or {}, held or {}
    sent = received = 0
    buckets = bucketize(plan, bucket_bytes)
    device = world.device
    for bucket in buckets:
        ops: list[P2P] = []
        for transfer in bucket:
            region = slice(transfer.region.start, transfer.region.stop)
            src = senders.get(transfer.src, transfer.src)
            if src == me:
                state = old_state if transfer.src == me else held[transfer.src]
                # A held copy, and state that leaves (``carry_over``), are in host memory
                piece = state[transfer.tensor].view(-1)[region].to(device)
                if transfer.dst == me:
                    new_state[transfer.tensor].view(-1)[region].copy_(piece)
                    continue
                ops.append(send(piece, rank[transfer.dst]))
                sent += transfer.nbytes
            if transfer.dst == me:
                # Into the live tensor: the new trainer's state (AdamW's step too) is on the
                # world's device.
                ops.append(recv(new_state[transfer.tensor].view(-1)[region], rank[src]))
                received += transfer.nbytes
        # One group per bucket: its sends and receives with every peer posted together, in
        # the bucket's order at every member, as NCCL needs.
        world.exchange(ops).wait()
    return TransferStats(time.perf_counter() - started, sent, received, len(buckets))


def incoming(plan: ReshardPlan, me: str) -> set[str]:
    """The state tensors ``me`` receives (some of): it held the others before."""
    return {t.tensor for t in plan.transfers if t.dst == me}


def carry_over(plan: ReshardPlan, me: str, old: Trainer,
               holds: Collection[str]) -> dict[str, torch.Tensor]:
    """The state this worker keeps across the switch, for its new trainer, which holds the
    state tensors ``holds``: ``old``'s own tensors, to be taken as they are (``Trainer(kept=)``),
    never copied nor allocated again.

    The rest of ``old``'s state leaves; it moves to host memory now (``Trainer.offload``, a
    no-op on a CPU), freeing the device before the new trainer allocates what arrives, and the
    reshard sends it from there. So the device holds no more than the new state, plus the
    reshard's bucket in flight, where the old and the new state side by side would need up to
    twice the training state.
    """
    arriving = incoming(plan, me)
    old_state = old.state_tensors()
    kept = {name: t for name, t in old_state.items() if name in holds and name not in arriving}
    old.offload(name for name in old_state if name not in kept)
    return kept
