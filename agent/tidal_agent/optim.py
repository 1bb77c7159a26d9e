"""Optimizer pieces whose results do not depend on the layout.

AdamW runs per tensor (``foreach=False``), so a parameter's update reads nothing but its own
state. The learning rate is a pure function of the step. The global gradient norm is reduced in
global parameter order: every rank contributes the norms of its own parameters at their global
indices of one vector, an all-reduce assembles it exactly (each entry has one contributor, the
rest add zeros), and every rank takes the norm of the same vector.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum

import torch

from tidal_agent.world import World
from tidal_api import TrainingSpec


def lr_at(step: int, training: TrainingSpec) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at the last step."""
    if step < training.warmup_steps:
        return training.lr * (step + 1) / training.warmup_steps
    span = max(1, training.steps - training.warmup_steps)
    progress = min(1.0, (step - training.warmup_steps) / span)
    return training.min_lr + 0.5 * (training.lr - training.min_lr) * (1 + math.cos(math.pi * progress))


def build_adamw(
    named_params: Sequence[tuple[str, torch.nn.Parameter]], training: TrainingSpec
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only, one tensor at a time."""
    decay = [p for _, p in named_params if p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": training.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=training.lr, betas=training.betas, eps=1e-8, foreach=False, fused=False
    )


class ClipMode(str, Enum):
    GLOBAL_ORDER = "global-order"  # the determinism contract
    NAIVE = "naive"  # per-stage sums of squares all-reduced: layout-dependent, for contrast


def clip_grad_norm(
    indexed_params: Sequence[tuple[int, torch.nn.Parameter]],
    num_params: int,
    max_norm: float,
    *,
    world: World,
    contributes: bool = True,
    mode: ClipMode = ClipMode.GLOBAL_ORDER,
    uncounted: frozenset[int] = frozenset(),
) -> float:
    """Clip gradients in place to a global norm of ``max_norm``; return the norm before.

    ``indexed_params`` pairs each local parameter with its index in global parameter order.
    Data-parallel replicas hold the same (reduced) gradients: only one replica
    ``contributes`` its norms, so each entry of the reduced vector still has one contributor.
    Parameters of the ``uncounted`` indices are clipped but left out of the norm: the copy of
    a tied parameter, whose gradient the other copy counts.
    """
    if not indexed_params:
        raise ValueError("clip_grad_norm needs at least one local parameter")
    device = indexed_params[0][1].device
    local = [torch.linalg.vector_norm(p.grad) for _, p in indexed_params]
    if uncounted:
        local = [norm * (0.0 if i in uncounted else 1.0)
                 for norm, (i, _) in zip(local, indexed_params, strict=True)]
    if mode is ClipMode.GLOBAL_ORDER:
        norms = torch.zeros(num_params, device=device)
        if contributes:
            norms[[i for i, _ in indexed_params]] = torch.stack(local)
        world.all_reduce(norms)
        total = torch.linalg.vector_norm(norms)
    else:
        squares = torch.stack(local).square().sum() * (1.0 if contributes else 0.0)
        world.all_reduce(squares)
        total = squares.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for _, p in indexed_params:
            p.grad.mul_(coef)
    return float(total)


def reduce_replica_gradients(params: Sequence[torch.nn.Parameter], dp_world: World) -> None:
    """Sum gradients over data-parallel replicas in replica order, the same bits everywhere.

    An all-reduce may add the replicas' values in an order that depends on the buffer's size and
    chunking, which changes with the pipeline layout; gathering every replica's gradients and
    adding them in replica order does not.
    """
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    parts = dp_world.all_gather(flat)
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(total[offset : offset + n].view_as(p.grad))
        offset += n
