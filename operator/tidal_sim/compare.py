"""Policies side by side over one trace: static's figures the baseline of every ratio.

:func:`compare` runs static and each policy (:class:`~tidal_sim.engine.Simulation`) and keeps
what the reports, tables and plots need; :func:`tradeoff` runs tidal at several thresholds,
the price in queueing of faster elastic jobs; :func:`beaten_by` names the peers that beat a
policy on both counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tidal_sim.config import POLICIES, SimConfig
from tidal_sim.engine import Simulation
from tidal_sim.trace import TraceJob


@dataclass(frozen=True, slots=True)
class Outcome:
    """One policy's run: its report (with the ratios to static) and the series behind it."""

    report: dict
    jct_s: list[float]  # elastic jobs' completion times, sorted
    queue_s: list[float]  # non-elastic jobs' queue times, sorted
    timeline: tuple[list[float], list[int]]  # (time since the first submission, GPUs held)
    ceiling_speedup: float | None = None  # static's only: Simulation.ceiling_speedup


def compare(jobs: list[TraceJob], nodes: int, policies=POLICIES,
            progress: Callable[[str, float], None] | None = None,
            **options) -> dict[str, Outcome]:
    """``static`` and every policy over ``jobs``, static's figures the baseline of the ratios.

    ``jct_speedup`` is static's mean elastic JCT over the policy's; ``queue_ratio`` is the
    policy's mean non-elastic queue time over static's (None where static's is 0 and the
    policy's is not: no finite ratio). ``progress(policy, fraction)`` follows each run;
    ``options`` are :class:`SimConfig`'s (``elastic``, ``seed``, ``pause_scale``, ...).
    """
    first = min((j.submit for j in jobs), default=0.0)
    out: dict[str, Outcome] = {}
    for name in dict.fromkeys(("static", *policies)):
        hook = None if progress is None else (lambda f, name=name: progress(name, f))
        sim = Simulation(jobs, SimConfig(policy=name, nodes=nodes, **options), progress=hook)
        report = sim.run()
        times, held = sim.timeline
        out[name] = Outcome(report, sim.jct_seconds(), sim.queue_seconds(),
                            ([t - first for t in times], held),
                            sim.ceiling_speedup() if name == "static" else None)
    base = out["static"].report
    for outcome in out.values():
        _ratios(outcome.report, base)
    return out


def tradeoff(jobs: list[TraceJob], nodes: int, thresholds: list[float], static: dict,
             **options) -> list[dict]:
    """tidal's elastic JCT speedup and non-elastic queue ratio (over ``static``'s report) at
    each of ``thresholds``, the Poisson rule's and the headroom rule's ``probabilityThreshold``,
    held there whatever the load (``loadedThreshold`` the same: no slide): the price in
    queueing of each step towards faster elastic jobs."""
    out = []
    for threshold in thresholds:
        report = Simulation(jobs, SimConfig(policy="tidal", nodes=nodes, threshold=threshold,
                                            loaded_threshold=threshold, **options)).run()
        _ratios(report, static)
        out.append({"threshold": threshold, "jct_speedup": report["jct_speedup"],
                    "queue_ratio": report["queue_ratio"]})
    return out


def _ratios(report: dict, base: dict) -> None:
    report["jct_speedup"] = (base["elastic_jct_mean_s"] / report["elastic_jct_mean_s"]
                             if report["elastic_jct_mean_s"] else 1.0)
    report["queue_ratio"] = (report["queue_mean_s"] / base["queue_mean_s"] if base["queue_mean_s"]
                             else 1.0 if report["queue_mean_s"] == 0 else None)


# Differences within this fraction of a figure are noise: neither faster nor kinder.
TOLERANCE = 0.005


def beaten_by(reports: Mapping[str, dict], policy: str = "tidal",
              peers: tuple[str, ...] = ("greedy", "flextrain"),
              tolerance: float = TOLERANCE) -> list[str]:
    """The peers among ``reports`` (each with ``jct_speedup`` and ``queue_ratio``) that beat
    ``policy`` on both counts: at least as fast for elastic jobs and at least as kind to the
    queue (each within ``tolerance`` counting as equal), and better beyond it on one of the
    two. A queue ratio of None (static queued nothing, the run did) is the worst there is."""
    def figures(name: str) -> tuple[float, float]:
        report = reports[name]
        queue = report["queue_ratio"]
        return report["jct_speedup"], math.inf if queue is None else queue

    jct, queue = figures(policy)
    beaten = []
    for peer in peers:
        if peer not in reports:
            continue
        peer_jct, peer_queue = figures(peer)
        as_good = peer_jct >= jct * (1 - tolerance) and peer_queue <= queue * (1 + tolerance)
        better = peer_jct > jct * (1 + tolerance) or peer_queue < queue * (1 - tolerance)
        if as_good and better:
            beaten.append(peer)
    return beaten
