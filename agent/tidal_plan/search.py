"""The layout search and the scale table (DESIGN.md section 2).

For every worker count in ``[min, max]`` the search enumerates the layouts the job's
hyperparameters allow (data-parallel degree, micro-batch size, schedule, and for each a few
partitions of the placement units), prices each with a predictor, and keeps the fastest one
that fits in memory. Partitions are contiguous and may be uneven (FlexTrain's No-Op
insertion): besides the even split by unit count, one balances stage time (an embedding costs
almost nothing, an LM or MTP head as much as several blocks) and one balances time under the
memory cap, with each stage charged for the micro-batches its schedule keeps in flight.

A worker count is then dropped, with its reason, when no layout satisfies the hyperparameters,
when every layout runs out of memory, when the profiling-based and modeling-based predictors
disagree about its speedup by more than ``max_disagreement``, or when it gains less than
``min_gain`` over the next smaller count kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tidal_api import DroppedRow, ScaleRow, ScaleTable

from tidal_plan.costmodel import (
    NO_SHARDING,
    ModelShape,
    Prediction,
    Sharding,
    UnitCosts,
    model_unit_costs,
    predict,
    step_model,
)
from tidal_plan.devices import Device
from tidal_plan.layout import Layout, LayoutError, ScheduleKind, even_partition
from tidal_plan.profiled import Profile, predict_profiled
from tidal_plan.simulate import estimate_lower_bound


class Predictor(Protocol):
    """What the search needs of a predictor."""

    name: str  # "profiled" or "modeled"
    num_units: int
    gpus_per_rank: int

    def units(self, micro_batch_size: int, dp: int) -> Sequence[UnitCosts]:
        """Per placement unit: seconds and bytes of one micro-batch on one GPU."""
        ...

    def check(self, dp: int) -> str | None:
        """Why ``dp`` replicas break a constraint of the model's sharding, or None."""
        ...

    def predict(self, layout: Layout) -> Prediction: ...

    def bound(self, layout: Layout) -> tuple[float, float]:
        """Lower bounds on ``predict``'s step seconds and on its fullest GPU's peak bytes."""
        ...


@dataclass(frozen=True)
class ModeledPredictor:
    """The modeling-based predictor: FLOPs and bytes over a device description."""

    shape: ModelShape
    device: Device
    sharding: Sharding = NO_SHARDING
    name: str = "modeled"

    @property
    def num_units(self) -> int:
        return self.shape.num_units

    @property
    def gpus_per_rank(self) -> int:
        return self.sharding.gpus_per_rank

    def units(self, micro_batch_size: int, dp: int) -> Sequence[UnitCosts]:
        return model_unit_costs(self.shape, micro_batch_size, self.device, dp, self.sharding)

    def check(self, dp: int) -> str | None:
        try:
            self.sharding.check(self.shape, dp)
        except ValueError as err:
            return str(err)
        return None

    def predict(self, layout: Layout) -> Prediction:
        return predict(self.shape, layout, self.device, self.sharding)

    def bound(self, layout: Layout) -> tuple[float, float]:
        model = step_model(self.shape, layout, self.device, self.sharding)
        step, peak = estimate_lower_bound(layout, model.costs)
        memory = max(state + held for state, held in zip(model.state_bytes, peak, strict=True))
        # The bounds are sums of the very terms the simulation adds, in another order: shave
        # off what rounding could put on top.
        return (step + model.after_pipeline_s) * (1 - 1e-9), memory * (1 - 1e-9)


@dataclass(frozen=True)
class ProfiledPredictor:
    """The profiling-based predictor: the costs measured online, through the simulator."""

    profile: Profile
    seq_len: int
    name: str = "profiled"
    gpus_per_rank: int = 1

    @property
    def num_units(self) -> int:
        return len(self.profile.units)

    def units(self, micro_batch_size: int, dp: int) -> Sequence[UnitCosts]:
        scale = micro_batch_size / self.profile.micro_batch_size
        return [
            UnitCosts(
                forward_s=u.forward_s * scale,
                input_grad_s=u.input_grad_s * scale,
                weight_grad_s=u.weight_grad_s * scale,
                activation_bytes=u.activation_bytes * scale,
                state_bytes=4 * u.param_bytes,  # fp32 parameters, gradients, two moments
                allreduce_bytes=0.0,
            )
            for u in self.profile.units
        ]

    def check(self, dp: int) -> str | None:
        return None

    def predict(self, layout: Layout) -> Prediction:
        return predict_profiled(self.profile, layout, self.seq_len)

    def bound(self, layout: Layout) -> tuple[float, float]:
        # The profiled costs settle core sharing over up to a dozen dry runs: a bound from them
        # would cost what the prediction costs. No bound: every candidate is priced (the
        # profiled models are the small ones this machine runs).
        return 0.0, 0.0


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What may vary between rows, and the thresholds that drop rows.

    ``dp`` fixes the data-parallel degree (strict consistency keeps it; 1 in this runtime) or,
    with None, lets every divisor compete. ``micro_batch_sizes`` lists the allowed sizes (one
    in strict mode: the size fixes the reduction order). ``memory_bytes`` caps each GPU.
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
    priced: int  # of those, how many went through the simulator
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


