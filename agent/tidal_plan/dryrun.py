"""Dry run of a pipeline step: run lowered per-rank action lists on per-action costs, exactly.

Every rank runs its list in order, one action at a time. Compute takes its cost; a SEND is
posted at once and its message arrives ``Costs.comm`` later; a RECV blocks until its message
is there; a compute action also waits for its inputs on its own rank (the forward of the stage
before it, the input gradient of the stage after it, or the RECV that brought them). Costs
only move times: whether a list deadlocks depends on the order alone. The result (``DryRun``)
gives makespan, bubble, peak activation memory per rank, each rank's timeline and, on deadlock,
a rank x step grid with the action each rank is stuck on. ``tidal_plan.estimate`` gives the same
figures without the timeline, fast enough for the search; ``tidal_plan.bounds`` bounds them.

With a ``Machine`` the ranks share its cores (processor sharing): while ``n`` ranks compute
at once, each runs at ``min(1, cores / n)`` of its speed, so a compute action's cost is its work
and its span stretches while more ranks than cores are busy. The machine's transport also
tells apart the two orders of a message's ends: a RECV posted before its SEND gets the data
``Costs.comm`` after the SEND, one posted after it (a rendezvous: the sender's side must answer
first) ``Machine.rendezvous`` after the RECV.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tidal_api.layout import Layout
from tidal_plan.actioncosts import Costs
from tidal_plan.ir import Action, Kind
from tidal_plan.lowering import lower, validate_lowered
from tidal_plan.schedules import compute_actions, validate_compute


class DeadlockError(RuntimeError):
    """A schedule that cannot finish; the message is the grid showing where each rank stands."""


class Span(NamedTuple):
    """One action on a rank's timeline; a RECV's span is the time it waited."""

    start: float
    end: float
    action: Action


@dataclass(frozen=True, kw_only=True, slots=True)
class DryRun:
    """What a dry run found. On deadlock ``makespan`` is infinite and the bubble 1."""

    makespan: float
    bubble_fraction: float
    peak_memory: tuple[float, ...]
    timeline: tuple[tuple[Span, ...], ...]
    deadlock: bool
    grid: str

    def raise_on_deadlock(self) -> DryRun:
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


def dry_run(
    layout: Layout,
    lowered: Mapping[int, Sequence[Action]],
    costs: Costs | None = None,
    machine: Machine | None = None,
) -> DryRun:
    """Run ``lowered`` (one list per pipeline rank) under ``costs`` (unit costs by default).

    With a ``machine`` the ranks share its cores (see the module docstring); without, every
    rank has a core of its own. Raises ``ValueError`` for lists no schedule could mean: an
    action on the wrong rank, an action twice, communication between stages of one rank, or a
    SEND nobody receives. A RECV nobody sends is a deadlock, shown in the grid.
    """
    costs = costs if costs is not None else Costs()
    costs.check(layout.num_stages)
    validate_lowered(layout, lowered)
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
    dry_run(layout, lowered).raise_on_deadlock()
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

    def result(self) -> DryRun:
        deadlock = any(self.pc[r] < len(actions) for r, actions in self.lists.items())
        makespan = math.inf if deadlock else max(self.clock, default=0.0)
        busy_fraction = self.busy / (self.layout.pp * makespan) if makespan else 1.0
        return DryRun(
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
            self.memory[rank] += self.costs.memory_change(kind, stage)
            self.peak[rank] = max(self.peak[rank], self.memory[rank])
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
        self.memory[rank] += self.costs.memory_change(action.kind, action.stage)
        self.peak[rank] = max(self.peak[rank], self.memory[rank])
        self.pc[rank] += 1
