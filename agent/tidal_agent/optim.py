"""Optimizer pieces whose results do not depend on the layout.

AdamW is torch's fused kernel (``fused=True``, on CPU and CUDA alike): each tensor's update
is one elementwise pass over the tensor and its own state, whatever tensors share the call, so
its bits do not depend on how a layout groups the parameters; on a GPU the whole update is a
few multi-tensor launches and reads nothing back to the host. Its ``step`` is a float32 scalar
on the parameter's device, where the fused kernel reads it (``adamw_step``). The learning rate
is a pure function of the step. The global gradient norm is reduced in global parameter order
(``GradientClip``): every rank takes the norms of its own gradients in one multi-tensor call,
puts them at their global indices of one vector, an all-reduce assembles it exactly (each
entry has one contributor, the rest add zeros), and every rank takes the norm of the same
vector; the norm stays on the device until the trainer reads it with the step loss.
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
    """Fused AdamW with weight decay on matrices only: each tensor's update its own."""
    decay = [p for _, p in named_params if p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": training.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=training.lr, betas=training.betas, eps=1e-8, fused=True)


def adamw_step(param: torch.Tensor, *, fill: bool = True) -> torch.Tensor:
    """A new AdamW step count for ``param``, where fused AdamW keeps it (torch's
    ``Adam._init_group``): a float32 scalar on the parameter's device (CUDA's kernel reads it
    there; a CPU scalar would not do). Zero unless ``fill`` is off (state about to arrive)."""
    make = torch.zeros if fill else torch.empty
    return make((), dtype=torch.float32, device=param.device)


class ClipMode(str, Enum):
    GLOBAL_ORDER = "global-order"  # the determinism contract
    NAIVE = "naive"  # per-stage sums of squares all-reduced: layout-dependent, for contrast


class GradientClip:
    """Clips gradients in place to a global norm of ``max_norm``; the norm before, as a 0-d
    tensor on the device (no host sync).

    ``indexed_params`` pairs each local parameter with its index in global parameter order.
    Data-parallel replicas hold the same (reduced) gradients: only one replica
    ``contributes`` its norms, so each entry of the reduced vector still has one contributor.
    Parameters of the ``uncounted`` indices are clipped but left out of the norm: the copy of
    a tied parameter, whose gradient the other copy counts. The index tensors are made at the
    first call, on the device, and kept: one made from a list each step would be a copy from
    the host that waits for the device.
    """

    def __init__(self, indexed_params: Sequence[tuple[int, torch.nn.Parameter]],
                 num_params: int, *, world: World, contributes: bool = True,
                 mode: ClipMode = ClipMode.GLOBAL_ORDER,
                 uncounted: frozenset[int] = frozenset()) -> None:
        if not indexed_params:
            raise ValueError("GradientClip needs at least one local parameter")
        self.params = [p for _, p in indexed_params]
        self.num_params, self.world, self.contributes, self.mode = (
            num_params, world, contributes, mode)
        # The counted norms' positions among the local parameters, and their global indices.
        self._counted = [k for k, (i, _) in enumerate(indexed_params) if i not in uncounted]
        self._slots = [indexed_params[k][0] for k in self._counted]
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, max_norm: float) -> torch.Tensor:
        grads = [p.grad for p in self.params]
        if self._index is None:
            device = grads[0].device
            self._index = (torch.tensor(self._counted, device=device),
                           torch.tensor(self._slots, device=device))
        counted, slots = self._index
        local = torch.stack(torch._foreach_norm(grads)).index_select(0, counted)
        if self.mode is ClipMode.GLOBAL_ORDER:
            norms = torch.zeros(self.num_params, dtype=local.dtype, device=local.device)
            if self.contributes:
                norms.index_copy_(0, slots, local)
            self.world.all_reduce(norms)
            total = torch.linalg.vector_norm(norms)
        else:
            squares = local.square().sum() * (1.0 if self.contributes else 0.0)
            self.world.all_reduce(squares)
            total = squares.sqrt()
        if max_norm > 0:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total


Subtree = tuple[int, int, list[torch.Tensor]]  # (level, index, the sum's tensors)


class _Subtrees:
    """Sums of subtrees of the binary tree over logical replicas, built left to right: a
    subtree and the one before it of the same level add (left then right, into the left's
    tensors) into their parent where the one before is a left child (an even index). Any
    block of logical replicas, pushed in order, ends as its aligned subtrees
    (``tidal_plan.elastic.subtrees``); the whole tree, as one."""

    def __init__(self) -> None:
        self.nodes: list[Subtree] = []

    def push(self, level: int, index: int, tensors: list[torch.Tensor]) -> None:
        nodes = self.nodes
        while nodes and nodes[-1][0] == level and nodes[-1][1] % 2 == 0:
            _, left_index, left = nodes.pop()
            for a, b in zip(left, tensors, strict=True):
                a.add_(b)
            level, index, tensors = level + 1, left_index // 2, left
        nodes.append((level, index, tensors))


