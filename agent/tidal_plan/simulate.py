"""Dry-run simulator: run lowered per-rank action lists on a cost model, before any GPU does.

Every rank runs its list in order, one action at a time. Compute takes its cost; a SEND is
posted at once and its message arrives ``Costs.comm`` later; a RECV blocks until its message
is there; a compute action also waits for its inputs on its own rank (the forward of the stage
before it, the input gradient of the stage after it, or the RECV that brought them). Costs
only move times: whether a list deadlocks depends on the order alone. The result gives
makespan, bubble, peak activation memory per rank, each rank's timeline and, on deadlock, a
rank x step grid with the action each rank is stuck on.

With a ``Machine`` the ranks share its cores (processor sharing): while ``n`` ranks compute
at once, each runs at ``min(1, cores / n)`` of its speed, so a compute action's cost is its work
and its span stretches while more ranks than cores are busy. The machine's transport also
tells apart the two orders of a message's ends: a RECV posted before its SEND gets the data
``Costs.comm`` after the SEND, one posted after it (a rendezvous: the sender's side must answer
first) ``Machine.rendezvous`` after the RECV.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tidal_plan.ir import Action, Kind
from tidal_plan.layout import Layout, ScheduleKind
from tidal_plan.lowering import Message, lower, message
from tidal_plan.schedules import compute_actions, validate_compute

PerStage = float | tuple[float, ...]


class DeadlockError(RuntimeError):
    """A schedule that cannot finish; the message is the grid showing where each rank stands."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Costs:
    """Per-action costs: a number for every stage, or a tuple with one entry per stage.

    A full backward B costs ``input_grad + weight_grad``. ``comm`` is the latency of one
    message; ``activation_bytes`` what one micro-batch's forward keeps alive on a stage until
    its B (or W) frees it.
    """

    forward: PerStage = 1.0
    input_grad: PerStage = 1.0
    weight_grad: PerStage = 1.0
    comm: float = 0.0
    activation_bytes: PerStage = 1.0

    def __post_init__(self) -> None:
        for name in ("forward", "input_grad", "weight_grad", "activation_bytes"):
            value = getattr(self, name)
            values = tuple(value) if isinstance(value, Sequence) else (value,)
            if not values or any(v < 0 for v in values):
                raise ValueError(f"Costs.{name} must be non-negative, one number or per stage")
            if isinstance(value, Sequence):
                object.__setattr__(self, name, tuple(float(v) for v in values))
        if self.comm < 0:
            raise ValueError(f"Costs.comm ({self.comm}) must be non-negative")

    def check(self, num_stages: int) -> None:
        """Raise ``ValueError`` unless every per-stage tuple has ``num_stages`` entries."""
        for name in ("forward", "input_grad", "weight_grad", "activation_bytes"):
            value = getattr(self, name)
            if isinstance(value, tuple) and len(value) != num_stages:
                raise ValueError(
                    f"Costs.{name} has {len(value)} entries but the layout has {num_stages} "
                    f"stages: give one per stage or a single number"
                )

    def time(self, action: Action) -> float:
        """Compute time of ``action``; communication actions take none of a rank's time."""
        stage = action.stage
        if action.kind is Kind.F:
            return _at(self.forward, stage)
        if action.kind is Kind.I:
            return _at(self.input_grad, stage)
        if action.kind is Kind.W:
            return _at(self.weight_grad, stage)
        if action.kind is Kind.B:
            return _at(self.input_grad, stage) + _at(self.weight_grad, stage)
        return 0.0

    def activation(self, stage: int) -> float:
        return _at(self.activation_bytes, stage)


def _at(value: PerStage, stage: int) -> float:
    return value[stage] if isinstance(value, tuple) else float(value)


