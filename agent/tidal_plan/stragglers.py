"""Stragglers: which rank stays slower than its peers, and the partition that makes up for it.

Every rank times its decoder-layer forwards in every step. Decoder layers are the same
computation wherever they sit, so their seconds per layer compare across ranks whatever the
partition, unlike a stage's whole time (an embedding costs almost nothing, an LM head as much
as several layers). A rank's slowdown at a step is its seconds per layer over the median of the
other ranks'. A rank whose slowdown stays at least ``factor`` for ``steps`` consecutive
observed steps is a straggler; the flag clears once it stays below ``factor`` as long (Malleus
calls such a rank a straggler and re-plans around it).

Re-planning weighs each stage by its rank's relative speed (the median over the newest steps of
the fastest rank's seconds per layer over this rank's): the contiguous partition whose slowest stage,
seconds over speed, is fastest (``balanced_partition`` with speeds). With data parallelism the
replicas share the partition but not the micro-batches: a slower replica takes a smaller share
(``Layout.shares``, whole logical replicas in strict mode), filled one unit at a time into the
replica that would finish it soonest. A step's time is its slowest replica's pipeline, fill and
drain counted (``(m + pp - 1)`` stage times for ``m`` micro-batches); a re-plan is worth a switch
where it falls by at least ``min_gain``. Dropping the straggler is priced the same way: the other
ranks' partition against the kept one.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from tidal_api.layout import Layout
from tidal_plan.partition import balanced_partition

DEFAULT_FACTOR = 1.5  # slower than the median of the peers by at least this: slow
DEFAULT_STEPS = 5  # consecutive observed steps, to flag and to clear


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerChange:
    """A member flagged as a straggler at ``step`` (``flagged``), or cleared."""

    member: str
    step: int
    flagged: bool
    slowdown: float  # its seconds per layer over the median of the others', at that step


class StragglerDetector:
    """Per-step seconds per decoder layer of every member in, flags and relative speeds out.

    Members are named (a worker's id), not numbered, so that a flag outlives a switch that
    renumbers the ranks."""

    def __init__(self, *, factor: float = DEFAULT_FACTOR, steps: int = DEFAULT_STEPS) -> None:
        if factor <= 1:
            raise ValueError(f"the straggler factor must exceed 1, not {factor}")
        if steps < 1:
            raise ValueError(f"flagging needs at least one step, not {steps}")
        self.factor, self.steps = factor, steps
        self._runs: dict[str, int] = {}  # consecutive steps on the other side of the factor
        self._flagged: set[str] = set()
        self._speeds: dict[str, deque[float]] = {}
        self.slowdowns: dict[str, float] = {}  # at the newest step

    @property
    def flagged(self) -> frozenset[str]:
        return frozenset(self._flagged)

    def observe(self, step: int, per_layer_s: Mapping[str, float | None]
                ) -> list[StragglerChange]:
        """One step's seconds per layer per member (None: it ran no decoder layer); the flags
        that change with it. Members absent from a step keep their state."""
        known = {m: t for m, t in per_layer_s.items() if t is not None and t > 0}
        if len(known) < 2:
            return []
        fastest = min(known.values())
        changes = []
        for member, seconds in known.items():
            others = [t for m, t in known.items() if m != member]
            slowdown = seconds / statistics.median(others)
            self.slowdowns[member] = slowdown
            self._speeds.setdefault(member, deque(maxlen=self.steps)).append(fastest / seconds)
            slow = slowdown >= self.factor
            if slow == (member in self._flagged):
                self._runs[member] = 0
                continue
            self._runs[member] = self._runs.get(member, 0) + 1
            if self._runs[member] >= self.steps:
                self._runs[member] = 0
                (self._flagged.add if slow else self._flagged.discard)(member)
                changes.append(StragglerChange(member=member, step=step, flagged=slow,
                                               slowdown=slowdown))
        return changes

    def speed(self, member: str) -> float:
        """``member``'s speed relative to the fastest member: the median over its newest
        ``steps`` observed steps (1.0 before any)."""
        seen = self._speeds.get(member)
        return statistics.median(seen) if seen else 1.0


def pipeline_rank_speeds(layout: Layout, speeds: Sequence[float]) -> list[float]:
    """Each pipeline rank's speed from every world rank's (``speeds``): its slowest replica's,
    since the replicas share the partition."""
    pp = layout.pp
    return [min(speeds[r * pp + p] for r in range(layout.dp)) for p in range(pp)]


def stage_speeds(layout: Layout, rank_speeds: Sequence[float]) -> list[float]:
    """Each stage's speed: that of the pipeline rank that runs it."""
    return [rank_speeds[layout.stage_rank(s)] for s in range(layout.num_stages)]


def _stage_seconds(partition: Sequence[int], unit_seconds: Sequence[float],
                   speeds: Sequence[float]) -> list[float]:
    """Each stage's units' seconds over its speed."""
    out, start = [], 0
    for count, speed in zip(partition, speeds, strict=True):
        out.append(sum(unit_seconds[start:start + count]) / speed)
        start += count
    return out


def rank_seconds(layout: Layout, partition: Sequence[int], unit_seconds: Sequence[float],
                 rank_speeds: Sequence[float]) -> list[float]:
    """Seconds per micro-batch of each pipeline rank under ``partition``: its stages' unit
    seconds over its speed."""
    out = [0.0] * layout.pp
    stages = _stage_seconds(partition, unit_seconds, stage_speeds(layout, rank_speeds))
    for stage, seconds in enumerate(stages):
        out[layout.stage_rank(stage)] += seconds
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Replan:
    """A partition for the ranks' measured speeds, and what it is predicted to gain."""

    partition: tuple[int, ...]
    slowest_s: float  # the slowest rank's seconds per micro-batch, as planned
    was_s: float  # the same under the current partition

    @property
    def gain(self) -> float:
        return self.was_s / self.slowest_s - 1


def replan_partition(layout: Layout, unit_seconds: Sequence[float],
                     rank_speeds: Sequence[float], layers: range | None = None) -> Replan | None:
    """The partition of ``layout``'s stages balanced for ``rank_speeds`` (one per pipeline
    rank; data-parallel replicas share the partition, so give each pipeline rank its slowest
    replica's speed), each stage keeping one of the decoder ``layers`` (the units a rank's
    speed is measured by: a rank without one could not be seen to recover), or None if the
    units cannot be split so."""
    if len(unit_seconds) != layout.num_units:
        raise ValueError(f"{len(unit_seconds)} unit costs for a layout of {layout.num_units}")
    partition = balanced_partition(unit_seconds, layout.num_stages,
                                   speeds=stage_speeds(layout, rank_speeds), each_holds=layers)
    if partition is None:
        return None
    return Replan(
        partition=partition,
        slowest_s=max(rank_seconds(layout, partition, unit_seconds, rank_speeds)),
        was_s=max(rank_seconds(layout, layout.partition, unit_seconds, rank_speeds)),
    )


def pipeline_seconds(layout: Layout, slowest_s: float, pp: int | None = None) -> float:
    """A step's pipeline seconds at ``slowest_s`` per micro-batch on the slowest rank: the
    ``m`` micro-batches plus the fill and drain of ``pp - 1`` (1F1B-like schedules)."""
    pp = layout.pp if pp is None else pp
    return (layout.num_micro_batches + pp - 1) * slowest_s


def drop_beats_keeping(layout: Layout, unit_seconds: Sequence[float],
                       rank_speeds: Sequence[float], slow: int, min_gain: float) -> bool:
    """Whether a pipeline one rank shorter, without pipeline rank ``slow``, is predicted to
    step at least ``min_gain`` faster than the current ranks re-partitioned for their speeds
    (dp 1, no virtual stages: the rank's stages go to the others)."""
    if layout.pp < 2 or layout.virtual_stages != 1:
        return False
    kept = replan_partition(layout, unit_seconds, rank_speeds)
    others = [s for r, s in enumerate(rank_speeds) if r != slow]
    dropped = balanced_partition(unit_seconds, layout.pp - 1, speeds=others)
    if kept is None or dropped is None:
        return False
    keep_s = pipeline_seconds(layout, kept.slowest_s)
    drop_s = pipeline_seconds(layout, max(_stage_seconds(dropped, unit_seconds, others)),
                              layout.pp - 1)
    return keep_s / drop_s - 1 >= min_gain


def _replica_seconds(layout: Layout, unit_seconds: Sequence[float],
                     speeds: Sequence[float]) -> list[float]:
    """Each replica's seconds per micro-batch: its slowest rank's (``speeds`` in world-rank
    order)."""
    pp = layout.pp
    return [max(rank_seconds(layout, layout.partition, unit_seconds, speeds[r * pp:(r + 1) * pp]))
            for r in range(layout.dp)]


def step_seconds(layout: Layout, unit_seconds: Sequence[float],
                 speeds: Sequence[float]) -> float:
    """A step's predicted seconds with each world rank at its relative speed (``speeds``, in
    world-rank order): the slowest replica's pipeline over its share of the micro-batches."""
    per_mb = _replica_seconds(layout, unit_seconds, speeds)
    return max((layout.replica_micro_batches(r) + layout.pp - 1) * seconds
               for r, seconds in enumerate(per_mb))


def fill_shares(layout: Layout, unit_seconds: Sequence[float], speeds: Sequence[float],
                unit: int = 1) -> tuple[int, ...]:
    """Each replica's micro-batches for ranks of ``speeds`` (world-rank order), in blocks of
    ``unit`` (a logical replica's micro-batches in strict mode): every replica starts with
    one block, and each further block goes to the replica whose pipeline would end it first,
    which leaves the slowest replica's step as short as it can be."""
    total, pp = layout.global_micro_batches, layout.pp
    if total % unit:
        raise ValueError(f"{total} micro-batches do not split into blocks of {unit}")
    per_mb = _replica_seconds(layout, unit_seconds, speeds)
    shares = [unit] * layout.dp
    for _ in range(total // unit - layout.dp):
        r = min(range(layout.dp), key=lambda r: (shares[r] + unit + pp - 1) * per_mb[r])
        shares[r] += unit
    return tuple(shares)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutReplan:
    """A layout of the same ranks for their measured speeds, and its predicted gain."""

    layout: Layout
    step_s: float  # predicted
    was_s: float  # the current layout's, predicted the same way

    @property
    def gain(self) -> float:
        return self.was_s / self.step_s - 1


def replan_layout(layout: Layout, unit_seconds: Sequence[float], speeds: Sequence[float],
                  layers: range | None = None, share_unit: int = 0) -> LayoutReplan:
    """The fastest predicted of: ``layout`` re-partitioned for its pipeline ranks' speeds
    (each at its slowest replica's), and with dp > 1 (``share_unit`` > 0: the micro-batches
    a share is made of) the micro-batches re-shared over the replicas for the current
    partition or for that one (``speeds`` in world-rank order; the current layout itself
    where nothing is faster)."""
    if len(speeds) != layout.world_size:
        raise ValueError(f"{len(speeds)} speeds for a layout of {layout.world_size} ranks")
    rank_speeds = pipeline_rank_speeds(layout, speeds)
    candidates = [layout]
    partitioned = replan_partition(layout, unit_seconds, rank_speeds, layers)
    if partitioned is not None:
        candidates.append(replace(layout, partition=partitioned.partition))
    if layout.dp > 1 and share_unit:
        candidates += [replace(c, shares=fill_shares(c, unit_seconds, speeds, share_unit))
                       for c in list(candidates)]
    timed = [(step_seconds(c, unit_seconds, speeds), i, c) for i, c in enumerate(candidates)]
    best_s, _, best = min(timed)
    return LayoutReplan(layout=best, step_s=best_s, was_s=timed[0][0])
