"""Non-elastic GPU jobs for the one-machine cluster: Poisson arrivals of pods that hold GPUs.

Each arrival is one pod that asks for some GPUs and holds them for a duration (annotation
``tidal.dev/duration-seconds``: the local kubelet marks it Succeeded once that much time has
passed, and its GPUs are free again). Inter-arrival times are exponential with the given rate,
from a seeded generator, so a seed replays the same arrivals.

Durations and GPU counts come from one of two models:

- synthetic: exponential durations with the given mean, and 1, 2 or 4 GPUs with
  probabilities 0.5, 0.3 and 0.2 (about the share of small jobs in the traces below);
- a trace (``--trace``, e.g. ``traces/elasticflow-itp/cluster01.csv``, columns
  ``job_id, submission_time, duration, num_gpu``): a row drawn at random per arrival, its
  duration divided by ``time_scale`` (trace seconds per demo second; 400 turns the traces'
  median job of about 2 h into about 20 s) and its GPUs capped to a node's.

Every duration is clamped to ``[min_duration_s, max_duration_s]``, and GPU counts are capped
to a node's GPUs, so that every job fits on some empty node.

A demo cannot wait for Poisson luck to show a scale-down, so ``burst_after_scale_up_s`` adds
one deterministic burst: that many seconds after the operator's first ``ScaleUp`` Event, as
many one-GPU pods as there are idle GPUs, plus one. All but one fit on the idle GPUs; the last
one is pending until the operator takes a GPU back from an elastic job.
"""

from __future__ import annotations

import asyncio
import csv
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal_api import keys
from tidal_kube.clusterapi import FINISHED, GPU, ClusterApi, gpu_request, node_gpus
from tidal_kube.kubelet import DURATION_ANNOTATION

log = logging.getLogger(__name__)

Obj = dict[str, Any]
SYNTHETIC_GPUS = ((1, 0.5), (2, 0.3), (4, 0.2))
APP_LABEL = "app.kubernetes.io/name"
APP = "batch"  # the label value of every generated pod


@dataclass(frozen=True, kw_only=True, slots=True)
class ArrivalConfig:
    """The workload of non-elastic GPU jobs (see the module's docstring)."""

    rate_per_hour: float = 60.0
    mean_duration_s: float = 30.0
    trace: Path | None = None
    time_scale: float = 400.0
    min_duration_s: float = 5.0
    max_duration_s: float = 120.0
    max_gpus: int = 4
    seed: int = 0
    burst_after_scale_up_s: float | None = None
    burst_duration_s: float = 30.0
    namespace: str = "default"
    resource: str = GPU

    def __post_init__(self) -> None:
        if self.rate_per_hour < 0:
            raise ValueError("the arrival rate must be >= 0 per hour")
        if not 0 < self.min_duration_s <= self.max_duration_s:
            raise ValueError("durations: need 0 < min_duration_s <= max_duration_s")
        if self.mean_duration_s <= 0 or self.time_scale <= 0:
            raise ValueError("mean_duration_s and time_scale must be > 0")
        if self.max_gpus < 1:
            raise ValueError("max_gpus must be >= 1: no node has a GPU")


@dataclass(frozen=True, slots=True)
class Arrival:
    """One submitted job: when (seconds since the generator started), its pod, GPUs, seconds."""

    at_s: float
    pod: str
    gpus: int
    duration_s: float
    burst: bool = False


def load_trace(path: Path) -> list[tuple[float, int]]:
    """(duration seconds, GPUs) of every job in a trace CSV."""
    with path.open(newline="") as handle:
        rows = [(float(r["duration"]), int(r["num_gpu"])) for r in csv.DictReader(handle)]
    if not rows:
        raise ValueError(f"{path}: no jobs")
    return rows