# --- partitions ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StageMemory:
    """What a unit costs the stage that holds it: its state, plus its activations for each
    micro-batch the stage keeps in flight (a stage may keep more than another)."""

    state: Sequence[float]  # per unit
    activation: Sequence[float]  # per unit, one micro-batch
    in_flight: Sequence[float]  # per stage


def _pack(
    seconds: Sequence[float],
    memory: StageMemory | None,
    stages: int,
    limit: float,
    cap: float,
) -> tuple[int, ...] | None:
    """Greedy contiguous packing: each stage takes units while its seconds stay within
    ``limit`` and its memory within ``cap``.

    Returns ``stages`` stage sizes, or None when the limits cannot be met. Packing each stage as
    full as possible is optimal for feasibility (a later boundary never hurts later stages), and
    leaves one unit for each stage still to come.
    """
    n = len(seconds)
    state, activation = (memory.state, memory.activation) if memory else ((0.0,) * n,) * 2
    sizes, unit = [], 0
    for stage in range(stages):
        end = n - (stages - stage - 1)
        held = memory.in_flight[stage] if memory else 0.0
        time = mem = 0.0
        j = unit
        while j < end:
            t, m = seconds[j], state[j] + activation[j] * held
            if j > unit and (time + t > limit or mem + m > cap):
                break
            time, mem, j = time + t, mem + m, j + 1
        if time > limit or mem > cap:
            return None
        sizes.append(j - unit)
        unit = j
    return tuple(sizes) if unit == n else None


def balanced_partition(
    seconds: Sequence[float],
    stages: int,
    memory: StageMemory | None = None,
    memory_cap: float = float("inf"),
) -> tuple[int, ...] | None:
    """Contiguous stages minimising the slowest stage's seconds, each stage's memory capped.

    None if no partition fits.
    """
    n = len(seconds)
    if not 1 <= stages <= n:
        return None

    def feasible(limit: float) -> tuple[int, ...] | None:
        return _pack(seconds, memory, stages, limit, memory_cap)

    hi = sum(seconds) + 1e-30
    best = feasible(hi)
    if best is None:
        return None
    lo = max(seconds)
    for _ in range(40):
        mid = (lo + hi) / 2
        found = feasible(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
        if hi - lo <= 1e-6 * hi:
            break
    return best


def in_flight(kind: ScheduleKind, pp: int, rank: int, m: int, v: int) -> float:
    """Micro-batches whose activations a stage on ``rank`` keeps at its peak (approximate)."""
    if kind is ScheduleKind.GPIPE:
        return m
    if kind is ScheduleKind.ZERO_BUBBLE:
        return min(m, pp)
    if kind is ScheduleKind.INTERLEAVED:
        return min(m, ((v - 1) * pp + 2 * (pp - rank - 1) + 1) / v)
    return min(m, pp - rank)


def candidate_partitions(
    units: Sequence[UnitCosts], kind: ScheduleKind, pp: int, v: int, m: int, memory_cap: float
) -> list[tuple[int, ...]]:
    """Even, time-balanced and memory-capped time-balanced partitions, without repeats."""
    stages = pp * v
    seconds = [u.seconds for u in units]
    held = [in_flight(kind, pp, rank, m, v) for rank in range(pp)]
    memory = StageMemory(
        state=[u.state_bytes for u in units],
        activation=[u.activation_bytes for u in units],
        in_flight=[held[stage % pp] for stage in range(stages)],
    )
    found = [
        even_partition(len(units), stages),
        balanced_partition(seconds, stages),
        balanced_partition(seconds, stages, memory, memory_cap / v),
    ]
    out: list[tuple[int, ...]] = []
    for partition in found:
        if partition is not None and partition not in out:
            out.append(partition)
    return out


# --- the search ----------------------------------------------------------------------------------


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
        for mbs in space.micro_batch_sizes:
            if space.global_batch_size % (dp * mbs):
                yield (f"dp={dp} x micro-batch {mbs} does not divide the global batch "
                       f"{space.global_batch_size}")
                continue
            m = space.global_batch_size // (dp * mbs)
            costs = predictor.units(mbs, dp)
            for kind in space.schedules:
                if pp == 1 and kind is not ScheduleKind.ONE_F_ONE_B:
                    continue  # one rank: every schedule is the same sequential step
                v = space.virtual_stages if kind is ScheduleKind.INTERLEAVED else 1
                if kind is ScheduleKind.INTERLEAVED and (m % pp or pp * v > units or v < 2):
                    yield f"interleaved needs m % pp == 0 and pp x v <= units (dp={dp} pp={pp})"
                    continue
                for partition in candidate_partitions(
                    costs, kind, pp, v, m, space.memory_bytes
                ):
                    try:
                        yield Layout(pp=pp, dp=dp, partition=partition, micro_batch_size=mbs,
                                     num_micro_batches=m, schedule=kind, virtual_stages=v)
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
            dp=lay.dp,
            pp=lay.pp,
            partition=lay.partition,
            schedule=lay.schedule.value,
            virtual_stages=lay.virtual_stages,
            micro_batch_size=lay.micro_batch_size,
            num_micro_batches=lay.num_micro_batches,
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
