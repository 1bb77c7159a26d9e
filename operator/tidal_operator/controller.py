"""The control loop: indexes -> snapshot -> decide() -> pods, status, Events and metrics.

Every round is a pure function of what the API says (the kopf indexes of nodes, pods and
ElasticTrainingJobs) plus the clock, and every write is idempotent, so a restarted operator
picks up where the last one stopped: the outstanding target, the cooldown and the drain
deadlines live in each job's status, pod names are deterministic. What is kept in memory is
only a guard against acting twice on one decision before the watch has delivered it
(``_written``), and caches.

Per job and round (``reconcile``):
  - no target yet: set generation 0's target (the first ``workers.min`` pods) and create them;
  - a scale-up target outstanding: make sure each joiner's pod exists;
  - a scale-down target: delete released pods once they have exited, or anyway past the
    deadline (with a Warning Event);
  - a target that a fault has overtaken (the survivors plus its joiners, less its releases,
    are not its count): supersede it with the same change on the survivors;
  - pods the agent declared lost (``status.lost``) that still run are deleted; their names
    are never given again. Replacing them, up to ``workers.min``, is ``decide``'s;
  - the leader's pod failed or gone, or every member failed: the job cannot go on (the leader
    hosts the rendezvous), so it restarts: every pod is deleted, the target and the agent's
    membership emptied, and once the pods are gone the first pods start again, from the
    newest checkpoint (the agent's generation 0 loads it). A leader that stopped when asked,
    or whose pod is gone, is no failure; after ``spec.maxRestarts`` failures the next one
    fails the job;
  - phase, conditions and the job's metrics follow the status the agent publishes.
Then ``decide`` runs over the whole cluster and its decisions become targets, pods and Events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tidal_api import ElasticTrainingJob, JobSpecError, JobStatus, keys, parse_job
from tidal_api.status import READY, SCALING, VALID
from tidal_operator import builders
from tidal_operator.adapter import Adapter, ApiUnavailable, rfc3339
from tidal_operator.metrics import Metrics
from tidal_operator.policy import Decision, decide
from tidal_operator.snapshot import ElasticJob, Node, Placement, Pod, Snapshot, parse_time

log = logging.getLogger(__name__)

FINISHED = ("Succeeded", "Failed")
# The agent takes no target in a job's last step; the operator asks for none a little earlier,
# so that a scale-up it makes can still be applied (joiners start, register, then switch).
NO_SWITCH_STEPS = 2
# A leader's pod missing from the index this long is gone, not a watch still filling it in.
LEADER_GONE_S = 10.0


@dataclass(frozen=True, slots=True)
class Config:
    gpu_resource: str = "nvidia.com/gpu"
    interval_s: float = 2.0


def _one(store: Iterable[Any]) -> Any:
    for value in store:
        return value
    return None


@dataclass
class _JobState:
    """A parsed job of this round."""

    key: str
    body: Mapping[str, Any]
    job: ElasticTrainingJob
    status: JobStatus

    @property
    def name(self) -> str:
        return self.job.metadata.name

    @property
    def namespace(self) -> str:
        return self.job.metadata.namespace or "default"


@dataclass
class Controller:
    adapter: Adapter
    metrics: Metrics
    config: Config = field(default_factory=Config)
    # kopf indexes (live mappings of key -> store of values), set by the startup handler
    nodes: Mapping[str, Iterable[Node]] = field(default_factory=dict)
    pods: Mapping[str, Iterable[Pod]] = field(default_factory=dict)
    jobs: Mapping[str, Iterable[Mapping[str, Any]]] = field(default_factory=dict)
    _written: dict[str, int] = field(default_factory=dict)  # job key -> target generation set
    # job key -> (uid, status.restarts set): views from before a restart are stale
    _restarted: dict[str, tuple[str, int]] = field(default_factory=dict)
    _missed: dict[str, float] = field(default_factory=dict)  # job key -> leader's pod first missed
    _started: dict[str, str] = field(default_factory=dict)  # job key -> uid given a first target
    _services: set[str] = field(default_factory=set)  # uids whose Service exists
    _arrivals: dict[str, float] = field(default_factory=dict)  # non-elastic GPU pod -> created
    _parsed: dict[tuple[str, str], ElasticTrainingJob | str] = field(default_factory=dict)
    last_round: float = 0.0

    # ---- one round -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Rounds every ``interval_s`` until ``stop``; an error in one round never ends it."""
        backoff = self.config.interval_s
        while not stop.is_set():
            try:
                await self.round(time.time())
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
        states = self._states()
        snapshot = self.snapshot(states, now)
        decisions = decide(snapshot, now)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        self._observe_cluster(snapshot, now)
        for state in states.values():
            try:
                await self.reconcile(state, now)
            except ApiUnavailable as err:
                log.warning("%s: %s (retrying next round)", state.key, err)
        by_key = {s.key: s for s in states.values()}
        for decision in decisions:
            try:
                await self.apply(by_key[decision.job], decision, now)
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
                problem = contradiction(job)
                self._parsed[version] = problem or job
            except JobSpecError as err:
                self._parsed[version] = str(err)
        return self._parsed[version]

    def _states(self) -> dict[str, _JobState]:
        states = {}
        for key, store in self.jobs.items():
            body = _one(store)
            if body is None:
                continue
            parsed = self._parse(key, body)
            if isinstance(parsed, str):
                continue  # invalid: the validation handler reports it
            states[key] = _JobState(key, body, parsed, parsed.status or JobStatus())
        return states

    def snapshot(self, states: Mapping[str, _JobState], now: float) -> Snapshot:
        nodes = tuple(n for store in self.nodes.values() if (n := _one(store)) is not None)
        pods = tuple(p for store in self.pods.values() if (p := _one(store)) is not None)
        for pod in pods:
            if pod.job is None and pod.gpus > 0:
                self._arrivals.setdefault(pod.key, pod.created)
        window = max((s.job.spec.scaling.arrival_window_seconds for s in states.values()),
                     default=8 * 3600.0)
        for key, created in list(self._arrivals.items()):
            if created < now - window:
                del self._arrivals[key]
        jobs = tuple(self._elastic_job(s) for s in states.values())
        return Snapshot(nodes=nodes, pods=pods, jobs=jobs,
                        arrivals=tuple(sorted(self._arrivals.values())), window_seconds=window)

    def _elastic_job(self, state: _JobState) -> ElasticJob:
        spec, status = state.job.spec, state.status
        target = status.target
        applied = bool(status.members) and target is not None and status.generation == target.generation
        written = self._written.get(state.key)
        busy = (not applied or (written is not None and (target is None or target.generation < written))
                or self._before_restart(state)
                or status.phase in ("Succeeded", "Failed")
                or status.step >= spec.training.steps - NO_SWITCH_STEPS)
        return ElasticJob(
            key=state.key,
            min_workers=spec.workers.min,
            max_workers=spec.workers.max,
            max_scale_factor=spec.max_scale_factor,
            gpus_per_worker=spec.gpus_per_worker,
            workers=len(status.members),
            members=tuple(f"{state.namespace}/{m}" for m in status.members),
            busy=busy,
            releasing=tuple(f"{state.namespace}/{n}" for n in target.release) if target else (),
            scale_table=status.scale_table,
            probability_threshold=spec.scaling.probability_threshold,
            min_gain=spec.scaling.min_gain,
            arrival_window_seconds=spec.scaling.arrival_window_seconds,
            cooldown_seconds=spec.scaling.cooldown_seconds,
            last_scale_time=parse_time(status.last_scale_time),
            switch_seconds=(status.last_switch_seconds if status.last_switch_seconds is not None
                            else spec.scaling.switch_overhead_seconds),
            enabled=spec.scaling.enabled,
            placement=Placement.of(spec.template.node_selector, spec.template.tolerations),
        )

    def _job_pods(self, state: _JobState) -> dict[str, Pod]:
        """The job's pods by name."""
        prefix = f"{state.namespace}/"
        out = {}
        for store in self.pods.values():
            pod = _one(store)
            if pod is not None and pod.job == state.key:
                out[pod.key.removeprefix(prefix)] = pod
        return out

    def _observe_cluster(self, snapshot: Snapshot, now: float) -> None:
        m = self.metrics
        total = sum(n.gpus for n in snapshot.nodes)
        held = sum(p.gpus for p in snapshot.pods if p.node and p.phase not in FINISHED)
        pending = [p for p in snapshot.pods if p.job is None and p.gpus and p.node is None
                   and p.phase not in FINISHED]
        m.gpus.set(total)
        m.idle_gpus.set(max(total - held, 0))
        m.pending_pods.set(len(pending))
        m.pending_gpu_demand.set(sum(p.gpus for p in pending))
        recent = [t for t in snapshot.arrivals if t >= now - snapshot.window_seconds]
        m.arrival_rate.set(len(recent) / snapshot.window_seconds * 3600.0)

    # ---- validation (called by the handlers on create, update and resume) -------------------

    async def validate(self, body: Mapping[str, Any], now: float) -> str | None:
        """Report an invalid spec as condition Valid=False and a Warning Event; None if valid."""
        meta = body["metadata"]
        key = f"{meta.get('namespace', 'default')}/{meta['name']}"
        parsed = self._parse(key, body)
        status = body.get("status") or {}
        conditions = status.get("conditions") or []
        if isinstance(parsed, str):
            problem = parsed.removeprefix(f"{key}: ")
            old = next((c for c in conditions if c.get("type") == VALID), None)
            if old and old.get("status") == "False" and old.get("message") == problem:
                return problem  # already reported
            await self.adapter.patch_status(meta["name"], meta.get("namespace", "default"), {
                "phase": "Invalid",
                "conditions": _set_condition(conditions, VALID, "False", "InvalidSpec", problem,
                                             now, meta.get("generation", 0)),
            })
            await self.adapter.event(dict(body), reason="InvalidSpec", message=problem,
                                     warning=True, now=now)
            self.metrics.decisions.labels(kind="invalid").inc()
            return problem
        old = next((c for c in conditions if c.get("type") == VALID), None)
        if not old or old.get("status") != "True":
            patch: dict[str, Any] = {"conditions": _set_condition(
                conditions, VALID, "True", "SpecAccepted", "the spec can be run", now,
                meta.get("generation", 0))}
            if status.get("phase") == "Invalid":
                patch["phase"] = "Pending"
            await self.adapter.patch_status(meta["name"], meta.get("namespace", "default"), patch)
        return None

    # ---- per-job reconciliation -------------------------------------------------------------

    async def reconcile(self, state: _JobState, now: float) -> None:
        job, status = state.job, state.status
        uid = state.body["metadata"].get("uid", "")
        if uid not in self._services:
            await self.adapter.create(builders.headless_service(job, uid=uid))
            self._services.add(uid)
        if self._before_restart(state):
            return
        pods = self._job_pods(state)
        if status.target is None:
            if self._started.get(state.key) == uid:
                return  # the first target this loop wrote is not in this view yet
            if not pods:
                await self._initial_target(state, uid, now)
            for name, pod in pods.items():  # a restart's (or a job's of the same name before):
                if not pod.deleting:  # they go first, since the new pods take their names
                    await self.adapter.delete_pod(name, state.namespace)
            return
        target = status.target
        if (lost := self._leader_lost(state, pods, now)) is not None:
            why, failure = lost
            if not failure or status.failures < job.spec.max_restarts:
                await self._restart(state, why, failure, now)
            elif status.phase != "Failed":
                await self._fail(state, pods, why, now)
            return
        for name in status.lost:
            pod = pods.get(name)
            if pod is not None and pod.phase not in FINISHED and not pod.deleting:
                log.info("%s: deleting %s, lost to a fault", state.key, name)
                await self.adapter.delete_pod(name, state.namespace)
        applied = bool(status.members) and status.generation == target.generation
        written = self._written.get(state.key)
        if (not applied and status.members and _overtaken(status)
                and (written is None or written <= target.generation)):  # (not a stale view)
            await self._supersede(state, now)
            return
        if not applied and target.join:
            for name in target.join:
                if name not in pods:
                    await self.adapter.create(builders.worker_pod(
                        job, uid=uid, index=builders.worker_index(name),
                        generation=target.generation))
        for name in target.release:
            pod = pods.get(name)
            if pod is None:
                continue
            deadline = parse_time(target.deadline)
            if pod.phase in FINISHED or applied:
                await self.adapter.delete_pod(name, state.namespace)
            elif deadline is not None and now > deadline:
                await self.adapter.delete_pod(name, state.namespace)
                self.metrics.decisions.labels(kind="drain_deadline").inc()
                await self.adapter.event(
                    dict(state.body), reason="DrainDeadline", warning=True, now=now,
                    message=f"{name} did not leave within "
                            f"{job.spec.scaling.drain_timeout_seconds:.0f}s of the scale-down "
                            f"to {target.workers} workers; deleted it anyway")
        await self._report(state, pods, applied, now)

    def forget(self, namespace: str, name: str) -> None:
        """A deleted job: its gauges, and what this loop kept of it (a job created again under
        its name starts afresh)."""
        key = f"{namespace}/{name}"
        for kept in (self._written, self._restarted, self._missed, self._started):
            kept.pop(key, None)
        self.metrics.forget_job(namespace, name)

    def _before_restart(self, state: _JobState) -> bool:
        """A view of the job from before this operator restarted it."""
        uid, restarts = self._restarted.get(state.key, ("", 0))
        return uid == state.body["metadata"].get("uid") and restarts > state.status.restarts

    def _leader_lost(self, state: _JobState, pods: Mapping[str, Pod],
                     now: float) -> tuple[str, bool] | None:
        """Why the job cannot go on, if it cannot, and whether that is a failure: its
        leader's pod failed (also before it published a generation: say, its agent refused
        the spec), or every member's pod failed. Not failures: a leader that stopped when
        asked (SIGTERM's exit status: it halted the job at a checkpoint), or whose pod has
        been gone for ``LEADER_GONE_S`` once the job ran (deleted, preempted, drained)."""
        job, status = state.job, state.status
        done = status.phase in FINISHED or status.step >= job.spec.training.steps
        leader = builders.worker_name(state.name, 0)
        pod = pods.get(leader)
        if done or pod is not None or not status.members:
            self._missed.pop(state.key, None)
        if done:
            return None
        if pod is None:  # gone once the job ran; before, not started or not indexed yet
            if not status.members:
                return None
            missed = self._missed.setdefault(state.key, now)
            return (f"the leader {leader} is gone", False) if now - missed >= LEADER_GONE_S \
                else None
        if pod.phase == "Failed" and pod.exit_code == keys.STOPPED_EXIT_CODE:
            return f"the leader {leader} stopped when asked", False
        if pod.phase == "Failed":
            said = ", ".join(filter(None, (
                f"exit code {pod.exit_code}" if pod.exit_code is not None else "",
                pod.last_words)))  # what its logs ended with, if the kubelet kept it
            return f"the leader {leader} failed" + (f" ({said})" if said else ""), True
        members = [pods.get(m) for m in status.members]
        if members and all(p is not None and p.phase == "Failed" for p in members):
            return "every worker failed", True
        return None

    async def _restart(self, state: _JobState, why: str, failure: bool, now: float) -> None:
        """Start the job again: with no target, its pods go and then the first ones come back
        (``reconcile``), from the newest checkpoint. The agent's membership is emptied too: no
        agent runs to publish its own."""
        job, status = state.job, state.status
        restarts, failures = status.restarts + 1, status.failures + int(failure)
        origin = ("the newest checkpoint under spec.checkpoint.path" if job.spec.checkpoint.path
                  else "step 0 (spec.checkpoint.path is unset)")
        line = (f"{why} at step {status.step}: restart {restarts}"
                + (f", failure {failures} of {job.spec.max_restarts}" if failure else "")
                + f", from {origin}")
        log.warning("%s: %s", state.key, line)
        conditions = [c.model_dump(by_alias=True) for c in status.conditions]
        generation = state.body["metadata"].get("generation", 0)
        await self.adapter.patch_status(state.name, state.namespace, {
            "phase": "Restarting", "restarts": restarts, "failures": failures, "target": None,
            "members": [], "lost": [], "workers": 0, "lastDecision": line,
            "conditions": _set_condition(conditions, READY, "False", "Restarting", line, now,
                                         generation)})
        self._restarted[state.key] = (state.body["metadata"].get("uid", ""), restarts)
        for kept in (self._written, self._missed, self._started):
            kept.pop(state.key, None)
        self.metrics.decided(state.namespace, state.name, "restart")
        await self.adapter.event(dict(state.body), reason="Restarted", warning=True, now=now,
                                 message=line)

    async def _fail(self, state: _JobState, pods: Mapping[str, Pod], why: str,
                    now: float) -> None:
        """The job cannot go on and has no restart left: the pods that still run go (they
        hold GPUs for nothing), the failed ones stay for their logs."""
        line = (f"{why} at step {state.status.step}, after {state.status.failures} failures "
                f"(spec.maxRestarts): the job fails")
        log.error("%s: %s", state.key, line)
        await self.adapter.patch_status(state.name, state.namespace, {
            "phase": "Failed", "lastDecision": line})
        for name, pod in pods.items():
            if pod.phase not in FINISHED:
                await self.adapter.delete_pod(name, state.namespace)
        await self.adapter.event(dict(state.body), reason="Failed", warning=True, now=now,
                                 message=line)

    async def _supersede(self, state: _JobState, now: float) -> None:
        """Replace a target a fault has overtaken (the agent refuses it: its count no longer
        adds up) by the next generation on the members the fault left: a scale-up's joiners
        still join (their pods are there); a scale-down's releases are dropped, since the
        fault freed GPUs too, and the next round decides afresh."""
        status = state.status
        old = status.target
        join = [p for p in old.join if p not in status.members]
        target = {**old.model_dump(by_alias=True, mode="json"),
                  "workers": len(status.members) + len(join), "generation": old.generation + 1,
                  "join": join, "release": [], "deadline": None, "issuedAt": rfc3339(now)}
        line = (f"generation {old.generation} asked for {old.workers} workers, but a fault left "
                f"{', '.join(status.members)}: generation {target['generation']} asks for "
                f"{target['workers']}")
        await self.adapter.patch_status(state.name, state.namespace, {
            "target": target, "lastDecision": line})
        self._written[state.key] = target["generation"]
        await self.adapter.event(dict(state.body), reason="TargetSuperseded", warning=True,
                                 now=now, message=line)

    async def _initial_target(self, state: _JobState, uid: str, now: float) -> None:
        job = state.job
        join = tuple(builders.worker_name(state.name, i) for i in range(job.spec.workers.min))
        target = {"workers": len(join), "generation": 0, "reason": "Initial",
                  "join": list(join), "release": [], "issuedAt": rfc3339(now)}
        await self.adapter.patch_status(state.name, state.namespace, {
            "phase": "Pending", "target": target, "observedGeneration":
                state.body["metadata"].get("generation", 0)})
        self._started[state.key] = uid
        for i in range(len(join)):
            await self.adapter.create(builders.worker_pod(job, uid=uid, index=i, generation=0))
        await self.adapter.event(dict(state.body), reason="Created", now=now,
                                 message=f"created {len(join)} worker pods: {', '.join(join)}")

    async def _report(self, state: _JobState, pods: Mapping[str, Pod], applied: bool,
                      now: float) -> None:
        """Phase, conditions and the job's gauges, from what the agent published."""
        job, status = state.job, state.status
        target = status.target
        members = [pods.get(m) for m in status.members]
        if status.step >= job.spec.training.steps:
            phase = "Succeeded"  # even with a target left unapplied: the agent takes none at the end
        elif status.phase == "Failed":
            phase = "Failed"  # no restart left (_fail); the agent goes on without any other
            # member it loses
        elif not applied:
            phase = "Pending" if not status.members else "Scaling"
        else:
            phase = "Running"
        running = applied and all(p is not None and p.phase == "Running" for p in members)
        conditions = [c.model_dump(by_alias=True) for c in status.conditions]
        generation = state.body["metadata"].get("generation", 0)
        new = _set_condition(conditions, READY, "True" if running else "False",
                             "WorkersRunning" if running else "WorkersStarting",
                             f"{len(status.members)} workers in generation {status.generation}"
                             if running else "waiting for the workers of the target", now, generation)
        if applied and target is not None:
            new = _set_condition(new, SCALING, "False", "TargetApplied",
                                 f"generation {target.generation} runs with {target.workers} workers",
                                 now, generation)
        patch: dict[str, Any] = {}
        if phase != status.phase:
            patch["phase"] = phase
        if len(status.members) != status.workers:
            patch["workers"] = len(status.members)
        if new != conditions:
            patch["conditions"] = new
        if patch:
            await self.adapter.patch_status(state.name, state.namespace, patch)
        self.metrics.observe_job(state.namespace, state.name, workers=len(status.members),
                                 target_workers=target.workers if target else 0,
                                 generation=status.generation)

    # ---- decisions --------------------------------------------------------------------------

    async def apply(self, state: _JobState, decision: Decision, now: float) -> None:
        job, status = state.job, state.status
        generation = (status.target.generation if status.target else 0) + 1
        up = decision.kind == "scale_up"
        uid = state.body["metadata"].get("uid", "")
        target: dict[str, Any] = {
            "workers": decision.to_workers, "generation": generation, "reason": decision.reason,
            "issuedAt": rfc3339(now), "join": [], "release": [], "deadline": None,
        }
        if up:
            taken = [builders.worker_index(n)
                     for n in (*self._job_pods(state), *status.members, *status.lost)]
            first = max(taken, default=-1) + 1
            count = decision.to_workers - decision.from_workers
            target["join"] = [builders.worker_name(state.name, first + i) for i in range(count)]
        else:
            target["release"] = [k.split("/", 1)[1] for k in decision.release]
            target["deadline"] = rfc3339(now + job.spec.scaling.drain_timeout_seconds)
        conditions = [c.model_dump(by_alias=True) for c in status.conditions]
        line = f"{decision.from_workers} -> {decision.to_workers} workers: {decision.message}"
        await self.adapter.patch_status(state.name, state.namespace, {
            "target": target,
            "phase": "Scaling",
            "lastScaleTime": rfc3339(now),
            "lastDecision": line,
            "conditions": _set_condition(conditions, SCALING, "True", decision.reason, line, now,
                                         state.body["metadata"].get("generation", 0)),
        })
        self._written[state.key] = generation
        for name in target["join"]:
            await self.adapter.create(builders.worker_pod(
                job, uid=uid, index=builders.worker_index(name), generation=generation))
        self.metrics.decided(state.namespace, state.name, decision.kind)
        await self.adapter.event(dict(state.body), reason="ScaleUp" if up else "ScaleDown",
                                 message=f"{decision.reason}: {line}", now=now)