class Span(NamedTuple):
    """One action on a rank's timeline; a RECV's span is the time it waited."""

    start: float
    end: float
    action: Action


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    """What a dry run found. On deadlock ``makespan`` is infinite and the bubble 1."""

    makespan: float
    bubble_fraction: float
    peak_memory: tuple[float, ...]
    timeline: tuple[tuple[Span, ...], ...]
    deadlock: bool
    grid: str

    def raise_on_deadlock(self) -> SimResult:
        if self.deadlock:
            raise DeadlockError(self.grid)
        return self


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """The host a dry run's ranks share: its cores and what its transport costs a message.

    ``replicas`` identical pipelines (data parallelism) share the ``cores``. ``rendezvous`` is
    the delay of a message whose RECV is posted after its SEND: with gloo the data only leaves
    once the receiver's notice reaches the sender's side, whose thread must be woken for it.
    ``message_work`` is the CPU time each end of a message costs its process beside its rank's
    own compute (the transport's threads): nothing while cores are idle, a share of them
    while every core computes.
    """

    cores: float = math.inf
    replicas: int = 1
    rendezvous: float = 0.0
    message_work: float = 0.0

    def __post_init__(self) -> None:
        if not (self.cores > 0 and self.replicas >= 1 and self.rendezvous >= 0
                and self.message_work >= 0):
            raise ValueError(
                f"{self}: cores must be positive, replicas at least 1, rendezvous and "
                "message_work non-negative"
            )


def simulate(
    layout: Layout,
    lowered: Mapping[int, Sequence[Action]],
    costs: Costs | None = None,
    machine: Machine | None = None,
) -> SimResult:
    """Run ``lowered`` (one list per pipeline rank) under ``costs`` (unit costs by default).

    With a ``machine`` the ranks share its cores (see the module docstring); without, every
    rank has a core of its own. Raises ``ValueError`` for lists no schedule could mean: an
    action on the wrong rank, an action twice, communication between stages of one rank, or a
    SEND nobody receives. A RECV nobody sends is a deadlock, shown in the grid.
    """
    costs = costs if costs is not None else Costs()
    costs.check(layout.num_stages)
    _check_lists(layout, lowered)
    if machine is None:
        replay = _Replay(layout, lowered, costs)
    else:
        replay = _SharedReplay(layout, lowered, costs, machine)
    replay.run()
    return replay.result()


def plan_step(layout: Layout) -> dict[int, list[Action]]:
    """The lowered action lists of one step of ``layout``, checked and dry-run first.

    Raises ``ValueError`` for an incomplete or non-deterministic schedule and ``DeadlockError``
    for one that cannot finish, so the runtime only ever sees lists that run.
    """
    compute = compute_actions(layout)
    validate_compute(layout, compute)
    lowered = lower(layout, compute)
    simulate(layout, lowered).raise_on_deadlock()
    return lowered


def _needs(layout: Layout, action: Action) -> list[tuple[Action, ...]]:
    """What ``action`` waits for: each entry is satisfied by any one of its actions.

    Built from plain tuples, which equal and hash like the ``Action`` of the same fields: the
    planner asks this for every action of thousands of candidate steps.
    """
    stage, kind, mb = action
    colocated = layout.stage_rank
    if kind is Kind.F:
        if stage == 0:
            return []
        if colocated(stage - 1) == colocated(stage):
            return [((stage - 1, Kind.F, mb),)]
        return [((stage, Kind.RECV_F, mb),)]
    if kind is Kind.B or kind is Kind.I:
        forward = ((stage, Kind.F, mb),)
        if stage == layout.num_stages - 1:
            return [forward]
        if colocated(stage + 1) == colocated(stage):
            return [forward, ((stage + 1, Kind.B, mb), (stage + 1, Kind.I, mb))]
        return [forward, ((stage, Kind.RECV_B, mb),)]
    if kind is Kind.W:
        return [((stage, Kind.I, mb),)]
    if kind is Kind.SEND_F:
        return [((stage, Kind.F, mb),)]
    if kind is Kind.SEND_B:
        return [((stage, Kind.B, mb), (stage, Kind.I, mb))]
    if kind is Kind.RECV_F:
        return [((stage - 1, Kind.SEND_F, mb),)]
    return [((stage + 1, Kind.SEND_B, mb),)]  # RECV_B


