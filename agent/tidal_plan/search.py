"""The layout search and the scale table (DESIGN.md section 2).

For every worker count in ``[min, max]`` the search enumerates the layouts the job's
hyperparameters allow (data-parallel degree, micro-batch size, schedule, and for each a few
partitions of the placement units), prices each with a predictor, and keeps the fastest one
that fits in memory (the partitions are ``tidal_plan.partition``'s, the predictors
``tidal_plan.predictors``').

A worker count is then dropped, with its reason, when no layout satisfies the hyperparameters,
when every layout runs out of memory, when the profiling-based and modeling-based predictors
disagree about its speedup by more than ``max_disagreement``, or when it gains less than
``min_gain`` over the next smaller count kept.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tidal_api import DroppedRow, ScaleRow, ScaleTable
from tidal_api.layout import Layout, LayoutError, ScheduleKind
from tidal_plan.costmodel import Prediction
from tidal_plan.partition import candidate_partitions
from tidal_plan.predictors import Predictor


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What may vary between rows, and the thresholds that drop rows.

    ``dp`` fixes the data-parallel degree (strict consistency keeps it; 1 in this runtime) or,
    with None, lets every divisor compete. ``micro_batch_sizes`` lists the allowed sizes (one
    in strict mode: the size fixes the reduction order). ``memory_bytes`` caps each GPU.
    ``checkpointing`` lists the activation checkpointing settings a layout may take: with
    both, a checkpointed layout wins only where it fits and the other does not (it is slower).
    """

    min_workers: int
    max_workers: int
    global_batch_size: int
    micro_batch_sizes: tuple[int, ...]
    memory_bytes: float
    dp: int | None = 1
    gpus_per_worker: int = 1
    schedules: tuple[ScheduleKind, ...] = tuple(ScheduleKind)
    virtual_stages: int = 2
    checkpointing: tuple[bool, ...] = (False,)
    logical_replicas: int = 0  # strict data parallelism: dp must divide it (0: no constraint)
    min_gain: float = 0.05
    max_disagreement: float = 0.25

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"worker range [{self.min_workers}, {self.max_workers}] is empty or below 1"
            )
        if not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1:
            raise ValueError("give at least one micro-batch size, each at least 1")
        if self.min_gain < 0 or self.max_disagreement < 0:
            raise ValueError("min_gain and max_disagreement must be non-negative")


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """The fastest layout found for one worker count."""

    workers: int
    layout: Layout
    prediction: Prediction
    considered: int  # layouts that satisfy the hyperparameters
    priced: int  # of those, how many a predictor priced
    out_of_memory: int  # how many were found not to fit


@dataclass(frozen=True, kw_only=True, slots=True)
class Dropped:
    workers: int
    reason: str
    detail: str


@dataclass(kw_only=True)
class SearchResult:
    """Per worker count a ``Choice`` or a ``Dropped``, before and after the row filters."""

    choices: dict[int, Choice] = field(default_factory=dict)
    dropped: dict[int, Dropped] = field(default_factory=dict)
    other: dict[int, Prediction] = field(default_factory=dict)  # the second predictor's view
    names: tuple[str, str] = ("", "")  # the choosing predictor's name, the other's


# --- the search ----------------------------------------------------------------------------------


