"""Job traces (ITP CSVs: job_id, submission_time, duration, num_gpu) and the elastic-job rule.

The rule, stated and reproducible: sort jobs by GPU-hours (ties: job_id), mark the largest
elastic until their GPU-hours reach ``share`` of the trace's; jobs under 8 GPUs are never
elastic (a FlexTrain worker is one 8-GPU node). An elastic job's FlexTrain size is Small
up to 32 GPUs, Medium up to 128, Large above; its minimum is its requested GPUs.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path

GPUS_PER_NODE = 8
DEFAULT_SHARE = 0.3  # elastic jobs' share of the trace's GPU-hours
DEFAULT_LOAD = 0.8  # the default cluster's mean load
DEFAULT_REACH = 4  # the default cluster holds this many times the largest elastic job


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceJob:
    """One job of a trace; ``size`` is its FlexTrain configuration if elastic, else None."""

    job_id: str
    submit: float
    duration: float
    gpus: int
    size: str | None = None

    @property
    def gpu_seconds(self) -> float:
        return self.gpus * self.duration


COLUMNS = ("job_id", "submission_time", "duration", "num_gpu")


def load_trace(path: str | Path) -> list[TraceJob]:
    """The trace's jobs with GPUs and a positive duration, by submission time then id.

    Raises ValueError, naming the file and line, for a missing column or a value that is not
    a number."""
    jobs = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(missing)}; a trace has the columns "
                             f"{', '.join(COLUMNS)}")
        for row in reader:
            try:
                gpus, duration = int(row["num_gpu"]), float(row["duration"])
                submit = float(row["submission_time"])
            except (TypeError, ValueError):
                raise ValueError(f"{path}, line {reader.line_num}: num_gpu must be an integer, "
                                 f"submission_time and duration numbers; got "
                                 f"{row['num_gpu']!r}, {row['submission_time']!r}, "
                                 f"{row['duration']!r}") from None
            if gpus > 0 and duration > 0:
                jobs.append(TraceJob(job_id=row["job_id"], submit=submit, duration=duration,
                                     gpus=gpus))
    return sorted(jobs, key=lambda j: (j.submit, j.job_id))


def flextrain_size(gpus: int) -> str:
    return "small" if gpus <= 32 else "medium" if gpus <= 128 else "large"


def mark_elastic(jobs: list[TraceJob], share: float = DEFAULT_SHARE) -> list[TraceJob]:
    """``jobs`` with the largest by GPU-hours marked elastic up to ``share`` of them."""
    total = sum(j.gpu_seconds for j in jobs)
    chosen: set[str] = set()
    taken = 0.0
    for job in sorted(jobs, key=lambda j: (-j.gpu_seconds, j.job_id)):
        if taken >= share * total:
            break
        if job.gpus >= GPUS_PER_NODE and job.gpus % GPUS_PER_NODE == 0:
            chosen.add(job.job_id)
            taken += job.gpu_seconds
    return [replace(j, size=flextrain_size(j.gpus)) if j.job_id in chosen else j for j in jobs]


def default_nodes(jobs: list[TraceJob], load: float = DEFAULT_LOAD,
                  reach: int = DEFAULT_REACH) -> int:
    """Nodes of 8 GPUs such that the trace's mean GPU demand is ``load`` of the cluster, and
    never fewer than ``reach`` times the largest elastic job (the largest job if none is
    elastic) needs: FlexTrain's elastic range is 4x a job's initial GPUs, and a cluster that
    cannot hold that has no room to show it."""
    if not jobs:
        return 1
    span = max(j.submit + j.duration for j in jobs) - min(j.submit for j in jobs)
    demand = sum(j.gpu_seconds for j in jobs) / max(span, 1.0)
    largest = max(j.gpus for j in jobs if j.size) if any(j.size for j in jobs) else \
        max(j.gpus for j in jobs)
    gpus = max(demand / load, reach * largest)
    return max(1, math.ceil(gpus / GPUS_PER_NODE))
