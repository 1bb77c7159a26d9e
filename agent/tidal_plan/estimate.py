"""Fast estimate of a pipeline step: the dry run's makespan, bubble and peak memory, for planning.

The search prices thousands of candidate layouts, some with hundreds of micro-batches on dozens
of ranks. ``estimate_step`` gives ``dry_run``'s makespan, bubble and peak memory without a
timeline: each rank runs its order in the schedules' compact form (a string of kinds, no
``Action`` built) on its own clock, taking turns with the others, and a long step is simulated
at three shorter micro-batch counts and extended along the straight line they lie on. A
pipeline in steady state adds the same time and memory per period of micro-batches, so after
the warm-up the makespan is affine in the count; the three points check it, and where they
disagree the whole step is simulated. Where a long transient passes the check by chance, the
estimate is a little off (see estimate_step).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Generator
from dataclasses import dataclass

from tidal_api.layout import Layout, ScheduleKind
from tidal_plan.actioncosts import Costs, per_stage
from tidal_plan.dryrun import DeadlockError
from tidal_plan.ir import Kind
from tidal_plan.schedules import interleaved_order, rank_kinds


@dataclass(frozen=True, kw_only=True, slots=True)
class StepEstimate:
    """``dry_run``'s figures without the timeline; ``simulated`` micro-batches were run."""

    makespan: float
    bubble_fraction: float
    peak_memory: tuple[float, ...]
    simulated: tuple[int, ...]


def _replay(layout: Layout, costs: Costs) -> tuple[float, float, tuple[float, ...]]:
    """Makespan, busy rank-seconds and per-rank peak memory of one step.

    Each rank runs its actions in order on its own clock, taking turns with the others until
    it waits for a result not there yet. A result's slot, ``(2 stage + role) m +
    micro-batch`` (role 0: a forward's output, 1: an input gradient, B or I), holds the time
    it reaches the neighbouring rank: a SEND is posted the moment its compute ends and arrives
    ``comm`` later; a RECV right before its compute only moves the rank's clock to that
    arrival, which the compute's own wait does too, so this gives ``dry_run``'s times to the
    bit. An action waits for at most one result of another rank; what it needs of its own
    rank (the F before its B, the I before its W) ran before it on the rank's clock. The
    ``m`` slots past the last one, ready at time 0, stand in for none.
    """
    stages, m = layout.num_stages, layout.num_micro_batches
    f = per_stage(costs.forward, stages)
    i = per_stage(costs.input_grad, stages)
    w = per_stage(costs.weight_grad, stages)
    arrival = [-1.0] * (2 * stages * m) + [0.0] * m
    if layout.schedule is ScheduleKind.INTERLEAVED:
        orders = interleaved_order(layout)
        timelines = [_chunk_timeline(kinds, on, arrival, layout, f, i, w, costs.comm)
                     for kinds, on in orders]
        peak = _chunk_peaks(orders, costs)
    else:
        kinds_of = rank_kinds(layout)
        timelines = [_stage_timeline(rank, kinds, arrival, layout, f, i, w, costs.comm)
                     for rank, kinds in enumerate(kinds_of)]
        peak = _stage_peaks(kinds_of, costs)
    busy = m * (math.fsum(f) + math.fsum(i) + math.fsum(w))
    return max(_run(layout, timelines)), busy, peak


def _stage_peaks(kinds_of: list[str], costs: Costs) -> tuple[float, ...]:
    """Each rank's peak memory, one stage per rank: a rank's memory depends on its order
    alone, each action adding ``Costs.memory_change`` as the dry run does (so the same
    numbers to the bit). Ranks whose stages keep as much and run one order share a peak."""

    @functools.cache
    def peak(changes: tuple[float, ...], kinds: str) -> float:
        change = dict(zip("FIBW", changes, strict=True))
        return max(itertools.accumulate(map(change.__getitem__, kinds), initial=0.0))

    return tuple(peak(tuple(costs.memory_change(Kind(k), stage) for k in "FIBW"), kinds)
                 for stage, kinds in enumerate(kinds_of))