def _overtaken(status: JobStatus) -> bool:
    """Whether a fault has changed the members under the outstanding target: applied to them,
    it would not give its worker count (the agent refuses it)."""
    target = status.target
    joiners = sum(p not in status.members for p in target.join)
    leavers = sum(p in status.members for p in target.release)
    return len(status.members) + joiners - leavers != target.workers


def contradiction(job: ElasticTrainingJob) -> str | None:
    """What makes a schema-valid spec impossible to run, in one line; None if nothing does."""
    spec = job.spec
    units = spec.model.num_units
    if spec.gpus_per_worker != 1:
        return (f"gpusPerWorker is {spec.gpus_per_worker}: the agent runs one rank per pod; "
                "use gpusPerWorker: 1")
    if spec.workers.min > units:
        return (f"workers.min ({spec.workers.min}) exceeds the model's {units} placement units "
                "(embedding, blocks, head): every pipeline stage needs at least one")
    return None


def _set_condition(conditions: list[dict[str, Any]], kind: str, status: str, reason: str,
                   message: str, now: float, generation: int) -> list[dict[str, Any]]:
    """``conditions`` with ``kind`` set; the transition time moves only when status does."""
    out, found = [], False
    for c in conditions:
        if c.get("type") != kind:
            out.append(c)
            continue
        found = True
        same = c.get("status") == status
        out.append({
            "type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": c.get("lastTransitionTime") if same else rfc3339(now),
            "observedGeneration": generation,
        })
    if not found:
        out.append({"type": kind, "status": status, "reason": reason, "message": message,
                    "lastTransitionTime": rfc3339(now), "observedGeneration": generation})
    return out