class LogicalReplicaGradients:
    """Each logical replica's gradient apart, summed in one fixed binary tree (strict DP).

    A step's micro-batches form ``L`` logical replicas of ``per_replica`` contiguous
    micro-batches. Parameter gradients accumulate in ``.grad`` in micro-batch order, each
    logical replica's from none (its first micro-batch's gradient is taken as it is, as a
    step's first is); when its last micro-batch is done (``micro_batch_done``), its gradient is
    taken out and pushed into the tree's subtrees (``_Subtrees``). A physical replica with an
    even share runs an aligned block of ``L / dp`` logical replicas (both powers of two), so it
    ends with the block's one subtree (``finish``), and :class:`GradientReducer` adds the
    blocks in the tree's upper levels; an uneven share (``Layout.shares``) ends with several
    (``take``), which the reducer completes. Either way: the same additions, in the same
    order, as one process running all ``L``.
    """

    def __init__(self, stages: Mapping[int, Sequence[torch.nn.Parameter]], *,
                 per_replica: int, mb_offset: int) -> None:
        self.stages, self.per_replica, self.mb_offset = stages, per_replica, mb_offset
        self._trees = {s: _Subtrees() for s in stages}

    def micro_batch_done(self, stage: int, mb: int) -> None:
        """Micro-batch ``mb`` (this replica's numbering) of ``stage`` has its gradients."""
        done = self.mb_offset + mb + 1
        if done % self.per_replica:
            return
        params = self.stages[stage]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        self._trees[stage].push(0, done // self.per_replica - 1, grads)

    def finish(self) -> None:
        """Put each stage's block sum into ``.grad`` (a block that is one subtree)."""
        for stage, tree in self._trees.items():
            if len(tree.nodes) != 1:
                raise RuntimeError(f"stage {stage}: the logical replicas did not close one "
                                   f"subtree ({[level for level, _, _ in tree.nodes]})")
            (_, _, grads), = tree.nodes
            for p, g in zip(self.stages[stage], grads, strict=True):
                p.grad = g
            tree.nodes.clear()

    def take(self) -> list[Subtree]:
        """The block's subtrees, each over every stage's parameters in stage order; ``.grad``
        stays empty (the reducer fills it)."""
        trees = list(self._trees.values())
        out = []
        for parts in zip(*(t.nodes for t in trees), strict=True):
            level, index, _ = parts[0]
            out.append((level, index, [g for _, _, grads in parts for g in grads]))
        for tree in trees:
            tree.nodes.clear()
        return out


def tree_pairs(dp_world: World) -> list[World]:
    """This replica's two-member groups of the strict tree's recursive doubling, one per
    level (dp a power of two; none otherwise), in the order every member builds them."""
    dp, rank = dp_world.size, dp_world.rank
    if dp & (dp - 1):
        return []
    pairs = []
    for level in range(dp.bit_length() - 1):
        a, b = sorted((rank, rank ^ (1 << level)))
        pairs.append(dp_world.subgroup(f"tree{level}.{a}", (dp_world.members[a],
                                                            dp_world.members[b])))
    return pairs


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
                 strict: bool, subtrees: Sequence[Sequence[tuple[int, int]]] = ()) -> None:
        self.params, self.world, self.strict = list(params), dp_world, strict
        self.subtrees = [list(s) for s in subtrees]  # every replica's, uneven shares only
        n, dp, rank = sum(p.numel() for p in self.params), dp_world.size, dp_world.rank
        self.pairs: list[World] = []
        self.chunk = n
        if strict and not self.subtrees and dp & (dp - 1) == 0:
            self.pairs = tree_pairs(dp_world)
        elif strict:
            self.chunk = -(-n // dp)
        like = self.params[0]
        size = dp * self.chunk if strict and not self.pairs else n
        rows = len(self.subtrees[rank]) if self.subtrees else 1  # one per subtree held
        self.flat = torch.zeros(rows * size, dtype=like.dtype, device=like.device)
        self.gathered = torch.empty(size, dtype=like.dtype, device=like.device) if (
            strict and not self.pairs) else None

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

    def reduce_subtrees(self, mine: list[Subtree]) -> None:
        """Uneven shares (strict): each replica ends with its own subtrees of the logical
        replicas' tree. Chunk ``j`` of every subtree goes to replica ``j`` (all-to-all), which
        pushes them in logical order into the tree's upper levels, the same additions as one
        process; the finished chunks are gathered into every ``.grad``."""
        dp, chunk, rank = self.world.size, self.chunk, self.world.rank
        if [(level, index) for level, index, _ in mine] != self.subtrees[rank]:
            raise RuntimeError(f"replica {rank} holds subtrees "
                               f"{[(level, index) for level, index, _ in mine]}, not "
                               f"{self.subtrees[rank]} as the layout's shares say")
        sent = self.flat.view(len(mine), dp * chunk)
        for row, (_, _, grads) in zip(sent, mine, strict=True):
            offset = 0
            for g in grads:
                row[offset : offset + g.numel()].copy_(g.reshape(-1))
                offset += g.numel()
        by_replica = sent.view(len(mine), dp, chunk).transpose(0, 1).contiguous().view(-1)
        got = self.world.all_to_all(by_replica, [len(s) * chunk for s in self.subtrees])
        tree, pieces = _Subtrees(), iter(got.split(chunk))
        for level, index in (node for nodes in self.subtrees for node in nodes):
            tree.push(level, index, [next(pieces)])
        if len(tree.nodes) != 1:
            raise RuntimeError(f"the replicas' subtrees did not close one tree "
                               f"({[(level, index) for level, index, _ in tree.nodes]})")
        self.world.all_gather_into(self.gathered, tree.nodes[0][2][0])
        offset = 0
        for p in self.params:
            p.grad = self.gathered[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
