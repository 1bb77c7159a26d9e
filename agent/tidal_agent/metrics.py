"""The agent's Prometheus metrics (DESIGN.md section 5), under the ``tidal_agent_`` prefix.

Every agent exports ``tidal_agent_up{namespace, job, pod}``. Only the leader sees the job's
steps and switches, so only its ``AgentMetrics`` has a ``job`` (``JobMetrics``): one series
per quantity with labels ``namespace`` and ``job``, created up front so that Prometheus sees
them from the first scrape (a counter born at 1 hides its first increase); gauges are NaN
until the value they stand for exists. Each
``AgentMetrics`` has its own registry, never the process-global one, so that tests can build
several. The labels ``namespace`` and ``job`` clash with the labels Prometheus attaches to a
target; scrape with ``honor_labels: true`` (``honorLabels`` in a ServiceMonitor or PodMonitor).
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DIRECTIONS = ("grow", "shrink", "replan")  # replan: the same members, re-partitioned


class JobMetrics:
    """The leader's series of one job; each method takes one worker event."""

    def __init__(self, registry: CollectorRegistry, namespace: str, job: str) -> None:
        labels, values = ("namespace", "job"), (namespace, job)
        common = {"namespace": "tidal", "subsystem": "agent", "registry": registry}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, **common).labels(*values)

        self.step = gauge("step", "Steps completed.")
        self.loss = gauge("loss", "Loss of the last step.")
        self.step_seconds = gauge("step_seconds", "Seconds of the last step.")
        self.predicted_step_seconds = gauge(
            "predicted_step_seconds", "The planner's step seconds for the running layout "
            "(NaN where it made none).")
        self.tokens_per_second = gauge(
            "tokens_per_second", "Tokens per second over the last steps of this layout.")
        self.generation = gauge("generation", "The generation that trains now.")
        self.workers = gauge("workers", "Workers of the generation that trains now.")
        self.dp = gauge("dp", "Data-parallel degree of the running layout.")
        self.pp = gauge("pp", "Pipeline-parallel degree of the running layout.")
        self.last_pause = gauge(
            "last_switch_pause_seconds",
            "Pause of the last switch: end of the last old step to the first new one.")
        self.bytes_moved = Counter(
            "bytes_moved", "State bytes moved between workers by switches.", labels, **common
        ).labels(*values)
        reconfigurations = Counter(
            "reconfigurations", "Switches of the layout, by direction: the worker count grew "
            "or shrank, or the same workers re-planned around a straggler.",
            (*labels, "direction"), **common)
        self.reconfigurations = {d: reconfigurations.labels(*values, d) for d in DIRECTIONS}
        self.recoveries = Counter(
            "recoveries", "Fault paths taken: generations rebuilt without lost members.",
            labels, **common).labels(*values)
        self.lost_workers = Counter(
            "lost_workers", "Members lost to faults (killed, deleted at a drain deadline).",
            labels, **common).labels(*values)
        self.replayed_steps = Counter(
            "replayed_steps", "Steps trained again after a fault, from the peer snapshot or checkpoint resumed from.",
            labels, **common).labels(*values)
        self.relative_speed = Gauge(
            "relative_speed", "Each member's decoder-layer speed relative to the fastest "
            "member's (1: as fast), the median of its newest steps.",
            (*labels, "member"), **common)
        self._values = values
        self.stragglers = gauge("stragglers", "Members flagged as stragglers now.")
        self.pause = Histogram(
            "switch_pause_seconds", "Pauses of the switches.", labels, buckets=PAUSE_BUCKETS,
            **common).labels(*values)
        # Nothing is known before generation 0 trains: a 0 would draw a false loss or layout.
        for unknown in (self.loss, self.step_seconds, self.predicted_step_seconds,
                        self.tokens_per_second, self.generation, self.workers, self.dp, self.pp,
                        self.last_pause):
            unknown.set(math.nan)

    def applied(self, generation: int, workers: int, dp: int, pp: int,
                predicted_step_s: float | None) -> None:
        self.generation.set(generation)
        self.workers.set(workers)
        self.dp.set(dp)
        self.pp.set(pp)
        self.predicted_step_seconds.set(math.nan if predicted_step_s is None else predicted_step_s)

    def stepped(self, step: int, loss: float, seconds: float, tokens_per_second: float) -> None:
        self.step.set(step + 1)
        self.loss.set(loss)
        self.step_seconds.set(seconds)
        self.tokens_per_second.set(tokens_per_second)

    def speeds(self, speeds: dict[str, float], stragglers: int) -> None:
        for member, speed in speeds.items():
            self.relative_speed.labels(*self._values, member).set(speed)
        self.stragglers.set(stragglers)

    def recovered(self, lost: int, replayed: int) -> None:
        self.recoveries.inc()
        self.lost_workers.inc(lost)
        self.replayed_steps.inc(replayed)

    def switched(self, from_workers: int, to_workers: int, pause_s: float,
                 bytes_moved: int) -> None:
        direction = ("grow" if to_workers > from_workers else
                     "shrink" if to_workers < from_workers else "replan")
        self.reconfigurations[direction].inc()
        self.pause.observe(pause_s)
        self.last_pause.set(pause_s)
        self.bytes_moved.inc(bytes_moved)


class AgentMetrics:
    """One agent's registry: its liveness, and the job's series if it leads."""

    def __init__(self, *, namespace: str, job: str, pod: str, leader: bool) -> None:
        self.registry = CollectorRegistry()
        Gauge("up", "1 while this agent runs.", ("namespace", "job", "pod"), namespace="tidal",
              subsystem="agent", registry=self.registry).labels(namespace, job, pod).set(1)
        self.namespace, self.job_name = namespace, job
        self.job = JobMetrics(self.registry, namespace, job) if leader else None
        self._server = None

    def lead(self) -> JobMetrics:
        """This agent leads from now on (it took the lead from a lost leader): the job's
        series, from zero in this pod's registry."""
        if self.job is None:
            self.job = JobMetrics(self.registry, self.namespace, self.job_name)
        return self.job

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``port`` (0: any free port) from a daemon thread; the port."""
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
