"""Membership over time: which workers form each generation of an elastic job.

A worker schedule ``0:2,4:3,8:4,12:2`` says how many workers run from which step on. Every
change opens a generation. Survivors keep their order (so the leader, ``worker-0``, is rank 0
of every world); joiners get fresh ids appended after them; a shrink keeps the first workers
and releases the last ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class ScheduleError(ValueError):
    """A worker schedule that cannot be followed; the message says how to fix it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Generation:
    index: int
    at_step: int
    members: tuple[str, ...]


def parse_worker_schedule(text: str, *, steps: int, max_workers: int) -> list[tuple[int, int]]:
    """``"0:2,4:3"`` -> [(0, 2), (4, 3)], checked: starts at step 0, increasing, in range."""
    entries = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+):(\d+)", part)
        if match is None:
            raise ScheduleError(f"worker schedule entry {part!r}: expected STEP:WORKERS, e.g. 4:3")
        entries.append((int(match.group(1)), int(match.group(2))))
    if not entries or entries[0][0] != 0:
        raise ScheduleError("the worker schedule must start at step 0, e.g. 0:2,4:3")
    for (a, _), (b, _) in zip(entries, entries[1:], strict=False):
        if b <= a:
            raise ScheduleError(f"worker schedule steps must increase: {a} then {b}")
    for step, workers in entries:
        if not 1 <= workers <= max_workers:
            raise ScheduleError(
                f"worker schedule {step}:{workers}: use between 1 and {max_workers} workers"
            )
        if step >= steps:
            raise ScheduleError(f"worker schedule step {step} is past the run's {steps} steps")
    return entries


def generations(schedule: list[tuple[int, int]]) -> list[Generation]:
    """The members of every generation; entries that do not change the count are merged."""
    gens: list[Generation] = []
    next_id = 0
    members: tuple[str, ...] = ()
    for at_step, count in schedule:
        if gens and count == len(members):
            continue
        if count <= len(members):
            members = members[:count]
        else:
            fresh = tuple(f"worker-{next_id + i}" for i in range(count - len(members)))
            next_id += len(fresh)
            members = members + fresh
        gens.append(Generation(index=len(gens), at_step=at_step, members=members))
    return gens


def all_workers(gens: list[Generation]) -> list[str]:
    """Every worker id that takes part, in order of first appearance."""
    seen: dict[str, None] = {}
    for gen in gens:
        seen.update(dict.fromkeys(gen.members))
    return list(seen)