# Zero-bubble's split backward under activation checkpointing: torch's W unpacks a checkpointed
# layer's saved tensors anew, and each unpacking recomputes the layer's forward, so W holds
# about three times a layer's activations at once and runs as many extra forwards (measured
# on the CPU: docs/benchmarks.md). The cost model prices one recompute, in I: not planned.
SPLIT_RECOMPUTE = ("zero-bubble with activation checkpointing recomputes each layer again in "
                   "W, which the cost model does not price: use 1f1b or interleaved")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    predictor: Predictor, space: SearchSpace, workers: int
) -> Iterator[Layout | str]:
    """Every layout ``workers`` may run, or for a shape that breaks a constraint, why."""
    gpus = workers * space.gpus_per_worker
    if gpus % predictor.gpus_per_rank:
        yield (f"{workers} workers x {space.gpus_per_worker} GPUs do not split into pipeline "
               f"ranks of {predictor.gpus_per_rank} GPUs")
        return
    ranks = gpus // predictor.gpus_per_rank
    units = predictor.num_units
    dps = [space.dp] if space.dp is not None else _divisors(ranks)
    for dp in dps:
        if ranks % dp:
            yield f"dp={dp} does not divide {ranks} pipeline ranks"
            continue
        if space.logical_replicas and space.logical_replicas % dp:
            yield (f"dp={dp} does not divide the {space.logical_replicas} logical replicas "
                   "(strict data parallelism)")
            continue
        pp = ranks // dp
        if pp > units:
            yield (f"pp={pp} (dp={dp}) exceeds the model's {units} placement units: "
                   f"use at most {units * dp * predictor.gpus_per_rank // space.gpus_per_worker}"
                   " workers or add layers")
            continue
        reason = predictor.check(dp)
        if reason is not None:
            yield reason
            continue
        for mbs, ac in itertools.product(space.micro_batch_sizes, space.checkpointing):
            if space.global_batch_size % (dp * mbs):
                yield (f"dp={dp} x micro-batch {mbs} does not divide the global batch "
                       f"{space.global_batch_size}")
                continue
            m = space.global_batch_size // (dp * mbs)
            costs = predictor.units(mbs, dp, ac)
            # One rank: every schedule is the same sequential step.
            for kind in space.schedules if pp > 1 else (ScheduleKind.ONE_F_ONE_B,):
                if ac and kind is ScheduleKind.ZERO_BUBBLE:
                    yield SPLIT_RECOMPUTE
                    continue
                v = space.virtual_stages if kind is ScheduleKind.INTERLEAVED else 1
                if kind is ScheduleKind.INTERLEAVED and (m % pp or pp * v > units or v < 2):
                    yield f"interleaved needs m % pp == 0 and pp x v <= units (dp={dp} pp={pp})"
                    continue
                for partition in candidate_partitions(
                    costs, kind, pp, v, m, space.memory_bytes
                ):
                    try:
                        yield Layout(pp=pp, dp=dp, partition=partition, micro_batch_size=mbs,
                                     num_micro_batches=m, schedule=kind, virtual_stages=v,
                                     activation_checkpointing=ac)
                    except LayoutError as err:
                        yield str(err)


def choose(predictor: Predictor, space: SearchSpace, workers: int) -> Choice | Dropped:
    """The fastest layout for ``workers`` that fits, or why there is none.

    Candidates are priced in the order of their lower bounds; once a bound exceeds the best
    step found, no later candidate can win and the rest are skipped (branch and bound).
    """
    reasons: list[str] = []
    bounded = []
    for candidate in candidates(predictor, space, workers):
        if isinstance(candidate, str):
            reasons.append(candidate)
        else:
            bounded.append((predictor.bound(candidate), len(bounded), candidate))
    if not bounded:
        return Dropped(workers=workers, reason="hyperparameters",
                       detail=reasons[0] if reasons else "no layout")
    bounded.sort(key=lambda entry: entry[:2])
    best: tuple[Layout, Prediction] | None = None
    priced = oom = 0
    smallest_peak = float("inf")
    for (step_bound, memory_bound), _, candidate in bounded:
        if best is not None and step_bound >= best[1].step_seconds:
            break
        if memory_bound > space.memory_bytes:
            oom += 1
            smallest_peak = min(smallest_peak, memory_bound)
            continue
        prediction = predictor.predict(candidate)
        priced += 1
        peak = max(prediction.peak_memory_bytes)
        if peak > space.memory_bytes:
            oom += 1
            smallest_peak = min(smallest_peak, peak)
            continue
        if best is None or prediction.step_seconds < best[1].step_seconds:
            best = (candidate, prediction)
    if best is not None:
        return Choice(workers=workers, layout=best[0], prediction=best[1],
                      considered=len(bounded), priced=priced, out_of_memory=oom)
    return Dropped(
        workers=workers, reason="memory",
        detail=f"all {len(bounded)} layouts exceed {space.memory_bytes / 2**30:.1f} GiB per "
               f"GPU; the smallest peak is at least {smallest_peak / 2**30:.1f} GiB",
    )