def _chunk_peaks(orders: list[tuple[str, list[int]]], costs: Costs) -> tuple[float, ...]:
    """``_stage_peaks`` for ranks of several stages (interleaved: F and B only)."""
    stages = {s for _, on in orders for s in on}
    change = {(k, s): costs.memory_change(Kind(k), s) for k in "FB" for s in stages}
    return tuple(max(itertools.accumulate(map(change.__getitem__, zip(kinds, on)), initial=0.0))
                 for kinds, on in orders)


def _stage_timeline(
    rank: int, kinds: str, arrival: list[float], layout: Layout,
    f: list[float], i: list[float], w: list[float], comm: float,
) -> Generator[int, None, float]:
    """Rank ``rank``'s actions, its one stage's ``kinds`` in order: yields the slot it waits
    for whenever that result is not there yet, returns its clock at the end.

    The forward and the backward branch each spell out their wait (the loop runs once per
    action of every step the search prices); nothing waits for a W, nor a W for anyone.
    """
    m = layout.num_micro_batches
    none = 2 * layout.num_stages * m
    forward_from = 2 * (rank - 1) * m if rank > 0 else none
    backward_from = (2 * rank + 3) * m if rank < layout.pp - 1 else none
    forward_to, backward_to = 2 * rank * m, (2 * rank + 1) * m
    forward, weight = f[rank], w[rank]
    backward = i[rank] if "W" in kinds else i[rank] + weight  # I, or a whole B
    now = 0.0
    for kind in kinds:
        if kind == "F":
            ready = arrival[forward_from]
            while ready < 0.0:
                yield forward_from
                ready = arrival[forward_from]
            now = (now if now > ready else ready) + forward
            arrival[forward_to] = now + comm
            forward_from += 1
            forward_to += 1
        elif kind == "W":
            now += weight
        else:
            ready = arrival[backward_from]
            while ready < 0.0:
                yield backward_from
                ready = arrival[backward_from]
            now = (now if now > ready else ready) + backward
            arrival[backward_to] = now + comm
            backward_from += 1
            backward_to += 1
    return now


def _chunk_timeline(
    kinds: str, stages: list[int], arrival: list[float], layout: Layout,
    f: list[float], i: list[float], w: list[float], comm: float,
) -> Generator[int, None, float]:
    """``_stage_timeline`` for a rank of several stages (interleaved): its actions' ``kinds``
    (F or B) and the stage of each."""
    m, last = layout.num_micro_batches, layout.num_stages - 1
    none = 2 * layout.num_stages * m
    # Stage s's F waits for stage s - 1's, its B for stage s + 1's, on the rank before or after.
    remote = layout.pp > 1
    forward_from = {s: 2 * (s - 1) * m if s > 0 and remote else none for s in set(stages)}
    backward_from = {s: (2 * s + 3) * m if s < last and remote else none for s in set(stages)}
    forwards, backwards = dict.fromkeys(forward_from, 0), dict.fromkeys(backward_from, 0)
    now = 0.0
    for kind, stage in zip(kinds, stages):
        if kind == "F":
            mb = forwards[stage]
            forwards[stage] = mb + 1
            slot, to, took = forward_from[stage] + mb, 2 * stage * m + mb, f[stage]
        else:
            mb = backwards[stage]
            backwards[stage] = mb + 1
            slot, to = backward_from[stage] + mb, (2 * stage + 1) * m + mb
            took = i[stage] + w[stage]
        ready = arrival[slot]
        while ready < 0.0:
            yield slot
            ready = arrival[slot]
        now = (now if now > ready else ready) + took
        arrival[to] = now + comm
    return now


