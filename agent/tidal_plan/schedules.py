"""Schedule generators: the compute actions of one training step, per pipeline rank.

Each generator returns, for every pipeline rank, the ordered list of its F/B (or F/I/W) actions;
communication is added later by :mod:`tidal_plan.lowering`. Whatever the schedule, the backward
of every stage runs its micro-batches in order 0, 1, 2, ...: gradients accumulate in
micro-batch order, which the strict determinism contract needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from tidal_api.layout import Layout, LayoutError, ScheduleKind
from tidal_plan.ir import Action, Kind

Schedule = dict[int, list[Action]]


def compute_actions(layout: Layout) -> Schedule:
    """Per-rank compute-only actions of one step under ``layout.schedule``."""
    return _GENERATORS[layout.schedule](layout)


def _gpipe(layout: Layout) -> Schedule:
    # One stage per rank (virtual_stages is 1 for every schedule but interleaved).
    m = layout.num_micro_batches
    return {
        rank: [Action(rank, Kind.F, mb) for mb in range(m)]
        + [Action(rank, Kind.B, mb) for mb in range(m)]
        for rank in range(layout.pp)
    }


def _one_f_one_b(layout: Layout) -> Schedule:
    # Megatron's 1F1B: rank r runs pp - r - 1 warm-up forwards, then alternates one forward and
    # one backward, then drains the remaining backwards. Rank r never holds more than pp - r
    # micro-batches' activations.
    pp, m = layout.pp, layout.num_micro_batches
    schedule: Schedule = {}
    for rank in range(pp):
        warmup = min(m, pp - rank - 1)
        actions = [Action(rank, Kind.F, mb) for mb in range(warmup)]
        for mb in range(m - warmup):
            actions += [Action(rank, Kind.F, warmup + mb), Action(rank, Kind.B, mb)]
        actions += [Action(rank, Kind.B, mb) for mb in range(m - warmup, m)]
        schedule[rank] = actions
    return schedule


def _interleaved(layout: Layout) -> Schedule:
    # Megatron's interleaved 1F1B. Micro-batches go through the v chunks of a rank in groups of
    # pp: the k-th forward of a rank is chunk (k // pp) % v on micro-batch
    # (k // (pp * v)) * pp + k % pp, the k-th backward the same with the chunks reversed. Rank r
    # warms up with (v - 1) * pp + 2 * (pp - r - 1) forwards, then alternates, then drains.
    pp, v, m = layout.pp, layout.virtual_stages, layout.num_micro_batches
    if m % pp:
        raise LayoutError(
            f"interleaved needs a micro-batch count divisible by pp: {m} micro-batches on "
            f"pp={pp}; use {m - m % pp or pp} or {m + pp - m % pp} micro-batches"
        )
    total = m * v

    def virtual(rank: int, k: int, kind: Kind) -> Action:
        chunk = (k // pp) % v
        if kind is Kind.B:
            chunk = v - 1 - chunk
        mb = (k // (pp * v)) * pp + k % pp
        return Action(chunk * pp + rank, kind, mb)

    schedule: Schedule = {}
    for rank in range(pp):
        warmup = min(total, (v - 1) * pp + 2 * (pp - rank - 1))
        actions = [virtual(rank, k, Kind.F) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [virtual(rank, warmup + k, Kind.F), virtual(rank, k, Kind.B)]
        actions += [virtual(rank, k, Kind.B) for k in range(total - warmup, total)]
        schedule[rank] = actions
    return schedule


def _zero_bubble_h1(layout: Layout) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023), built by list scheduling.

    The backward is split into I (input gradient, on the critical path) and W (weight gradient,
    off it). Stepping through unit time, every free rank r takes, in order of preference:

    - the next F, once its input is there, if that keeps at most ``pp - r`` forwards without
      their I (1F1B's warm-up) and at most ``pp`` micro-batches without their W (the peak
      activation memory of 1F1B's first rank, which ZB-H1 allows every rank);
    - the next I, once its output gradient is there;
    - the oldest pending W, filling what would otherwise be a bubble.

    With F = I = W and m >= pp this gives the paper's ZB-H1 shape and its makespan of
    (3m + pp - 1) units against 1F1B's 3(m + pp - 1). Unit times shape the order only; the
    order is deadlock-free under any costs.
    """
    pp, m = layout.pp, layout.num_micro_batches
    last, never = pp - 1, 1 << 62
    # Finish times of F and I per (rank, micro-batch): plain lists, as the planner builds
    # these lists for thousands of (pp, m) pairs.
    f_done = [[never] * m for _ in range(pp)]
    i_done = [[never] * m for _ in range(pp)]
    next_f, next_i, next_w = [0] * pp, [0] * pp, [0] * pp
    free_at = [0] * pp
    schedule: Schedule = {rank: [] for rank in range(pp)}
    finished = 0  # ranks with every W done
    # Even a fully serial run ends within 3 * m * pp steps; running past them is a bug here,
    # not a bad layout.
    for now in range(3 * m * pp + 1):
        for rank in range(pp):
            if free_at[rank] > now:
                continue
            f, i, w = next_f[rank], next_i[rank], next_w[rank]
            input_ready = rank == 0 or f < m and f_done[rank - 1][f] <= now
            if f < m and input_ready and f - i < pp - rank and f - w < pp:
                next_f[rank], f_done[rank][f] = f + 1, now + 1
                schedule[rank].append(Action(rank, Kind.F, f))
            # F(rank, i) is done: i < f and the rank is free.
            elif i < f and (rank == last or i_done[rank + 1][i] <= now):
                next_i[rank], i_done[rank][i] = i + 1, now + 1
                schedule[rank].append(Action(rank, Kind.I, i))
            elif w < i:
                next_w[rank] = w + 1
                finished += w + 1 == m
                schedule[rank].append(Action(rank, Kind.W, w))
            else:
                continue
            free_at[rank] = now + 1
        if finished == pp:
            return schedule
    raise RuntimeError(f"zero-bubble list scheduling did not finish for {layout.describe()}")