class Workload:
    """Draws jobs (duration seconds, GPUs) from the configured model."""

    def __init__(self, config: ArrivalConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self._trace = load_trace(config.trace) if config.trace else None

    def interarrival_s(self) -> float:
        rate = self.config.rate_per_hour / 3600.0
        return self.rng.expovariate(rate) if rate > 0 else math.inf

    def job(self) -> tuple[float, int]:
        c = self.config
        if self._trace is not None:
            duration, gpus = self.rng.choice(self._trace)
            duration /= c.time_scale
        else:
            duration = self.rng.expovariate(1.0 / c.mean_duration_s)
            sizes, weights = zip(*SYNTHETIC_GPUS, strict=True)
            gpus = self.rng.choices(sizes, weights)[0]
        duration = min(max(duration, c.min_duration_s), c.max_duration_s)
        return round(duration, 1), max(1, min(gpus, c.max_gpus))


def batch_pod(name: str, namespace: str, gpus: int, duration_s: float,
              resource: str = GPU) -> Obj:
    """A non-elastic GPU job's pod: no ``tidal.dev/job`` label, the default priority."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {APP_LABEL: APP, keys.MANAGED_BY: "tidal-local"},
                     "annotations": {DURATION_ANNOTATION: f"{duration_s:g}"}},
        "spec": {
            "restartPolicy": "Never",
            "priorityClassName": keys.DEFAULT_PRIORITY_CLASS,
            "containers": [{"name": "main", "image": "busybox:1.36",
                            "command": ["sleep", f"{duration_s:g}"],
                            "resources": {"limits": {resource: gpus}}}],
        },
    }


@dataclass
class ArrivalGenerator:
    """Submits the workload's pods through the API until cancelled; ``arrivals`` lists them."""

    config: ArrivalConfig
    arrivals: list[Arrival] = field(default_factory=list)
    _count: int = 0

    async def run(self, url: str) -> None:
        workload = Workload(self.config)
        started = time.monotonic()
        next_at = workload.interarrival_s()
        burst_at: float | None = None
        async with ClusterApi(url) as api:
            while True:
                now = time.monotonic() - started
                if self.config.burst_after_scale_up_s is not None and burst_at is None:
                    if await self._scaled_up(api):
                        burst_at = now + self.config.burst_after_scale_up_s
                        log.info("first ScaleUp seen: a burst at %.0f s", burst_at)
                if burst_at is not None and now >= burst_at and burst_at != math.inf:
                    await self._burst(api, now)
                    burst_at = math.inf  # once
                if now >= next_at:
                    duration, gpus = workload.job()
                    await self._submit(api, now, gpus, duration)
                    next_at += workload.interarrival_s()
                await asyncio.sleep(max(0.05, min(1.0, next_at - now)))

    async def _scaled_up(self, api: ClusterApi) -> bool:
        events = await api.items(f"/api/v1/namespaces/{self.config.namespace}/events")
        return any(e.get("reason") == "ScaleUp" for e in events)

    async def _burst(self, api: ClusterApi, now: float) -> None:
        """Idle GPUs + 1 one-GPU pods: one more than fits (see the module's docstring)."""
        nodes = await api.items("/api/v1/nodes")
        pods = [p for p in await api.items("/api/v1/pods")
                if (p.get("status") or {}).get("phase") not in FINISHED]
        idle = sum(node_gpus(n, self.config.resource) for n in nodes)
        idle -= sum(gpu_request(p, self.config.resource) for p in pods)
        for _ in range(max(idle, 0) + 1):
            await self._submit(api, now, 1, self.config.burst_duration_s, burst=True)

    async def _submit(self, api: ClusterApi, now: float, gpus: int, duration_s: float,
                      burst: bool = False) -> None:
        namespace = self.config.namespace
        while True:
            self._count += 1
            name = f"batch-{self._count:04d}"
            pod = batch_pod(name, namespace, gpus, duration_s, self.config.resource)
            status, _ = await api.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod,
                                          ok=(409,))
            if status != 409:  # a name left from an earlier run: take the next
                break
        self.arrivals.append(Arrival(round(now, 2), name, gpus, duration_s, burst))
        log.info("submitted %s: %d GPUs for %.0f s%s", name, gpus, duration_s,
                 " (burst)" if burst else "")
