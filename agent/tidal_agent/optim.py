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
    micro-batches. Parameter gradients accumulate in ``.grad`` in micro-batch order, each
    logical replica's from none (its first micro-batch's gradient is taken as it is, as a
    step's first is); when its last micro-batch is done (``micro_batch_done``), its gradient is
    taken out and merged into a binary counter: two sums of the same level, left then right,
    add into one of the next level. A physical replica runs an aligned block of ``L / dp``
    logical replicas (both powers of two), so its counter ends with the block's subtree sum
    (``finish``), and :class:`GradientReducer` adds the blocks in the tree's upper levels: the
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
            p.grad = None
        counter = self._counters[stage]
        while counter and counter[-1][0] == node[0]:
            level, left = counter.pop()
            for a, b in zip(left, node[1], strict=True):
                a.add_(b)
            node = (level + 1, left)
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


class GradientReducer:
    """Sums the data-parallel replicas' gradients, through one flat buffer kept across steps.

    ``strict``: in a binary tree over replica order, ((r0 + r1) + (r2 + r3)) and so on, the
    same bits on every replica whatever the backend's all-reduce algorithm. With dp a power of
    two the tree runs as recursive doubling: at level ``i`` each replica all-reduces with the
    one whose index differs in bit ``i``. An all-reduce of two operands adds them once, and
    a + b is b + a bit for bit, so no algorithm can change the result, while each level moves
    what a two-party all-reduce moves. Another dp (a fixed one: its replicas are the logical
    ones) falls back to an all-to-all of chunks, each added in the tree where it lands, then
    gathered. Otherwise (relaxed) one all-reduce over all replicas: its order of additions
    depends on the algorithm and the buffer.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], dp_world: World, *,
                 strict: bool) -> None:
        self.params, self.world, self.strict = list(params), dp_world, strict
        n, dp, rank = sum(p.numel() for p in self.params), dp_world.size, dp_world.rank
        self.pairs: list[World] = []
        self.chunk = n
        if strict and dp & (dp - 1) == 0:
            for level in range(dp.bit_length() - 1):
                a, b = sorted((rank, rank ^ (1 << level)))
                members = (dp_world.members[a], dp_world.members[b])
                self.pairs.append(dp_world.subgroup(f"tree{level}.{a}", members))
        elif strict:
            self.chunk = -(-n // dp)
        like = self.params[0]
        size = dp * self.chunk if strict and not self.pairs else n
        self.flat = torch.zeros(size, dtype=like.dtype, device=like.device)
        self.gathered = torch.empty_like(self.flat) if strict and not self.pairs else None

    def __call__(self) -> None:
        offset = 0
        for p in self.params:
            self.flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        total = self.flat
        if self.pairs:
            for pair in self.pairs:
                pair.all_reduce(self.flat)
        elif self.strict:
            dp = self.world.size
            level = list(self.world.all_to_all(self.flat).view(dp, self.chunk))
            while len(level) > 1:
                level = [level[i].add_(level[i + 1]) if i + 1 < len(level) else level[i]
                         for i in range(0, len(level), 2)]
            self.world.all_gather_into(self.gathered, level[0])
            total = self.gathered
        else:
            self.world.all_reduce(self.flat)
        offset = 0
        for p in self.params:
            p.grad.copy_(total[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()
