"""Fast estimate of a pipeline step: the dry run's makespan, bubble and peak memory, for planning.

The search prices thousands of candidate layouts, some with hundreds of micro-batches on dozens
of ranks. ``estimate_step`` gives ``dry_run``'s makespan, bubble and peak memory without a
timeline: the action lists of a (schedule, pp, v, m) are compiled once into integer
dependencies, and a long step is simulated at three shorter micro-batch counts and extended
along the straight line they lie on. A pipeline in steady state adds the same time and memory
per period of micro-batches, so after the warm-up the makespan is affine in the count; the
three points check it, and where they disagree the whole step is simulated. Where a long
transient passes the check by chance, the estimate is a little off (see estimate_step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import operator
from collections.abc import Iterator
from dataclasses import dataclass

from tidal_api.layout import Layout
from tidal_plan.actioncosts import Costs, per_stage
from tidal_plan.dryrun import DeadlockError
from tidal_plan.ir import Kind
from tidal_plan.schedules import compute_actions


@dataclass(frozen=True, kw_only=True, slots=True)
class StepEstimate:
    """``dry_run``'s figures without the timeline; ``simulated`` micro-batches were run."""

    makespan: float
    bubble_fraction: float
    peak_memory: tuple[float, ...]
    simulated: tuple[int, ...]


_F, _I, _W, _B = range(4)
_CODE = {Kind.F: _F, Kind.I: _I, Kind.W: _W, Kind.B: _B}
# What an action's result is to its consumers: a forward's output, an input gradient (B or I;
# a stage runs one of them per micro-batch) or a weight gradient, which nothing waits for.
_ROLE = {Kind.F: 0, Kind.B: 1, Kind.I: 1, Kind.W: 2}
_KIND = operator.itemgetter(1)


@dataclass(frozen=True, slots=True)
class _Program:
    """Per rank: (two slots it waits for, own slot, operation) of every compute action.

    A result has two slots: ``slot`` when it is ready on its own rank and ``slot + size`` when
    its message has reached the neighbouring rank. Folding communication into the slots gives
    ``dry_run``'s times to the bit: a SEND is posted the moment its compute ends and arrives
    ``comm`` later; a RECV right before its compute only moves the rank's clock to that
    arrival, which the compute's own wait does too. An action waits for at most two results;
    slot ``2 * size``, ready at time 0, stands in for a missing one. The operation ``code *
    stages + stage`` indexes what the action costs and what it does to its rank's memory, both
    laid out by ``_replay`` per cost model.
    """

    ranks: tuple[tuple[tuple[int, int, int, int], ...], ...]
    size: int


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Hold off the cyclic garbage collector while compiling a program.

    A long step's compute lists and program are hundreds of thousands of small objects made at
    once and kept (none forms a cycle); collections triggered by their allocation would rescan
    everything already cached, a sixth of a large scale table's build.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@functools.lru_cache(maxsize=512)
def _program(layout: Layout) -> _Program:
    with _collector_paused():
        return _compile(layout)


def _compile(layout: Layout) -> _Program:
    # plan_step without its checks: the runtime only runs lists plan_step passed, the schedule
    # generators are tested against validate_compute, and _replay finds a deadlock itself.
    compute = compute_actions(layout)
    m, stages = layout.num_micro_batches, layout.num_stages
    size = 3 * stages * m
    rank_of = [layout.stage_rank(stage) for stage in range(stages)]

    def slot(stage: int, role: int, remote: bool) -> int:
        return (3 * stage + role) * m + (size if remote else 0)

    # An action waits for actions of its own micro-batch, and which ones depends only on its
    # (stage, kind): build the entries of a (stage, kind) for every micro-batch at once, then
    # look each action's up.
    def build(stage: int, kind: Kind) -> list[tuple[int, int, int, int]]:
        deps = []
        if kind is Kind.F and stage > 0:
            deps.append(slot(stage - 1, 0, rank_of[stage - 1] != rank_of[stage]))
        elif kind is Kind.B or kind is Kind.I:
            deps.append(slot(stage, 0, False))
            if stage < stages - 1:
                deps.append(slot(stage + 1, 1, rank_of[stage + 1] != rank_of[stage]))
        elif kind is Kind.W:
            deps.append(slot(stage, 1, False))
        op, me = _CODE[kind] * stages + stage, slot(stage, _ROLE[kind], False)
        if len(deps) == 2:
            a, b = deps
            return [(a + mb, b + mb, me + mb, op) for mb in range(m)]
        if deps:
            (a,) = deps
            return [(a + mb, 2 * size, me + mb, op) for mb in range(m)]
        return [(2 * size, 2 * size, me + mb, op) for mb in range(m)]

    ranks = []
    for rank in range(layout.pp):
        actions = compute[rank]
        kinds = set(map(_KIND, actions))
        entries: list[dict[Kind, list[tuple[int, int, int, int]]]] = [{}] * stages
        for stage in layout.rank_stages(rank):
            entries[stage] = {kind: build(stage, kind) for kind in kinds}
        ranks.append(tuple([entries[stage][kind][mb] for stage, kind, mb in actions]))
    return _Program(ranks=tuple(ranks), size=size)


def _replay(layout: Layout, costs: Costs) -> tuple[float, float, tuple[float, ...]]:
    """Makespan, busy rank-seconds and per-rank peak memory of one step."""
    program = _program(_structural(layout))
    stages = layout.num_stages
    f = per_stage(costs.forward, stages)
    i = per_stage(costs.input_grad, stages)
    w = per_stage(costs.weight_grad, stages)
    act = per_stage(costs.activation_bytes, stages)
    freed = [-a for a in act]
    # By operation (code * stages + stage): seconds, and bytes added to the rank's memory. A
    # forward keeps its activations, B or W frees them (x + -a is x - a to the bit), I neither.
    took_of = f + i + w + [a + b for a, b in zip(i, w, strict=True)]
    kept_of = act + [0.0] * stages + freed + freed
    comm, size = costs.comm, program.size
    available = [-1.0] * (2 * size) + [0.0]
    pcs = [0] * layout.pp
    clock = [0.0] * layout.pp
    memory = [0.0] * layout.pp
    peak = [0.0] * layout.pp
    busy = 0.0
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(program.ranks):
            pc, now, n = pcs[rank], clock[rank], len(actions)
            held, most = memory[rank], peak[rank]
            while pc < n:
                a, b, me, op = actions[pc]
                at, bt = available[a], available[b]
                if at < 0.0 or bt < 0.0:
                    break
                ready = at if at > bt else bt
                took = took_of[op]
                now = (now if now > ready else ready) + took
                busy += took
                available[me] = now
                available[me + size] = now + comm
                held += kept_of[op]
                if held > most:  # only a forward can raise it
                    most = held
                pc += 1
                progress = True
            pcs[rank], clock[rank], memory[rank], peak[rank] = pc, now, held, most
    if any(pc < len(actions) for pc, actions in zip(pcs, program.ranks, strict=True)):
        raise DeadlockError(f"{layout.describe()} deadlocks: plan_step should have refused it")
    return max(clock), busy, tuple(peak)


def _structural(layout: Layout) -> Layout:
    """The layout with what the action lists do not depend on (partition, dp, mbs) fixed."""
    return dataclasses.replace(
        layout, partition=(1,) * layout.num_stages, dp=1, micro_batch_size=1
    )


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
    """Forget compiled action lists (for benchmarks that time a cold start)."""
    _program.cache_clear()