class _Replay:
    """The state of one dry run: where each rank is and when each result became available."""

    def __init__(self, layout: Layout, lowered: Mapping[int, Sequence[Action]], costs: Costs):
        self.layout = layout
        self.lists = {rank: list(lowered[rank]) for rank in range(layout.pp)}
        self.costs = costs
        self.pc = [0] * layout.pp
        self.clock = [0.0] * layout.pp
        self.memory = [0.0] * layout.pp
        self.peak = [0.0] * layout.pp
        self.spans: list[list[Span]] = [[] for _ in range(layout.pp)]
        self.busy = 0.0
        # When each action's result can be used: a compute's end, a RECV's end, and for a SEND
        # the arrival of its message at the receiver.
        self.available: dict[Action, float] = {}

    def run(self) -> None:
        # Costs only shift times, never the order within a rank, so running each rank as far as
        # it can go, pass after pass, yields the same times as a clock-driven event loop.
        progress = True
        while progress:
            progress = False
            for rank, actions in self.lists.items():
                while self.pc[rank] < len(actions):
                    ready = self._ready_time(actions[self.pc[rank]])
                    if ready is None:
                        break
                    self._execute(rank, actions[self.pc[rank]], ready)
                    self.pc[rank] += 1
                    progress = True

    def result(self) -> SimResult:
        deadlock = any(self.pc[r] < len(actions) for r, actions in self.lists.items())
        makespan = math.inf if deadlock else max(self.clock, default=0.0)
        busy_fraction = self.busy / (self.layout.pp * makespan) if makespan else 1.0
        return SimResult(
            makespan=makespan,
            bubble_fraction=1.0 - busy_fraction,
            peak_memory=tuple(self.peak),
            timeline=tuple(tuple(spans) for spans in self.spans),
            deadlock=deadlock,
            grid=self._grid(deadlock),
        )

    def _needs(self, action: Action) -> list[tuple[Action, ...]]:
        return _needs(self.layout, action)

    def _ready_time(self, action: Action) -> float | None:
        ready = 0.0
        for alternatives in self._needs(action):
            times = [self.available[a] for a in alternatives if a in self.available]
            if not times:
                return None
            ready = max(ready, min(times))
        return ready

    def _execute(self, rank: int, action: Action, ready: float) -> None:
        kind, stage = action.kind, action.stage
        start = max(self.clock[rank], ready)
        if kind in (Kind.RECV_F, Kind.RECV_B):
            # The span starts when the rank began waiting, so the timeline shows the stall.
            self.spans[rank].append(Span(self.clock[rank], start, action))
            self.available[action] = start
        elif kind in (Kind.SEND_F, Kind.SEND_B):
            self.spans[rank].append(Span(start, start, action))
            self.available[action] = start + self.costs.comm
        else:
            end = start + self.costs.time(action)
            self.spans[rank].append(Span(start, end, action))
            self.available[action] = end
            self.busy += end - start
            start = end
            if kind is Kind.F:
                self.memory[rank] += self.costs.activation(stage)
                self.peak[rank] = max(self.peak[rank], self.memory[rank])
            elif kind in (Kind.B, Kind.W):
                self.memory[rank] -= self.costs.activation(stage)
        self.clock[rank] = start

    def _grid(self, deadlock: bool) -> str:
        rows = []
        for rank, actions in self.lists.items():
            cells = [str(a) for a in actions]
            if self.pc[rank] < len(actions):
                cells[self.pc[rank]] = f"[{cells[self.pc[rank]]}]"
            rows.append([f"rank {rank}", *cells])
        steps = max((len(row) - 1 for row in rows), default=0)
        table = [["step", *map(str, range(steps))]]
        table += [row + [""] * (steps + 1 - len(row)) for row in rows]
        widths = [max(len(row[col]) for row in table) for col in range(steps + 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
        if not deadlock:
            return "\n".join(lines)
        reasons = [
            self._blocked_reason(rank, actions[self.pc[rank]])
            for rank, actions in self.lists.items()
            if self.pc[rank] < len(actions)
        ]
        title = "deadlock: each rank ran the actions left of its [stuck] one"
        return "\n".join([title, *lines, *reasons])

    def _blocked_reason(self, rank: int, action: Action) -> str:
        waits = []
        for alternatives in self._needs(action):
            if not any(a in self.available for a in alternatives):
                waits.append(
                    " or ".join(f"{Action(*a)} {self._where(a)}" for a in alternatives)
                )
        return f"* rank {rank} is stuck on {action}, waiting for " + " and ".join(waits)

    def _where(self, action: Action) -> str:
        for rank, actions in self.lists.items():
            if action in actions:
                return f"(rank {rank} has not run it yet)"
        return "(on no rank's list)"


class _SharedReplay(_Replay):
    """A dry run in time order, where the ranks share the cores of a ``Machine``.

    Unlike ``_Replay``, a rank cannot run ahead: how fast it computes depends on what the
    others do at the same moment. Between two events (a compute or a message's handling
    ends, a message arrives) the set of busy ranks and messages being handled is fixed, and
    each does ``min(1, cores / busy)`` seconds of work per second.
    """

    def __init__(self, layout: Layout, lowered: Mapping[int, Sequence[Action]], costs: Costs,
                 machine: Machine):
        super().__init__(layout, lowered, costs)
        self.cores = machine.cores / machine.replicas  # per pipeline
        self.rendezvous = machine.rendezvous
        self.message_work = machine.message_work
        self.jobs: list[float] = []  # work left of the messages being handled
        self.left: list[float | None] = [None] * layout.pp  # work left of the running compute
        self.started = [0.0] * layout.pp

    def run(self) -> None:
        now = 0.0
        while True:
            waking = self._advance_all(now)
            running = [rank for rank in self.lists if self.left[rank] is not None]
            if not running and not self.jobs:
                if math.isinf(waking):
                    return  # finished, or deadlocked
                now = waking
                continue
            rate = min(1.0, self.cores / (len(running) + len(self.jobs)))
            least = min([self.left[rank] for rank in running] + self.jobs)
            if waking < now + least / rate:  # a message comes before any work ends
                done, now = (waking - now) * rate, waking
                for rank in running:
                    self.left[rank] -= done
                self.jobs = [left - done for left in self.jobs]
                continue
            now += least / rate
            self.jobs = [left - least for left in self.jobs if left > least]
            for rank in running:
                if self.left[rank] > least:
                    self.left[rank] -= least
                else:
                    self._finish(rank, now)

    def _advance_all(self, now: float) -> float:
        """Run what every idle rank can at ``now``; the earliest time a blocked one can go on."""
        while True:
            before = list(self.pc), [left is None for left in self.left]
            waking = min((self._advance(rank, now) for rank in self.lists
                          if self.left[rank] is None), default=math.inf)
            if (self.pc, [left is None for left in self.left]) == before:
                return waking

    def _advance(self, rank: int, now: float) -> float:
        """Run ``rank``'s actions that can go at ``now``; when it can go on (inf: unknown)."""
        actions = self.lists[rank]
        while self.pc[rank] < len(actions):
            action = actions[self.pc[rank]]
            ready = self._ready_time(action)
            if ready is not None and action.kind in (Kind.RECV_F, Kind.RECV_B):
                ready = self._delivery(rank, action, ready)
            if ready is None:
                return math.inf
            if ready > now:
                return ready
            if action.kind.is_compute:
                self.clock[rank] = max(self.clock[rank], now)
                self.started[rank] = now
                self.left[rank] = self.costs.time(action)
                if self.left[rank] > 0.0:
                    return math.inf
                self._finish(rank, now)
            else:
                self._execute(rank, action, ready)
                self.pc[rank] += 1
                if self.message_work > 0.0:  # each end of a message costs its process work
                    self.jobs.append(self.message_work)
        return math.inf

    def _delivery(self, rank: int, recv: Action, arrival: float) -> float:
        """When the data of ``recv``, which ``rank`` reached at its clock, is there."""
        posted = arrival - self.costs.comm  # the SEND's posting
        if self.clock[rank] <= posted:
            return arrival
        return max(arrival, self.clock[rank] + self.rendezvous)

    def _finish(self, rank: int, now: float) -> None:
        action = self.lists[rank][self.pc[rank]]
        self.left[rank] = None
        self.spans[rank].append(Span(self.started[rank], now, action))
        self.available[action] = now
        self.busy += now - self.started[rank]
        self.clock[rank] = now
        if action.kind is Kind.F:
            self.memory[rank] += self.costs.activation(action.stage)
            self.peak[rank] = max(self.peak[rank], self.memory[rank])
        elif action.kind in (Kind.B, Kind.W):
            self.memory[rank] -= self.costs.activation(action.stage)
        self.pc[rank] += 1


def _check_lists(layout: Layout, lowered: Mapping[int, Sequence[Action]]) -> None:
    if set(lowered) != set(range(layout.pp)):
        raise ValueError(
            f"lists are given for ranks {sorted(lowered)}; layout {layout.describe()} "
            f"needs exactly ranks 0..{layout.pp - 1}"
        )
    seen: set[Action] = set()
    received: set[Message] = set()
    sends: list[Action] = []
    for rank, actions in lowered.items():
        for action in actions:
            _check_action(layout, rank, action)
            if action in seen:
                raise ValueError(f"{action} appears twice: a stage runs each action once")
            seen.add(action)
            if action.kind in (Kind.RECV_F, Kind.RECV_B):
                received.add(message(action))
            elif action.kind in (Kind.SEND_F, Kind.SEND_B):
                sends.append(action)
    for send in sends:
        if message(send) not in received:
            peer = send.stage + (1 if send.kind is Kind.SEND_F else -1)
            recv = Action(peer, Kind.RECV_F if send.kind is Kind.SEND_F else Kind.RECV_B, send.mb)
            raise ValueError(
                f"{send} is never received: add {recv} on rank {layout.stage_rank(peer)} "
                f"or drop the send"
            )


def _check_action(layout: Layout, rank: int, action: Action) -> None:
    stage, kind = action.stage, action.kind
    last = layout.num_stages - 1
    if not 0 <= stage <= last:
        raise ValueError(f"{action} names a stage outside 0..{last}")
    if not 0 <= action.mb < layout.num_micro_batches:
        raise ValueError(f"{action} names a micro-batch outside 0..{layout.num_micro_batches - 1}")
    if layout.stage_rank(stage) != rank:
        raise ValueError(
            f"{action} is on rank {rank}, but stage {stage} runs on rank "
            f"{layout.stage_rank(stage)}: move it there"
        )
    if kind.is_compute:
        return
    peer = stage + (1 if kind in (Kind.SEND_F, Kind.RECV_B) else -1)
    if not 0 <= peer <= last:
        raise ValueError(f"{action} talks to stage {peer}, which does not exist: drop it")
    if layout.stage_rank(peer) == rank:
        raise ValueError(
            f"{action} talks to stage {peer} on its own rank {rank}: drop it, the runtime "
            f"hands tensors between stages of one rank over locally"
        )


# --- the fast path for planning -------------------------------------------------------------------
#
# The search prices thousands of candidate layouts, some with hundreds of micro-batches on dozens
# of ranks. ``estimate_step`` gives ``simulate``'s makespan, bubble and peak memory without a
# timeline: the action lists of a (schedule, pp, v, m) are compiled once into integer
# dependencies, and a long step is simulated at three shorter micro-batch counts and extended
# along the straight line they lie on. A pipeline in steady state adds the same time and memory
# per period of micro-batches, so after the warm-up the makespan is affine in the count; the
# three points check it, and where they disagree the whole step is simulated. Where a long
# transient passes the check by chance, the estimate is a little off (see estimate_step).


@dataclass(frozen=True, kw_only=True, slots=True)
class StepEstimate:
    """``simulate``'s figures without the timeline; ``simulated`` micro-batches were run."""

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
    ``simulate``'s times to the bit: a SEND is posted the moment its compute ends and arrives
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


def _per_stage(value: PerStage, stages: int) -> list[float]:
    return list(value) if isinstance(value, tuple) else [float(value)] * stages


def _replay(layout: Layout, costs: Costs) -> tuple[float, float, tuple[float, ...]]:
    """Makespan, busy rank-seconds and per-rank peak memory of one step."""
    program = _program(_structural(layout))
    stages = layout.num_stages
    f = _per_stage(costs.forward, stages)
    i = _per_stage(costs.input_grad, stages)
    w = _per_stage(costs.weight_grad, stages)
    act = _per_stage(costs.activation_bytes, stages)
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

    ``simulate(layout, plan_step(layout), costs)``'s figures for a step of few micro-batches;
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
    start = _extrapolation_start(layout)
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


def _extrapolation_start(layout: Layout) -> int | None:
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


def makespan_lower_bound(layout: Layout, costs: Costs) -> float:
    """A bound no step of ``layout`` under ``costs`` beats, in microseconds of Python.

    Pipeline rank ``r`` cannot start before micro-batch 0 has crossed the ``r`` stages before
    it, then computes ``m`` micro-batches on each of its stages; its last backward (stage
    ``r``, last micro-batch; with a split backward, its last I) still has to cross those stages
    back. It holds for any order of the actions; ``estimate_lower_bound`` tightens it with the
    order each schedule fixes, and the search prices candidates in the order of that bound.
    """
    stages = layout.num_stages
    f = _per_stage(costs.forward, stages)
    i = _per_stage(costs.input_grad, stages)
    w = _per_stage(costs.weight_grad, stages)
    split = layout.schedule is ScheduleKind.ZERO_BUBBLE
    m, comm = layout.num_micro_batches, costs.comm
    bound = head = tail = input_tail = 0.0
    for rank in range(layout.pp):
        stages = layout.rank_stages(rank)
        busy = m * sum(f[s] + i[s] + w[s] for s in stages)
        if split:  # W may trail the last I, but every F and I comes before it
            critical = m * sum(f[s] + i[s] for s in stages) + input_tail
            bound = max(bound, head + busy, head + critical)
        else:
            bound = max(bound, head + busy + tail)
        head += f[rank] + comm
        tail += i[rank] + w[rank] + comm
        input_tail += i[rank] + comm
    return bound


def estimate_lower_bound(layout: Layout, costs: Costs) -> tuple[float, tuple[float, ...]]:
    """Bounds on ``estimate_step``'s makespan and on each rank's peak activation bytes.

    Where the step is simulated whole, the schedule's order tightens ``makespan_lower_bound``:
    it fixes how many forwards ``k`` a rank runs before its first backward (GPipe all ``m``,
    1F1B ``pp - r``: its warm-up and one more; ZB-H1 at most ``pp - r`` by its in-flight
    limit, and exactly that many). That backward, of micro-batch 0, waits for micro-batch 0
    to reach the last stage and its gradient to come back; then the rank still owes its other
    ``m - k`` forwards and every backward, and the last backward's gradient still has to cross
    the ranks before it (with ZB-H1, the last I's does, after at least ``m - pp`` of the
    rank's W: ZB-H1 holds at most ``pp`` micro-batches without their W, so its last forward
    waits for them). GPipe is a flow shop twice over: the slowest stage's forwards, then its
    backwards, each stretched by one pass of a micro-batch through the other stages. Until
    its first backward frees anything, a rank holds its first ``k`` forwards' activations.

    An extrapolated estimate can sit a little off the simulation, so a long step gets only the
    generic bounds: ``makespan_lower_bound`` and one micro-batch's activations.
    """
    pp, m, stages, comm = layout.pp, layout.num_micro_batches, layout.num_stages, costs.comm
    act = _per_stage(costs.activation_bytes, stages)
    bound = makespan_lower_bound(layout, costs)
    one = tuple(max(act[s] for s in layout.rank_stages(rank)) for rank in range(pp))
    if _extrapolation_start(layout) is not None:
        return bound, one
    kind, last = layout.schedule, pp - 1
    f = _per_stage(costs.forward, stages)
    i = _per_stage(costs.input_grad, stages)
    w = _per_stage(costs.weight_grad, stages)
    b = [x + y for x, y in zip(i, w, strict=True)]
    if kind is ScheduleKind.INTERLEAVED:
        return _interleaved_bound(layout, bound, one, f, b, act, comm if pp > 1 else 0.0)
    if kind is ScheduleKind.GPIPE:
        flow = sum(f) + sum(b) + 2 * last * comm + (m - 1) * (max(f) + max(b))
        return max(bound, flow), tuple(max(g, m * a) for g, a in zip(one, act, strict=True))
    split = kind is ScheduleKind.ZERO_BUBBLE
    forward = sum(f) + last * comm  # micro-batch 0 reaches the last stage
    back = 0.0  # and its gradient comes back to rank r
    for rank in range(last, -1, -1):
        owed = (m - min(m, pp - rank)) * f[rank]
        start = forward + back
        if split:  # every W; or every I, the W before the last forward, then rank 0's last W
            inputs = sum(i[s] + comm for s in range(rank))
            bound = max(bound, start + owed + m * (i[rank] + w[rank]),
                        start + owed + m * i[rank] + max(0, m - pp) * w[rank] + inputs + w[0])
        else:
            bound = max(bound, start + owed + m * b[rank] + sum(b[s] + comm for s in range(rank)))
        back += (i if split else b)[rank] + comm
    held = tuple(max(g, min(m, pp - r) * act[r]) for r, g in enumerate(one))
    return bound, held


def _interleaved_bound(
    layout: Layout,
    bound: float,
    one: tuple[float, ...],
    f: list[float],
    b: list[float],
    act: list[float],
    comm: float,
) -> tuple[float, tuple[float, ...]]:
    """``estimate_lower_bound`` of an interleaved step simulated whole.

    Rank ``r`` runs its warm-up forwards and one more (the ``k``-th on chunk ``(k // pp) % v``)
    before its first backward: micro-batch 0 on its last chunk, once micro-batch 0 has gone
    through every stage and its gradient has come back. Its last backward is micro-batch
    ``m - 1`` on chunk 0, whose gradient still crosses the ranks before it.
    """
    pp, v, m = layout.pp, layout.virtual_stages, layout.num_micro_batches
    stages = pp * v
    forward = sum(f) + (stages - 1) * comm
    held = []
    for rank, generic in enumerate(one):
        chunks = [c * pp + rank for c in range(v)]
        first = min(m * v, (v - 1) * pp + 2 * (pp - rank - 1) + 1)  # forwards before it
        cycles, rest = divmod(first, pp * v)
        done = [cycles * pp + min(pp, max(0, rest - c * pp)) for c in range(v)]
        start = forward + sum(b[s] + comm for s in range(chunks[-1] + 1, stages))
        owed = sum((m - n) * f[s] for n, s in zip(done, chunks, strict=True))
        backwards = m * sum(b[s] for s in chunks)
        bound = max(bound, start + owed + backwards + sum(b[s] + comm for s in range(rank)))
        held.append(max(generic, sum(n * act[s] for n, s in zip(done, chunks, strict=True))))
    return bound, tuple(held)


def clear_caches() -> None:
    """Forget compiled action lists (for benchmarks that time a cold start)."""
    _program.cache_clear()
