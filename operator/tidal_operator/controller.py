"""The control loop: indexes -> snapshot -> decide() -> pods, status, Events and metrics.

Every round is a pure function of what the API says (the kopf indexes of nodes, pods and
ElasticTrainingJobs) plus the clock, and every write is idempotent, so a restarted operator
picks up where the last one stopped: the outstanding target, the cooldown, the drain
deadlines, the leader's absence and the non-elastic arrivals the Poisson rule counts live in
each job's status, pod names are deterministic. What is kept in memory is what this process
wrote and the watches may not have delivered yet (:class:`~tidal_operator.view.Written`), so
as not to act twice on one decision, and caches (parsed specs, the arrivals seen).

A round: read the jobs, build the snapshot, ``decide``; run each job's lifecycle
(:class:`~tidal_operator.lifecycle.Lifecycle`) and keep the arrivals in its status; apply the
decisions as targets, pods and Events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from tidal_api import ElasticTrainingJob, JobSpecError, JobStatus, Target, parse_job
from tidal_api.status import SCALING, VALID, Arrival, set_condition, status_patch
from tidal_operator import builders
from tidal_operator.adapter import Adapter, ApiUnavailable, rfc3339
from tidal_operator.lifecycle import Lifecycle, condition
from tidal_operator.metrics import Metrics
from tidal_operator.policy import Decision, Load, decide
from tidal_operator.queues import SOURCES, PodGroup, podgroup_demand, source_of
from tidal_operator.snapshot import (
    FINISHED_PHASES,
    ElasticJob,
    Node,
    Placement,
    Pod,
    Snapshot,
    parse_time,
)
from tidal_operator.view import JobView, Written

log = logging.getLogger(__name__)

# The agent takes no target in a job's last step; the operator asks for none a little earlier,
# so that a scale-up it makes can still be applied (joiners start, register, then switch).
NO_SWITCH_STEPS = 2
DEFAULT_WINDOW_S = 8 * 3600.0  # the arrival window while no job gives one


@dataclass(frozen=True, slots=True)
class Config:
    gpu_resource: str = "nvidia.com/gpu"
    interval_s: float = 2.0
    worker_lost_after_s: float = 5.0  # set in every worker pod (builders.WorkerSettings)
    # Demand from batch queues, where their CRDs exist (tidal_operator.queues)
    kueue: bool = True
    volcano: bool = True

    @property
    def worker(self) -> builders.WorkerSettings:
        return builders.WorkerSettings(gpu_resource=self.gpu_resource,
                                       lost_after_s=self.worker_lost_after_s)


def _one(store: Iterable[Any]) -> Any:
    for value in store:
        return value
    return None


@dataclass
class Controller:
    """The control loop over kopf's indexes: ``round(now)`` is one pass, ``run`` repeats it."""

    adapter: Adapter
    metrics: Metrics
    config: Config = field(default_factory=Config)
    # kopf indexes (live mappings of key -> store of values), set by the startup handler
    nodes: Mapping[str, Iterable[Node]] = field(default_factory=dict)
    pods: Mapping[str, Iterable[Pod]] = field(default_factory=dict)
    jobs: Mapping[str, Iterable[Mapping[str, Any]]] = field(default_factory=dict)
    # queued demand (tidal_operator.queues): Kueue Workloads waiting, as their pending pods;
    # Volcano PodGroups waiting, and every PodGroup's pods by the group's "ns/name"
    workloads: Mapping[str, Iterable[tuple[Pod, ...]]] = field(default_factory=dict)
    podgroups: Mapping[str, Iterable[PodGroup]] = field(default_factory=dict)
    members: Mapping[str, Iterable[Pod]] = field(default_factory=dict)
    clock: Callable[[], float] = time.time  # epoch seconds: the rounds' ``now``
    written: Written = field(default_factory=Written)
    lifecycle: Lifecycle = field(init=False)
    # non-elastic GPU pod -> (created, GPUs): the arrivals seen, which each job's status keeps
    _arrivals: dict[str, tuple[float, int]] = field(default_factory=dict)
    _parsed: dict[tuple[str, str], ElasticTrainingJob | str] = field(default_factory=dict)
    # the share of GPUs owed, smoothed over the rounds (the scale-up threshold's load); kept in
    # memory only: a restarted operator begins again from the share it sees
    _load: Load = field(default_factory=Load)
    last_round: float = 0.0

    def __post_init__(self) -> None:
        self.lifecycle = Lifecycle(self.adapter, self.metrics, self.written, self.config.worker)

    # ---- one round -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Rounds every ``interval_s`` until ``stop``; an error in one round never ends it."""
        backoff = self.config.interval_s
        while not stop.is_set():
            try:
                await self.round(self.clock())
                backoff = self.config.interval_s
            except ApiUnavailable as err:
                log.warning("Kubernetes API unavailable, retrying in %.0fs: %s", backoff, err)
                backoff = min(backoff * 2, 60.0)
            except Exception:  # noqa: BLE001 - log with traceback, keep serving the other jobs
                log.exception("control round failed")
            try:
                await asyncio.wait_for(stop.wait(), timeout=backoff)
            except TimeoutError:
                pass

    async def round(self, now: float) -> tuple[Decision, ...]:
        started = time.perf_counter()
        views = self.views()
        snapshot = self.snapshot(views, now)
        decisions = decide(snapshot, now)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        self._observe_cluster(snapshot, now)
        starts = {d.job: d for d in decisions if d.kind == "start"}
        for view in views.values():
            try:
                await self.lifecycle.reconcile(view, self._job_pods(view), now,
                                               start=starts.get(view.key))
                await self._keep_arrivals(view, now)
            except ApiUnavailable as err:
                log.warning("%s: %s (retrying next round)", view.key, err)
        for decision in decisions:
            if decision.kind == "start":
                continue  # the lifecycle's: the job's first target and pods
            try:
                await self.apply(views[decision.job], decision, now)
            except ApiUnavailable as err:
                log.warning("%s: decision not applied: %s", decision.job, err)
        self.last_round = now
        return decisions

    # ---- reading ---------------------------------------------------------------------------

    def _parse(self, key: str, body: Mapping[str, Any]) -> ElasticTrainingJob | str:
        """The job, or the one-line reason it is invalid; cached per resourceVersion."""
        version = (key, str(body["metadata"].get("resourceVersion", "")))
        if version not in self._parsed:
            if len(self._parsed) > 4096:
                self._parsed.clear()
            try:
                job = parse_job(dict(body), source=key)
                self._parsed[version] = job.spec.contradiction() or job
            except JobSpecError as err:
                self._parsed[version] = str(err)
        return self._parsed[version]

    def views(self) -> dict[str, JobView]:
        views = {}
        for key, store in self.jobs.items():
            body = _one(store)
            if body is None:
                continue
            parsed = self._parse(key, body)
            if isinstance(parsed, str):
                continue  # invalid: the validation handler reports it
            views[key] = JobView(key, body, parsed, parsed.status or JobStatus())
        return views

    def snapshot(self, views: Mapping[str, JobView], now: float) -> Snapshot:
        nodes = tuple(n for store in self.nodes.values() if (n := _one(store)) is not None)
        pods = tuple(p for store in self.pods.values() if (p := _one(store)) is not None)
        window = max((v.job.spec.scaling.arrival_window_seconds for v in views.values()),
                     default=DEFAULT_WINDOW_S)
        self._see_arrivals(views, pods, now - window)
        jobs = tuple(self._elastic_job(v) for v in views.values())
        arrivals = sorted(self._arrivals.values())
        snapshot = Snapshot(nodes=nodes, pods=pods + self.queued(), jobs=jobs,
                            arrivals=tuple(t for t, _ in arrivals), window_seconds=window,
                            arrival_gpus=tuple(g for _, g in arrivals))
        return replace(snapshot, load=self._load.observe(now, snapshot.owed_share(), window))

    def queued(self) -> tuple[Pod, ...]:
        """The pending pods of the jobs that wait in a batch queue (see
        :mod:`tidal_operator.queues`). They are demand, not arrivals: a queued job's pods
        arrive once they are created."""
        pods = [pod for store in self.workloads.values() for demand in store for pod in demand]
        for key, store in self.podgroups.items():
            group = _one(store)
            if group is not None:
                pods += podgroup_demand(group, self.members.get(key, ()))
        return tuple(pods)

    def _see_arrivals(self, views: Mapping[str, JobView], pods: Iterable[Pod],
                      since: float) -> None:
        """The non-elastic GPU pods created since ``since``: those this process saw, those
        the jobs' statuses keep (seen before a restart, maybe gone since) and those indexed
        now; each pod counted once, at its first creation time seen."""
        for view in views.values():
            for arrival in view.status.arrivals:
                self._arrivals.setdefault(
                    arrival.pod, (parse_time(arrival.created_at) or 0.0, arrival.gpus))
        for pod in pods:
            if pod.job is None and pod.gpus > 0:
                self._arrivals.setdefault(pod.key, (pod.created, pod.gpus))
        for key, (created, _) in list(self._arrivals.items()):
            if created < since:
                del self._arrivals[key]

    async def _keep_arrivals(self, view: JobView, now: float) -> None:
        """Write the arrivals within the job's window to its status, for a restarted operator
        to count (the pods may be gone by then); finished jobs decide nothing."""
        if view.status.phase in FINISHED_PHASES:
            return
        since = now - view.job.spec.scaling.arrival_window_seconds
        kept = tuple(Arrival(pod=key, created_at=rfc3339(created), gpus=gpus)
                     for created, key, gpus in sorted(
                         (created, key, gpus) for key, (created, gpus) in self._arrivals.items()
                         if created >= since))
        if kept != self.written.arrivals.get(view.key, view.status.arrivals):
            await self.adapter.patch_status(view.name, view.namespace,
                                            status_patch(arrivals=kept))
            self.written.arrivals[view.key] = kept

    def _elastic_job(self, view: JobView) -> ElasticJob:
        spec, status = view.job.spec, view.status
        target = status.target
        applied = (bool(status.members) and target is not None
                   and status.generation == target.generation)
        written = self.written.targets.get(view.key)
        # the view predates a target this process wrote
        behind = written is not None and (target is None or target.generation < written)
        busy = (not applied or behind or self.written.stale(view)
                or status.phase in FINISHED_PHASES
                or status.step >= spec.training.steps - NO_SWITCH_STEPS)
        return ElasticJob(
            key=view.key,
            min_workers=spec.workers.min,
            max_workers=spec.workers.max,
            max_scale_factor=spec.max_scale_factor,
            gpus_per_worker=spec.gpus_per_worker,
            workers=len(status.members),
            members=tuple(f"{view.namespace}/{m}" for m in status.members),
            busy=busy,
            releasing=tuple(f"{view.namespace}/{n}" for n in target.release) if target else (),
            scale_table=status.scale_table,
            probability_threshold=spec.scaling.probability_threshold,
            loaded_threshold=spec.scaling.loaded_threshold,
            min_gain=spec.scaling.min_gain,
            arrival_window_seconds=spec.scaling.arrival_window_seconds,
            cooldown_seconds=spec.scaling.cooldown_seconds,
            last_scale_time=parse_time(status.last_scale_time),
            switch_seconds=(status.last_switch_seconds if status.last_switch_seconds is not None
                            else spec.scaling.switch_overhead_seconds),
            enabled=spec.scaling.enabled,
            placement=Placement.of(spec.template.node_selector, spec.template.tolerations),
            slow=tuple(f"{view.namespace}/{s.member}" for s in status.stragglers if s.release),
            unstarted=target is None, preferred_workers=spec.workers.preferred,
        )

    def _job_pods(self, view: JobView) -> dict[str, Pod]:
        """The job's pods by name."""
        prefix = f"{view.namespace}/"
        out = {}
        for store in self.pods.values():
            pod = _one(store)
            if pod is not None and pod.job == view.key:
                out[pod.key.removeprefix(prefix)] = pod
        return out

    def _observe_cluster(self, snapshot: Snapshot, now: float) -> None:
        m = self.metrics
        total = sum(n.gpus for n in snapshot.nodes)
        held = sum(p.gpus for p in snapshot.pods if p.node and not p.finished)
        pending = [p for p in snapshot.pods if p.job is None and p.gpus and p.node is None
                   and not p.finished]
        queued = dict.fromkeys(SOURCES, 0)
        for pod in pending:
            if (source := source_of(pod)) is not None:
                queued[source] += pod.gpus
        m.gpus.set(total)
        m.idle_gpus.set(max(total - held, 0))
        m.pending_pods.set(sum(source_of(p) is None for p in pending))
        m.pending_gpu_demand.set(sum(p.gpus for p in pending))
        for source, gpus in queued.items():
            m.queued_gpu_demand.labels(source=source).set(gpus)
        recent = [t for t in snapshot.arrivals if t >= now - snapshot.window_seconds]
        m.arrival_rate.set(len(recent) / snapshot.window_seconds * 3600.0)

    # ---- validation (called by the handlers on create, update and resume) -------------------

    async def validate(self, body: Mapping[str, Any], now: float) -> str | None:
        """Report an invalid spec as condition Valid=False and a Warning Event; None if valid."""
        meta = body["metadata"]
        name, namespace = meta["name"], meta.get("namespace", "default")
        key = f"{namespace}/{name}"
        parsed = self._parse(key, body)
        try:
            status = JobStatus.model_validate(body.get("status") or {})
        except ValidationError:
            status = JobStatus()  # the API server's schema keeps it valid; start afresh if not
        old = next((c for c in status.conditions if c.type == VALID), None)
        generation = meta.get("generation", 0)
        if isinstance(parsed, str):
            problem = parsed.removeprefix(f"{key}: ")
            if old and old.status == "False" and old.message == problem:
                return problem  # already reported
            await self.adapter.patch_status(name, namespace, status_patch(
                phase="Invalid", conditions=set_condition(status.conditions, condition(
                    VALID, "False", "InvalidSpec", problem, now, generation))))
            await self.adapter.event(dict(body), reason="InvalidSpec", message=problem,
                                     warning=True, now=now)
            self.metrics.decisions.labels(kind="invalid").inc()
            return problem
        if not old or old.status != "True":
            patch: dict[str, Any] = {"conditions": set_condition(status.conditions, condition(
                VALID, "True", "SpecAccepted", "the spec can be run", now, generation))}
            if status.phase == "Invalid":
                patch["phase"] = "Pending"
            await self.adapter.patch_status(name, namespace, status_patch(**patch))
        return None

    def forget(self, namespace: str, name: str) -> None:
        """A deleted job: its gauges, and what this loop kept of it (a job created again under
        its name starts afresh)."""
        self.written.forget(f"{namespace}/{name}")
        self.metrics.forget_job(namespace, name)

    # ---- decisions --------------------------------------------------------------------------

    async def apply(self, view: JobView, decision: Decision, now: float) -> None:
        """A decision as the job's next target: a scale-up's joiners get their pods (new
        names, never given before), a scale-down's releases a drain deadline."""
        job, status = view.job, view.status
        generation = (status.target.generation if status.target else 0) + 1
        up = decision.kind == "scale_up"
        join: tuple[str, ...] = ()
        release: tuple[str, ...] = ()
        deadline = None
        if up:
            taken = [builders.worker_index(n)
                     for n in (*self._job_pods(view), *status.members, *status.lost)
                     if n != builders.rendezvous_name(view.name)]
            first = max(taken, default=-1) + 1
            count = decision.to_workers - decision.from_workers
            join = tuple(builders.worker_name(view.name, first + i) for i in range(count))
        else:
            release = tuple(k.split("/", 1)[1] for k in decision.release)
            deadline = rfc3339(now + job.spec.scaling.drain_timeout_seconds)
        target = Target(workers=decision.to_workers, generation=generation,
                        reason=decision.reason, issued_at=rfc3339(now), join=join,
                        release=release, deadline=deadline)
        line = f"{decision.from_workers} -> {decision.to_workers} workers: {decision.message}"
        await self.adapter.patch_status(view.name, view.namespace, status_patch(
            target=target, phase="Scaling", last_scale_time=rfc3339(now), last_decision=line,
            conditions=set_condition(status.conditions, condition(
                SCALING, "True", decision.reason, line, now, view.generation))))
        self.written.targets[view.key] = generation
        for name in join:
            await self.lifecycle.create_worker(view, target, name)
        self.metrics.decided(view.namespace, view.name, decision.kind)
        await self.adapter.event(dict(view.body), reason="ScaleUp" if up else "ScaleDown",
                                 message=f"{decision.reason}: {line}", now=now)
