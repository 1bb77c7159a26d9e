"""Optimizer pieces whose results do not depend on the layout.

AdamW runs per tensor (``foreach=False``), so a parameter's update reads nothing but its own
state. The learning rate is a pure function of the step. The global gradient norm is reduced in
global parameter order: every rank contributes the norms of its own parameters at their global
indices of one vector, an all-reduce assembles it exactly (each entry has one contributor, the
rest add zeros), and every rank takes the norm of the same vector.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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


class LogicalReplicaGradients:
    """Each logical replica's gradient apart, summed in one fixed binary tree (strict DP).

    A step's micro-batches form ``L`` logical replicas of ``per_replica`` contiguous
    micro-batches. Parameter gradients accumulate in ``.grad`` in micro-batch order as usual;
    when a logical replica's last micro-batch is done (``micro_batch_done``), its gradient is
    taken out and merged into a binary counter: two sums of the same level, left then right,
    add into one of the next level. A physical replica runs an aligned block of ``L / dp``
    logical replicas (both powers of two), so its counter ends with the block's subtree sum
    (``finish``), and :func:`tree_reduce` adds the blocks in the tree's upper levels: the
    same additions, in the same order, as one process running all ``L``.
    """

    def __init__(self, stages: Mapping[int, Sequence[torch.nn.Parameter]], *,
                 per_replica: int, mb_offset: int) -> None:
        self.stages, self.per_replica, self.mb_offset = stages, per_replica, mb_offset
        self._counters: dict[int, list[tuple[int, list[torch.Tensor]]]] = {
            s: [] for s in stages}

    def micro_batch_done(self, stage: int, mb: int) -> None:
        """Micro-batch ``mb`` (this replica's numbering) of ``stage`` has its gradients."""
        if (self.mb_offset + mb + 1) % self.per_replica:
            return
        params = self.stages[stage]
        node = (0, [p.grad for p in params])
        for p in params:
            p.grad = None  # the next logical replica starts from nothing, as the first did
        counter = self._counters[stage]
        while counter and counter[-1][0] == node[0]:
            level, left = counter.pop()
            node = (level + 1, [a.add_(b) for a, b in zip(left, node[1], strict=True)])
        counter.append(node)

    def finish(self) -> None:
        """Put each stage's block sum into ``.grad``."""
        for stage, counter in self._counters.items():
            if len(counter) != 1:
                raise RuntimeError(f"stage {stage}: the logical replicas did not close one "
                                   f"subtree ({[level for level, _ in counter]})")
            (_, grads), = counter
            for p, g in zip(self.stages[stage], grads, strict=True):
                p.grad = g
            counter.clear()


def tree_reduce(params: Sequence[torch.nn.Parameter], dp_world: World) -> None:
    """Sum the replicas' gradients in a binary tree over replica order (neighbours pairwise,
    an odd one out carried up), the same bits on every replica and for any all-reduce."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    level = dp_world.all_gather(flat)
    while len(level) > 1:
        level = [level[i].add_(level[i + 1]) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    _scatter(params, level[0])


def all_reduce_gradients(params: Sequence[torch.nn.Parameter], dp_world: World) -> None:
    """Sum the replicas' gradients with the backend's all-reduce: fast, and its order of
    additions depends on the algorithm and the buffer (relaxed consistency)."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dp_world.all_reduce(flat)
    _scatter(params, flat)


def _scatter(params: Sequence[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