_GENERATORS: dict[ScheduleKind, Callable[[Layout], Schedule]] = {
    ScheduleKind.GPIPE: _gpipe,
    ScheduleKind.ONE_F_ONE_B: _one_f_one_b,
    ScheduleKind.INTERLEAVED: _interleaved,
    ScheduleKind.ZERO_BUBBLE: _zero_bubble_h1,
}


def validate_compute(layout: Layout, actions: Mapping[int, Sequence[Action]]) -> None:
    """Check that per-rank compute actions make one complete, deterministic step.

    Raises ``ValueError`` if a rank is missing or unknown, an action is not compute or sits on
    the wrong rank, a stage misses or repeats the F or the backward (B, or I and W) of a
    micro-batch, a backward comes before its forward, a W before its I, or the backwards of a
    stage are not in micro-batch order. Cross-rank ordering is the dry run's job.
    """
    if set(actions) != set(range(layout.pp)):
        raise ValueError(
            f"actions are given for ranks {sorted(actions)}; layout {layout.describe()} "
            f"needs exactly ranks 0..{layout.pp - 1}"
        )
    seen: dict[Action, int] = {}  # action -> position in its rank's list
    for rank, rank_actions in actions.items():
        for position, action in enumerate(rank_actions):
            _check_placement(layout, rank, action)
            if action in seen:
                raise ValueError(f"rank {rank} runs {action} twice: keep only one")
            seen[action] = position
    for stage in range(layout.num_stages):
        _check_stage(layout, stage, seen)


def _check_placement(layout: Layout, rank: int, action: Action) -> None:
    if not action.kind.is_compute:
        raise ValueError(
            f"rank {rank} has {action}: compute lists hold F, B, I and W only; "
            f"lowering adds communication"
        )
    if not 0 <= action.stage < layout.num_stages:
        raise ValueError(f"{action} names a stage outside 0..{layout.num_stages - 1}")
    if not 0 <= action.mb < layout.num_micro_batches:
        raise ValueError(
            f"{action} names a micro-batch outside 0..{layout.num_micro_batches - 1}"
        )
    if layout.stage_rank(action.stage) != rank:
        raise ValueError(
            f"{action} is on rank {rank}, but stage {action.stage} runs on rank "
            f"{layout.stage_rank(action.stage)}: move it there"
        )


def _check_stage(layout: Layout, stage: int, seen: Mapping[Action, int]) -> None:
    rank = layout.stage_rank(stage)
    for mb in range(layout.num_micro_batches):
        forward, full, input_grad, weight_grad = (
            Action(stage, kind, mb) for kind in (Kind.F, Kind.B, Kind.I, Kind.W)
        )
        if forward not in seen:
            raise ValueError(f"stage {stage} misses {forward}: add it to rank {rank}")
        split = input_grad in seen or weight_grad in seen
        if (full in seen) == split:
            raise ValueError(
                f"stage {stage} micro-batch {mb} needs one backward on rank {rank}: "
                f"either {full} or both {input_grad} and {weight_grad}"
            )
        if split and not (input_grad in seen and weight_grad in seen):
            missing = weight_grad if input_grad in seen else input_grad
            raise ValueError(f"stage {stage} splits its backward but misses {missing}: add it")
        backward = input_grad if split else full
        if seen[backward] < seen[forward]:
            raise ValueError(f"{backward} runs before {forward} on rank {rank}: swap them")
        if split and seen[weight_grad] < seen[input_grad]:
            raise ValueError(f"{weight_grad} runs before {input_grad} on rank {rank}: swap them")
    # The input gradients (B or I) and the weight-gradient accumulations (B or W) must each
    # follow micro-batch order; the latter is what makes gradients bitwise reproducible.
    for kinds in ((Kind.B, Kind.I), (Kind.B, Kind.W)):
        ordered = sorted(
            (seen[action], mb)
            for mb in range(layout.num_micro_batches)
            for kind in kinds
            if (action := Action(stage, kind, mb)) in seen
        )
        mbs = [mb for _, mb in ordered]
        if mbs != sorted(mbs):
            names = "/".join(kind.value for kind in kinds)
            raise ValueError(
                f"stage {stage} runs its {names} actions on micro-batches {mbs}: "
                f"run them in micro-batch order so gradients accumulate deterministically"
            )