def search(
    predictor: Predictor, space: SearchSpace, other: Predictor | None = None,
    on_row: Callable[[int], None] | None = None,
) -> SearchResult:
    """Choose a layout per worker count, then drop rows that disagree or gain too little.

    ``other`` is the second predictor: each chosen layout is priced by it too, and a row whose
    speedup over the first row the two predictors put more than ``max_disagreement`` apart
    (as a ratio) is dropped.
    """
    result = SearchResult(names=(predictor.name, other.name if other else ""))
    for workers in range(space.min_workers, space.max_workers + 1):
        found = choose(predictor, space, workers)
        if isinstance(found, Dropped):
            result.dropped[workers] = found
        else:
            result.choices[workers] = found
            if other is not None:
                result.other[workers] = other.predict(found.layout)
        if on_row is not None:
            on_row(workers)
    _filter(result, space)
    return result


def _filter(result: SearchResult, space: SearchSpace) -> None:
    base: Choice | None = None
    last: Choice | None = None
    for workers in sorted(result.choices):
        choice = result.choices[workers]
        if base is None or last is None:
            base = last = choice
            continue
        why = _disagreement(result, space, base, choice) or _small_gain(space, last, choice)
        if why is None:
            last = choice
        else:
            result.dropped[workers] = Dropped(workers=workers, reason=why[0], detail=why[1])
    for workers in result.dropped:
        result.choices.pop(workers, None)


def _disagreement(
    result: SearchResult, space: SearchSpace, base: Choice, choice: Choice
) -> tuple[str, str] | None:
    other = result.other
    if choice.workers not in other or base.workers not in other:
        return None
    mine = base.prediction.step_seconds / choice.prediction.step_seconds
    theirs = other[base.workers].step_seconds / other[choice.workers].step_seconds
    apart = mine / theirs - 1
    if abs(apart) <= space.max_disagreement:
        return None
    return "disagreement", (
        f"speedup over {base.workers} workers {mine:.2f}x {result.names[0]}, {theirs:.2f}x "
        f"{result.names[1]} ({apart:+.0%}, more than {space.max_disagreement:.0%} apart)"
    )


def _small_gain(space: SearchSpace, last: Choice, choice: Choice) -> tuple[str, str] | None:
    before, after = last.prediction.step_seconds, choice.prediction.step_seconds
    gain = before / after - 1
    if gain >= space.min_gain:
        return None
    return "gain", (
        f"{gain:+.1%} over {last.workers} workers ({before:.4g} s -> {after:.4g} s), under the "
        f"{space.min_gain:.0%} threshold"
    )


def scale_table(
    result: SearchResult,
    space: SearchSpace,
    *,
    job: str,
    device: str,
    seq_len: int,
) -> ScaleTable:
    """The contract form of a search result (``tidal_api.ScaleTable``)."""
    rows = []
    base = None
    for workers in sorted(result.choices):
        choice = result.choices[workers]
        lay, pred = choice.layout, choice.prediction
        base = base or pred
        other = result.other.get(workers)
        rows.append(ScaleRow(
            workers=workers,
            gpus=workers * space.gpus_per_worker,
            layout=lay,
            step_seconds=pred.step_seconds,
            tokens_per_second=pred.tokens_per_second,
            peak_memory_bytes=max(pred.peak_memory_bytes),
            speedup=pred.tokens_per_second / base.tokens_per_second,
            predictor=result.names[0],
            other_step_seconds=other.step_seconds if other is not None else None,
        ))
    dropped = [
        DroppedRow(workers=d.workers, reason=d.reason, detail=d.detail)
        for d in sorted(result.dropped.values(), key=lambda d: d.workers)
    ]
    return ScaleTable(
        job=job, device=device, source=result.names[0], min_workers=space.min_workers,
        max_workers=space.max_workers, gpus_per_worker=space.gpus_per_worker,
        global_batch_size=space.global_batch_size, seq_len=seq_len, min_gain=space.min_gain,
        rows=tuple(rows), dropped=tuple(dropped),
    )
