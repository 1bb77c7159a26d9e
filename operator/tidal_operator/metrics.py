"""The operator's Prometheus metrics (DESIGN.md section 5), all under the ``tidal_`` namespace.

One registry per Metrics object rather than the process-global default, so that tests and an
embedded operator can have several without clashing names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tidal_operator.queues import SOURCES

DECISION_KINDS = ("scale_up", "scale_down", "drain_deadline", "restart", "invalid")
JOB_DECISION_KINDS = ("scale_up", "scale_down", "restart")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        common = {"namespace": "tidal", "registry": self.registry}
        self.idle_gpus = Gauge("idle_gpus", "GPUs allocatable on nodes and held by no pod.", **common)
        self.gpus = Gauge("gpus", "GPUs allocatable on all nodes.", **common)
        self.pending_gpu_demand = Gauge(
            "pending_gpu_demand",
            "GPUs requested by pending non-elastic pods and by jobs waiting in a batch queue.",
            **common
        )
        self.pending_pods = Gauge("pending_gpu_pods", "Pending non-elastic GPU pods.", **common)
        self.queued_gpu_demand = Gauge(
            "queued_gpu_demand",
            "GPUs requested by jobs waiting in a batch queue before their pods exist, by queue "
            "(kueue: Workloads not admitted; volcano: PodGroups Pending or Inqueue).",
            ["source"], **common
        )
        for source in SOURCES:
            self.queued_gpu_demand.labels(source=source)
        self.arrival_rate = Gauge(
            "arrival_rate_per_hour",
            "Non-elastic GPU pod arrivals per hour, estimated over the arrival window.", **common
        )
        self.decisions = Counter(
            "decisions", "Scale decisions taken, by kind.", ["kind"], **common
        )
        for kind in DECISION_KINDS:
            self.decisions.labels(kind=kind)
        self.decision_seconds = Histogram(
            "decision_seconds", "Seconds to build a snapshot and decide.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0), **common
        )
        labels = ["namespace", "job"]
        self.job_workers = Gauge("job_workers", "Workers of the applied generation.", labels, **common)
        self.job_target_workers = Gauge(
            "job_target_workers", "Workers the operator asks for.", labels, **common
        )
        self.job_generation = Gauge("job_generation", "Applied generation.", labels, **common)
        self.job_decisions = Counter(
            "job_decisions", "Scale decisions taken for a job, by kind.", [*labels, "kind"],
            **common
        )

    def observe_job(self, namespace: str, job: str, *, workers: int, target_workers: int,
                    generation: int) -> None:
        """A job's gauges; its decision counters start at 0 here, before any decision, so
        that Prometheus sees the first one as an increase."""
        self.job_workers.labels(namespace, job).set(workers)
        self.job_target_workers.labels(namespace, job).set(target_workers)
        self.job_generation.labels(namespace, job).set(generation)
        for kind in JOB_DECISION_KINDS:
            self.job_decisions.labels(namespace, job, kind)

    def decided(self, namespace: str, job: str, kind: str) -> None:
        """A scale decision applied to a job: counted overall and for the job."""
        self.decisions.labels(kind=kind).inc()
        self.job_decisions.labels(namespace, job, kind).inc()

    def forget_job(self, namespace: str, job: str) -> None:
        for gauge in (self.job_workers, self.job_target_workers, self.job_generation):
            try:
                gauge.remove(namespace, job)
            except KeyError:
                pass
        for kind in JOB_DECISION_KINDS:
            try:
                self.job_decisions.remove(namespace, job, kind)
            except KeyError:
                pass

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
