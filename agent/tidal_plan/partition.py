"""Contiguous partitions of the placement units into stages, for the search to price.

Partitions may be uneven (FlexTrain's No-Op insertion): besides the even split by unit count,
one balances stage time (an embedding costs almost nothing, an LM or MTP head as much as
several blocks) and one balances time under the memory cap, with each stage charged for the
micro-batches its schedule keeps in flight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tidal_api.layout import ScheduleKind
from tidal_plan.costmodel import UnitCosts
from tidal_plan.layout import even_partition


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
) -> tuple[tuple[int, ...] | None, float]:
    """Greedy contiguous packing: each stage takes units while its seconds stay within
    ``limit`` and its memory within ``cap``.

    Returns ``stages`` stage sizes, or None when the limits cannot be met, and how far the
    answer holds: packed, the slowest stage's seconds (any limit from there up to ``limit``
    packs the same, as every unit that fits still fits and every stop still stops); not, the
    least seconds a stage stopped short of for time (every limit below it fails too).
    Packing each stage as full as possible is optimal for feasibility (a later boundary never
    hurts later stages), and leaves one unit for each stage still to come.
    """
    n = len(seconds)
    state, activation = (memory.state, memory.activation) if memory else ((0.0,) * n,) * 2
    sizes, unit = [], 0
    slowest, short = 0.0, math.inf
    for stage in range(stages):
        end = n - (stages - stage - 1)
        held = memory.in_flight[stage] if memory else 0.0
        time = mem = 0.0
        j = unit
        while j < end:
            t, m = seconds[j], state[j] + activation[j] * held
            if j > unit and (time + t > limit or mem + m > cap):
                if mem + m <= cap and time + t < short:
                    short = time + t
                break
            time, mem, j = time + t, mem + m, j + 1
        if time > limit or mem > cap:
            return None, min(short, time) if mem <= cap else short
        sizes.append(j - unit)
        if time > slowest:
            slowest = time
        unit = j
    return (tuple(sizes), slowest) if unit == n else (None, short)


def balanced_partition(
    seconds: Sequence[float],
    stages: int,
    memory: StageMemory | None = None,
    memory_cap: float = float("inf"),
    speeds: Sequence[float] | None = None,
    each_holds: range | None = None,
) -> tuple[int, ...] | None:
    """Contiguous stages minimising the slowest stage's seconds, each stage's memory capped.
    With ``speeds`` (one per stage, relative) a stage's seconds are its units' over its speed:
    a slower rank's stages take fewer units; ``each_holds`` then asks every stage to hold at
    least one of those units (the decoder layers, by which a rank's speed is measured).

    None if no partition fits. Bisects the limit of ``_pack``; a limit within the range a
    pack already answered for is not packed again (the search asks for hundreds of these).
    """
    n = len(seconds)
    if not 1 <= stages <= n:
        return None
    if speeds is not None:
        if memory is not None:
            raise ValueError("stage speeds and a memory cap together are not supported")
        return _weighted_partition(seconds, speeds, each_holds)
    hi = sum(seconds) + 1e-30
    best, slowest = _pack(seconds, memory, stages, hi, memory_cap)
    if best is None:
        return None
    lo, short = max(seconds), -math.inf
    for _ in range(40):
        mid = (lo + hi) / 2
        if mid >= slowest:
            found = best
        elif mid < short:
            found = None
        else:
            found, reach = _pack(seconds, memory, stages, mid, memory_cap)
            if found is None:
                short = reach
            else:
                slowest = reach
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
        if hi - lo <= 1e-6 * hi:
            break
    return best


def _weighted_partition(seconds: Sequence[float], speeds: Sequence[float],
                        each_holds: range | None = None) -> tuple[int, ...] | None:
    """The contiguous partition whose slowest stage (its units' seconds over its speed) is
    fastest, by dynamic programming over (stages, units): with unequal speeds, packing each
    stage full is no longer optimal (a large unit pushed onto a slow stage). None if no
    partition gives every stage a unit of ``each_holds``."""
    n, stages = len(seconds), len(speeds)
    if min(speeds) <= 0:
        raise ValueError(f"stage speeds must be positive, not {list(speeds)}")
    prefix = [0.0]
    for t in seconds:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    # best[s][j]: the slowest stage of the first s stages over the first j units; cut: where
    # stage s starts for it.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        speed = speeds[s - 1]
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                if each_holds is not None and (i >= each_holds.stop or j <= each_holds.start):
                    continue  # units [i, j) hold none of them
                value = max(best[s - 1][i], (prefix[j] - prefix[i]) / speed)
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    if best[stages][n] == inf:
        return None
    sizes, j = [], n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        sizes.append(j - i)
        j = i
    return tuple(reversed(sizes))


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
