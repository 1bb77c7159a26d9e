"""Schedule generators: the compute actions of one training step, per pipeline rank.

Each generator gives, for every pipeline rank, the order of its F/B (or F/I/W) actions compactly,
as the string of their kinds (and with interleaving, the stage of each): the form the estimate
runs; ``compute_actions`` numbers them into actions, and :mod:`tidal_plan.lowering` adds the
communication. Whatever the schedule, the backward of every stage runs its micro-batches in
order 0, 1, 2, ...: gradients accumulate in micro-batch order, which the strict determinism
contract needs.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from tidal_api.layout import Layout, LayoutError, ScheduleKind
from tidal_plan.ir import Action, Kind

Schedule = dict[int, list[Action]]


def compute_actions(layout: Layout) -> Schedule:
    """Per-rank compute-only actions of one step under ``layout.schedule``."""
    if layout.schedule is ScheduleKind.INTERLEAVED:
        orders = interleaved_order(layout)
    else:
        orders = [(kinds, itertools.repeat(rank)) for rank, kinds in enumerate(rank_kinds(layout))]
    return {rank: _numbered(kinds, stages) for rank, (kinds, stages) in enumerate(orders)}


def rank_kinds(layout: Layout) -> list[str]:
    """The order of a schedule with one stage per rank (all but interleaved), compactly: per
    rank, the kinds of its compute actions, e.g. ``"FFIWF..."``.

    Rank ``r`` runs stage ``r``, and each kind takes the micro-batches in order (its k-th F is
    the forward of micro-batch k). The estimate runs this form: a step the planner prices can
    hold a hundred thousand actions, and building an ``Action`` each costs more than
    simulating it.
    """
    if layout.schedule is ScheduleKind.INTERLEAVED:
        raise ValueError("an interleaved rank runs several stages: use interleaved_order")
    return _KIND_ORDERS[layout.schedule](layout.pp, layout.num_micro_batches)


def interleaved_order(layout: Layout) -> list[tuple[str, list[int]]]:
    """Megatron's interleaved 1F1B, compactly (as ``rank_kinds``): per rank, the kinds of its
    compute actions and the stage of each; each stage takes the micro-batches in order.

    Micro-batches go through the v chunks of a rank in groups of pp: the k-th forward of a
    rank is chunk (k // pp) % v on micro-batch (k // (pp * v)) * pp + k % pp, the k-th
    backward the same with the chunks reversed. Rank r warms up with (v - 1) * pp + 2 * (pp -
    r - 1) forwards, then alternates, then drains.
    """
    pp, v, m = layout.pp, layout.virtual_stages, layout.num_micro_batches
    if m % pp:
        raise LayoutError(
            f"interleaved needs a micro-batch count divisible by pp: {m} micro-batches on "
            f"pp={pp}; use {m - m % pp or pp} or {m + pp - m % pp} micro-batches"
        )
    total = m * v
    orders = []
    for rank in range(pp):
        warmup = min(total, (v - 1) * pp + 2 * (pp - rank - 1))
        kinds = "F" * warmup + "FB" * (total - warmup) + "B" * warmup
        # The stages of its forwards in turn, pp micro-batches each, and of its backwards.
        chunks = {
            "F": iter([c * pp + rank for c in range(v) for _ in range(pp)] * (m // pp)),
            "B": iter([c * pp + rank for c in reversed(range(v)) for _ in range(pp)] * (m // pp)),
        }
        orders.append((kinds, list(map(next, map(chunks.__getitem__, kinds)))))
    return orders


_KINDS = {kind.value: kind for kind in Kind}


def _numbered(kinds: str, stages: Iterable[int]) -> list[Action]:
    """``kinds`` as actions on ``stages``, each stage and kind numbering its micro-batches
    from 0."""
    done: Counter[tuple[int, str]] = Counter()
    actions = []
    for letter, stage in zip(kinds, stages):
        actions.append(Action(stage, _KINDS[letter], done[stage, letter]))
        done[stage, letter] += 1
    return actions


def _gpipe(pp: int, m: int) -> list[str]:
    return ["F" * m + "B" * m] * pp


def _one_f_one_b(pp: int, m: int) -> list[str]:
    # Megatron's 1F1B: rank r runs pp - r - 1 warm-up forwards, then alternates one forward and
    # one backward, then drains the remaining backwards. Rank r never holds more than pp - r
    # micro-batches' activations.
    warmups = (min(m, pp - rank - 1) for rank in range(pp))
    return ["F" * w + "FB" * (m - w) + "B" * w for w in warmups]


def _zero_bubble_h1(pp: int, m: int) -> list[str]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023), as list scheduling orders it.

    The backward is split into I (input gradient, on the critical path) and W (weight gradient,
    off it). Stepping through unit time, every free rank r takes, in order of preference:

    - the next F, once its input is there, if that keeps at most ``pp - r`` forwards without
      their I (1F1B's warm-up) and at most ``pp`` micro-batches without their W (the peak
      activation memory of 1F1B's first rank, which ZB-H1 allows every rank);
    - the next I, once its output gradient is there;
    - the oldest pending W, filling what would otherwise be a bubble.

    The order this gives has a closed form, built here (the planner asks for steps of
    hundreds of micro-batches on dozens of ranks; tests/unit/test_schedules.py runs the list
    scheduling itself against it): rank r runs ``k = min(m, pp - r)`` forwards, then ``j =
    min(r, m - k)`` pairs I F while the gradients of the first micro-batches come back, then
    the steady state I W F, then drains with ``k`` pairs I W and ``j`` last W.

    With F = I = W and m >= pp this gives the paper's ZB-H1 shape and its makespan of
    (3m + pp - 1) units against 1F1B's 3(m + pp - 1). Unit times shape the order only; the
    order is deadlock-free under any costs.
    """
    orders = []
    for rank in range(pp):
        k = min(m, pp - rank)
        j = min(rank, m - k)
        orders.append("F" * k + "IF" * j + "IWF" * (m - k - j) + "IW" * k + "W" * j)
    return orders


_KIND_ORDERS: dict[ScheduleKind, Callable[[int, int], list[str]]] = {
    ScheduleKind.GPIPE: _gpipe,
    ScheduleKind.ONE_F_ONE_B: _one_f_one_b,
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