def _run(layout: Layout, timelines: list[Generator[int, None, float]]) -> list[float]:
    """Each rank's clock at the end of the step: the ranks take turns, each running until it
    waits for a result not there yet, in alternating order (forwards flow down the ranks,
    gradients up). A rank that ran on never waits for the same result again, so a turn in
    which every rank stops where it stopped before is a deadlock."""
    clocks = [0.0] * layout.pp
    waiting: list[int | None] = [None] * layout.pp  # the slot where each rank stopped
    order = list(range(layout.pp))
    while order:
        stopped = waiting.copy()
        finished = []
        for rank in order:
            try:
                waiting[rank] = next(timelines[rank])
            except StopIteration as done:
                clocks[rank] = done.value
                finished.append(rank)
        if finished:
            order = [rank for rank in order if rank not in finished]
        elif waiting == stopped:
            raise DeadlockError(f"{layout.describe()} deadlocks: plan_step should have refused it")
        order.reverse()
    return clocks


def estimate_step(layout: Layout, costs: Costs | None = None) -> StepEstimate:
    """Makespan, bubble and per-rank peak memory of one step of ``layout``, fast.

    ``dry_run(layout, plan_step(layout), costs)``'s figures for a step of few micro-batches;
    a step with many more micro-batches than stages is simulated at three counts ``m0 < m0 +
    p < m0 + 2 p`` (``p = 2 pp``) that share its residue modulo ``p`` and extrapolated along
    the line through them when they lie on one (else simulated whole). A pipeline's steady
    state repeats every 1, 2 or ``pp`` micro-batches (unbalanced 1F1B stages alternate, for
    one), all divisors of ``p``, so past the warm-up the line is exact. The warm-up
    (``2 stages + pp`` micro-batches) is a heuristic: stages whose costs nearly tie can keep
    a transient going longer, collinear at the three points by chance, and the estimate is
    then off by a little (0.4% in the worst case the randomized tests found; they bound it
    at 1%). Planning ranks layouts on it; nothing that runs depends on it.
    """
    costs = costs if costs is not None else Costs()
    costs.check(layout.num_stages)
    m, period = layout.num_micro_batches, 2 * layout.pp
    start = extrapolation_start(layout)
    if start is None:
        return _exact(layout, costs)
    points = [
        _replay(dataclasses.replace(layout, num_micro_batches=start + k * period), costs)
        for k in range(3)
    ]
    (t0, b0, p0), (t1, b1, p1), (t2, _, p2) = points
    if not (_affine(t0, t1, t2) and all(map(_affine, p0, p1, p2))):
        return _exact(layout, costs)
    periods = (m - start) // period
    makespan = t0 + periods * (t1 - t0)
    busy = b0 + periods * (b1 - b0)
    return StepEstimate(
        makespan=makespan,
        bubble_fraction=1.0 - busy / (layout.pp * makespan) if makespan else 0.0,
        peak_memory=tuple(a + periods * (b - a) for a, b in zip(p0, p1, strict=True)),
        simulated=tuple(start + k * period for k in range(3)),
    )


def extrapolation_start(layout: Layout) -> int | None:
    """The first of the three micro-batch counts ``estimate_step`` simulates for ``layout``, or
    None where it simulates the whole step (three short steps would cost more)."""
    m, period = layout.num_micro_batches, 2 * layout.pp
    warmup = 2 * layout.num_stages + layout.pp
    start = warmup + (m - warmup) % period
    return None if 3 * (start + period) >= m else start


def _affine(a: float, b: float, c: float) -> bool:
    return abs((c - b) - (b - a)) <= 1e-9 * max(abs(a), abs(b), abs(c), 1e-30)


def _exact(layout: Layout, costs: Costs) -> StepEstimate:
    makespan, busy, peak = _replay(layout, costs)
    return StepEstimate(
        makespan=makespan,
        bubble_fraction=1.0 - busy / (layout.pp * makespan) if makespan else 0.0,
        peak_memory=peak,
        simulated=(layout.num_micro_batches,),
    )


def clear_caches() -> None:
    """Forget what estimates cached, for benchmarks that time a cold start: nothing now, as a
    step's action lists cost less to build than to simulate."""
