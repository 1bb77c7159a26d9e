"""One job's life between the policy's decisions: its pods, its target, its restarts, its phase.

Per job and round (``Lifecycle.reconcile``):
  - no target yet: set generation 0's target (the first ``workers.min`` pods) and create them,
    with the job's rendezvous pod;
  - a scale-up target outstanding: make sure each joiner's pod exists;
  - a scale-down target: delete released pods once they have exited, or anyway past the
    deadline (with a Warning Event);
  - a target that a fault has overtaken (the survivors plus its joiners, less its releases,
    are not its count): supersede it with the same change on the survivors;
  - pods the agent declared lost (``status.lost``) that still run are deleted; their names
    are never given again. Replacing them, up to ``workers.min``, is ``decide``'s;
  - the rendezvous pod failed or gone, the leader stopped when asked (it halted the job at a
    checkpoint), the first leader failed before the job's first generation, or every member
    failed: the job cannot go on, so it restarts: every pod is deleted, the target and the
    agent's membership emptied, and once the pods are gone the first pods start again, from
    the newest checkpoint (the agent's generation 0 loads it). A leader lost while the job
    runs is lost like any member: the agent goes on without it. A leader that stopped when
    asked, or a rendezvous pod that is gone, is no failure; after ``spec.maxRestarts``
    failures the next one fails the job;
  - phase, conditions and the job's metrics follow the status the agent publishes.

Every write is idempotent and every timer lives in the status (the drain deadline in the
target, the rendezvous pod's absence in ``rendezvousMissingSince``), so a restarted operator
carries on
where the last one stopped. Status is written through the contract's types (``status_patch``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from tidal_api import Condition, JobStatus, Target, keys
from tidal_api.status import READY, SCALING, set_condition, status_patch
from tidal_operator import builders
from tidal_operator.adapter import Adapter, rfc3339
from tidal_operator.metrics import Metrics
from tidal_operator.snapshot import FINISHED_PHASES, Pod, parse_time
from tidal_operator.policy import STARTED, Decision
from tidal_operator.view import JobView, Written

log = logging.getLogger(__name__)

# A rendezvous pod missing from the index this long is gone, not a watch still filling it in.
RENDEZVOUS_GONE_S = 10.0


def condition(kind: str, status: str, reason: str, message: str, now: float,
              generation: int) -> Condition:
    """A condition set at ``now``: ``set_condition`` keeps the old transition time where the
    status is the same."""
    return Condition(type=kind, status=status, reason=reason, message=message,
                     last_transition_time=rfc3339(now), observed_generation=generation)


@dataclass(slots=True)
class Lifecycle:
    """The per-job part of a round; ``written`` is shared with the Controller, which writes
    the targets of decisions."""

    adapter: Adapter
    metrics: Metrics
    written: Written
    worker: builders.WorkerSettings = builders.WorkerSettings()

    async def reconcile(self, view: JobView, pods: Mapping[str, Pod], now: float,
                        start: Decision | None = None) -> None:
        """One round of one job; ``pods`` are its pods by name; ``start``, for a job with no
        target yet, is the policy's count of its first workers."""
        job, status = view.job, view.status
        if view.uid not in self.written.services:
            await self.adapter.create(builders.headless_service(job, uid=view.uid))
            self.written.services.add(view.uid)
        if self.written.stale(view):
            return
        if status.target is None:
            if self.written.started.get(view.key) == view.uid:
                return  # the first target this loop wrote is not in this view yet
            if not pods:
                await self._initial_target(view, now, start)
            for name, pod in pods.items():  # a restart's (or a job's of the same name before):
                if not pod.deleting:  # they go first, since the new pods take their names
                    await self.adapter.delete_pod(name, view.namespace)
            return
        target = status.target
        if (lost := await self._cannot_go_on(view, pods, now)) is not None:
            why, failure = lost
            if not failure or status.failures < job.spec.max_restarts:
                await self._restart(view, why, failure, now)
            elif status.phase != "Failed":
                await self._fail(view, pods, why, now)
            return
        for name in status.lost:
            pod = pods.get(name)
            if pod is not None and not pod.finished and not pod.deleting:
                log.info("%s: deleting %s, lost to a fault", view.key, name)
                await self.adapter.delete_pod(name, view.namespace)
        applied = bool(status.members) and status.generation == target.generation
        written = self.written.targets.get(view.key)
        if (not applied and status.members and _overtaken(status)
                and (written is None or written <= target.generation)):  # (not a stale view)
            await self._supersede(view, now)
            return
        if not applied and target.join:
            for name in target.join:
                if name not in pods:
                    await self.create_worker(view, target, name)
        await self._release(view, pods, applied, now)
        await self._report(view, pods, applied, now)

    async def create_worker(self, view: JobView, target: Target, name: str) -> None:
        """The pod of joiner ``name`` of ``target``: one of the job's minimum that its Kueue
        queue admits, where :func:`~tidal_operator.builders.queued_joiner` says so."""
        job = view.job
        group = (builders.pod_group(view.name, view.uid, view.status.restarts)
                 if builders.queued_joiner(job, target, name) else None)
        await self.adapter.create(builders.worker_pod(
            job, uid=view.uid, index=builders.worker_index(name), generation=target.generation,
            settings=self.worker, group=group))

    async def _release(self, view: JobView, pods: Mapping[str, Pod], applied: bool,
                       now: float) -> None:
        """Delete the target's released pods once they have left, or anyway past its
        deadline."""
        target = view.status.target
        deadline = parse_time(target.deadline)
        for name in target.release:
            pod = pods.get(name)
            if pod is None:
                continue
            if pod.finished or applied:
                await self.adapter.delete_pod(name, view.namespace)
            elif deadline is not None and now > deadline:
                await self.adapter.delete_pod(name, view.namespace)
                self.metrics.decisions.labels(kind="drain_deadline").inc()
                await self.adapter.event(
                    dict(view.body), reason="DrainDeadline", warning=True, now=now,
                    message=f"{name} did not leave within "
                            f"{view.job.spec.scaling.drain_timeout_seconds:.0f}s of the "
                            f"scale-down to {target.workers} workers; deleted it anyway")

    async def _cannot_go_on(self, view: JobView, pods: Mapping[str, Pod],
                            now: float) -> tuple[str, bool] | None:
        """Why the job cannot go on, if it cannot, and whether that is a failure: its
        rendezvous pod failed, the first leader's pod failed before the job's first
        generation (say, its agent refused the spec), or every member's pod failed. Not
        failures: a leader that stopped when asked (SIGTERM's exit status: it halted the job
        at a checkpoint), or a rendezvous pod gone for ``RENDEZVOUS_GONE_S`` once the job ran
        (deleted, preempted, drained); since when is ``status.rendezvousMissingSince``, so
        that a restarted operator keeps counting. A leader lost once the job runs is any
        member lost: the agent goes on without it."""
        job, status = view.job, view.status
        done = status.phase in FINISHED_PHASES or status.step >= job.spec.training.steps
        rendezvous = builders.rendezvous_name(view.name)
        host = pods.get(rendezvous)
        # gone once the job ran; before, not started or not indexed yet
        missing = not done and host is None and bool(status.members)
        since = await self._rendezvous_missing(view, missing, now)
        if done:
            return None
        leader = status.members[0] if status.members else builders.worker_name(view.name, 0)
        pod = pods.get(leader)
        if pod is not None and pod.phase == "Failed" and pod.exit_code == keys.STOPPED_EXIT_CODE:
            return f"the leader {leader} stopped when asked", False
        if missing:
            gone = now - parse_time(since) >= RENDEZVOUS_GONE_S
            return (f"the rendezvous {rendezvous} is gone", False) if gone else None
        if host is not None and host.phase == "Failed":
            return f"the rendezvous {rendezvous} failed{_said(host)}", True
        if pod is not None and pod.phase == "Failed" and not status.members:
            return f"the leader {leader} failed{_said(pod)}", True
        members = [pods.get(m) for m in status.members]
        if members and all(p is not None and p.phase == "Failed" for p in members):
            return "every worker failed", True
        return None

    async def _rendezvous_missing(self, view: JobView, missing: bool,
                                  now: float) -> str | None:
        """``status.rendezvousMissingSince``, as this operator last wrote it if the watch has
        not delivered that yet: set when the rendezvous pod goes missing, cleared when it is
        back (or the job no longer needs it)."""
        since = self.written.rendezvous_missing.get(view.key,
                                                    view.status.rendezvous_missing_since)
        if missing != (since is not None):
            since = rfc3339(now) if missing else None
            await self.adapter.patch_status(view.name, view.namespace,
                                            status_patch(rendezvous_missing_since=since))
            self.written.rendezvous_missing[view.key] = since
        return since

    async def _restart(self, view: JobView, why: str, failure: bool, now: float) -> None:
        """Start the job again: with no target, its pods go and then the first ones come back
        (``reconcile``), from the newest checkpoint. The agent's membership is emptied too: no
        agent runs to publish its own."""
        job, status = view.job, view.status
        restarts, failures = status.restarts + 1, status.failures + int(failure)
        origin = ("the newest checkpoint under spec.checkpoint.path" if job.spec.checkpoint.path
                  else "step 0 (spec.checkpoint.path is unset)")
        line = (f"{why} at step {status.step}: restart {restarts}"
                + (f", failure {failures} of {job.spec.max_restarts}" if failure else "")
                + f", from {origin}")
        log.warning("%s: %s", view.key, line)
        await self.adapter.patch_status(view.name, view.namespace, status_patch(
            phase="Restarting", restarts=restarts, failures=failures, target=None, members=(),
            lost=(), workers=0, last_decision=line, rendezvous_missing_since=None,
            conditions=set_condition(status.conditions, condition(
                READY, "False", "Restarting", line, now, view.generation))))
        self.written.restarted(view, restarts)
        self.metrics.decided(view.namespace, view.name, "restart")
        await self.adapter.event(dict(view.body), reason="Restarted", warning=True, now=now,
                                 message=line)

    async def _fail(self, view: JobView, pods: Mapping[str, Pod], why: str,
                    now: float) -> None:
        """The job cannot go on and has no restart left: the pods that still run go (they
        hold GPUs for nothing), the failed ones stay for their logs."""
        line = (f"{why} at step {view.status.step}, after {view.status.failures} failures "
                f"(spec.maxRestarts): the job fails")
        log.error("%s: %s", view.key, line)
        await self.adapter.patch_status(view.name, view.namespace,
                                        status_patch(phase="Failed", last_decision=line))
        for name, pod in pods.items():
            if not pod.finished:
                await self.adapter.delete_pod(name, view.namespace)
        await self.adapter.event(dict(view.body), reason="Failed", warning=True, now=now,
                                 message=line)

    async def _supersede(self, view: JobView, now: float) -> None:
        """Replace a target a fault has overtaken (the agent refuses it: its count no longer
        adds up) by the next generation on the members the fault left: a scale-up's joiners
        still join (their pods are there); a scale-down's releases are dropped, since the
        fault freed GPUs too, and the next round decides afresh."""
        status = view.status
        old = status.target
        join = tuple(p for p in old.join if p not in status.members)
        target = old.model_copy(update={
            "workers": len(status.members) + len(join), "generation": old.generation + 1,
            "join": join, "release": (), "deadline": None, "issued_at": rfc3339(now)})
        line = (f"generation {old.generation} asked for {old.workers} workers, but a fault left "
                f"{', '.join(status.members)}: generation {target.generation} asks for "
                f"{target.workers}")
        await self.adapter.patch_status(view.name, view.namespace,
                                        status_patch(target=target, last_decision=line))
        self.written.targets[view.key] = target.generation
        await self.adapter.event(dict(view.body), reason="TargetSuperseded", warning=True,
                                 now=now, message=line)

    async def _initial_target(self, view: JobView, now: float, start: Decision | None) -> None:
        """The first target: the policy's count (up to ``workers.preferred`` where it finds
        the GPUs free, never below ``workers.min``), else the count the job asks for."""
        job = view.job
        count = start.to_workers if start is not None else job.spec.workers.start
        join = tuple(builders.worker_name(view.name, i) for i in range(count))
        target = Target(workers=len(join), generation=0, reason=STARTED, join=join,
                        issued_at=rfc3339(now))
        await self.adapter.patch_status(view.name, view.namespace, status_patch(
            phase="Pending", target=target, observed_generation=view.generation))
        self.written.started[view.key] = view.uid
        await self.adapter.create(builders.rendezvous_pod(job, uid=view.uid))
        for name in join:
            await self.create_worker(view, target, name)
        why = f" ({start.message})" if start is not None else ""
        await self.adapter.event(dict(view.body), reason="Created", now=now,
                                 message=f"created {len(join)} worker pods: {', '.join(join)}"
                                         + why)

    async def _report(self, view: JobView, pods: Mapping[str, Pod], applied: bool,
                      now: float) -> None:
        """Phase, conditions and the job's gauges, from what the agent published."""
        job, status = view.job, view.status
        target = status.target
        members = [pods.get(m) for m in status.members]
        if status.step >= job.spec.training.steps:
            phase = "Succeeded"  # even with a target left unapplied: the agent takes none at
            # the end
        elif status.phase == "Failed":
            phase = "Failed"  # no restart left (_fail); the agent goes on without any other
            # member it loses
        elif not applied:
            phase = "Pending" if not status.members else "Scaling"
        else:
            phase = "Running"
        running = applied and all(p is not None and p.phase == "Running" for p in members)
        new = set_condition(status.conditions, condition(
            READY, "True" if running else "False",
            "WorkersRunning" if running else "WorkersStarting",
            f"{len(status.members)} workers in generation {status.generation}"
            if running else "waiting for the workers of the target", now, view.generation))
        if applied and target is not None:
            new = set_condition(new, condition(
                SCALING, "False", "TargetApplied",
                f"generation {target.generation} runs with {target.workers} workers", now,
                view.generation))
        patch = {}
        if phase != status.phase:
            patch["phase"] = phase
        if len(status.members) != status.workers:
            patch["workers"] = len(status.members)
        if new != status.conditions:
            patch["conditions"] = new
        if patch:
            await self.adapter.patch_status(view.name, view.namespace, status_patch(**patch))
        self.metrics.observe_job(view.namespace, view.name, workers=len(status.members),
                                 target_workers=target.workers if target else 0,
                                 generation=status.generation)


def _overtaken(status: JobStatus) -> bool:
    """Whether a fault has changed the members under the outstanding target: applied to them,
    it would not give its worker count (the agent refuses it)."""
    target = status.target
    joiners = sum(p not in status.members for p in target.join)
    leavers = sum(p in status.members for p in target.release)
    return len(status.members) + joiners - leavers != target.workers


def _said(pod: Pod) -> str:
    """A failed pod's exit code and the last line of its logs, if the kubelet kept them."""
    said = ", ".join(filter(None, (
        f"exit code {pod.exit_code}" if pod.exit_code is not None else "", pod.last_words)))
    return f" ({said})" if said else ""
