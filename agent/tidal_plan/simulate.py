"""Dry-run simulator: run lowered per-rank action lists on a cost model, before any GPU does.

Every rank runs its list in order, one action at a time. Compute takes its cost; a SEND is
posted at once and its message arrives ``Costs.comm`` later; a RECV blocks until its message
is there; a compute action also waits for its inputs on its own rank (the forward of the stage
before it, the input gradient of the stage after it, or the RECV that brought them). Costs
only move times: whether a list deadlocks depends on the order alone. The result gives
makespan, bubble, peak activation memory per rank, each rank's timeline and, on deadlock, a
rank x step grid with the action each rank is stuck on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tidal_plan.ir import Action, Kind
from tidal_plan.layout import Layout
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


def simulate(
    layout: Layout, lowered: Mapping[int, Sequence[Action]], costs: Costs | None = None
) -> SimResult:
    """Run ``lowered`` (one list per pipeline rank) under ``costs`` (unit costs by default).

    Raises ``ValueError`` for lists no schedule could mean: an action on the wrong rank, an
    action twice, communication between stages of one rank, or a SEND nobody receives. A RECV
    nobody sends is a deadlock, shown in the grid.
    """
    costs = costs if costs is not None else Costs()
    costs.check(layout.num_stages)
    _check_lists(layout, lowered)
    replay = _Replay(layout, lowered, costs)
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
        """What ``action`` waits for: each entry is satisfied by any one of its actions."""
        stage, kind, mb = action.stage, action.kind, action.mb
        colocated = self.layout.stage_rank
        if kind is Kind.F:
            if stage == 0:
                return []
            if colocated(stage - 1) == colocated(stage):
                return [(Action(stage - 1, Kind.F, mb),)]
            return [(Action(stage, Kind.RECV_F, mb),)]
        if kind in (Kind.B, Kind.I):
            forward = (Action(stage, Kind.F, mb),)
            if stage == self.layout.num_stages - 1:
                return [forward]
            if colocated(stage + 1) == colocated(stage):
                return [forward, (Action(stage + 1, Kind.B, mb), Action(stage + 1, Kind.I, mb))]
            return [forward, (Action(stage, Kind.RECV_B, mb),)]
        if kind is Kind.W:
            return [(Action(stage, Kind.I, mb),)]
        if kind is Kind.SEND_F:
            return [(Action(stage, Kind.F, mb),)]
        if kind is Kind.SEND_B:
            return [(Action(stage, Kind.B, mb), Action(stage, Kind.I, mb))]
        if kind is Kind.RECV_F:
            return [(Action(stage - 1, Kind.SEND_F, mb),)]
        return [(Action(stage + 1, Kind.SEND_B, mb),)]  # RECV_B

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
                waits.append(" or ".join(f"{a} {self._where(a)}" for a in alternatives))
        return f"* rank {rank} is stuck on {action}, waiting for " + " and ".join(waits)

    def _where(self, action: Action) -> str:
        for rank, actions in self.lists.items():
            if action in actions:
                return f"(rank {rank} has not run it yet)"
        return "(on no rank's list)"


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
