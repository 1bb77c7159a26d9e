"""The agent's side of the operator protocol (DESIGN.md section 3, tidal_api.status).

Three parts, one per concern:

- ``ControlLink`` talks to the Kubernetes API about one ElasticTrainingJob: it reads the spec,
  follows ``status.target`` with a watch (reconnecting with backoff) and publishes the leader's
  fields as rate-limited JSON merge patches of the status subresource, from threads of its own,
  so an API error or a slow API server never stops training.
- ``ControlledGenerations`` is the worker's generation source when membership comes from the
  operator. Pods agree through the job's rendezvous store (a TCPStore on the leader,
  ``<job>-worker-0``): every pod registers; generation 0 is the pods that a generation-0 target
  joins (the operator writes one as it creates the job's first pods), or without one the leader
  and the first ``spec.workers.min - 1`` other pods to register; any other pod waits in standby
  until a target names it. At every step boundary the leader compares the target's generation
  with the applied one and writes ``ctl/<step>``: ``null`` or the next generation, which
  switches at the following step if it grows (its world is built while this step trains) and at
  once if it shrinks (the pods it releases leave a step sooner). Every member reads that key
  before the step, so all switch at the same boundary; a joiner reads ``gen/<pod>``. A scale-up
  is announced once every pod it joins has registered. When a member is lost (the operator
  deleted it at a drain deadline, or its node went), the survivors agree through the store on a
  generation without it, which resumes from the peer snapshots of the step in flight or from the
  job's last complete checkpoint (``recover``).
- ``AgentReport`` turns the worker's events into status fields and Prometheus metrics
  (tidal_agent.metrics) on the leader and keeps the JSON report of a run (per-step losses,
  switches, the parameter digest).

``run_agent`` is ``tidal agent``: one pod's worker, its identity from the environment.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx2
import torch.distributed as dist
from lightkube import Client, ConfigError
from lightkube.config.kubeconfig import KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.generic_resource import create_namespaced_resource
from lightkube.types import PatchType
from pydantic import ValidationError

from tidal_agent import checkpoint
from tidal_agent.metrics import AgentMetrics, JobMetrics
from tidal_agent.snapshot import Cut, choose_cut
from tidal_api import GROUP, KIND, VERSION, AppliedLayout, ElasticTrainingJob, JobStatus, Target
from tidal_api import keys, parse_job
from tidal_plan.elastic import Generation, TargetError, data_parallel_degree, next_generation
from tidal_plan.layout import Layout, LayoutError

if TYPE_CHECKING:
    from tidal_agent.worker import Halt, Recovery

log = logging.getLogger("tidal.agent")

ElasticTrainingJobResource = create_namespaced_resource(
    GROUP, VERSION, KIND, "elastictrainingjobs"
)

# The leader's status fields (tidal_api.status): the only ones the agent ever writes.
AGENT_FIELDS = frozenset({
    "generation", "members", "lost", "layout", "step", "loss", "tokens_per_second", "step_seconds",
    "predicted_step_seconds", "last_switch_seconds", "scale_table",
})


class ControlError(RuntimeError):
    """The agent cannot run: its job, identity or settings are missing or unusable."""


class LeaderRecovering(RuntimeError):
    """The leader took the fault path: a member waiting at a step boundary takes it too."""


def kube_config(kubeconfig: str | None) -> KubeConfig:
    """A kubeconfig file, an API server URL (no auth: emulators, ``kubectl proxy``), or, with
    None, the pod's service account and then ``$KUBECONFIG``."""
    if kubeconfig is None:
        return KubeConfig.from_env()
    if kubeconfig.startswith(("http://", "https://")):
        return KubeConfig.from_one(cluster=Cluster(server=kubeconfig), user=User())
    return KubeConfig.from_file(kubeconfig)


# Errors of talking to the API server: logged and retried, never fatal to training.
_API_ERRORS = (httpx2.HTTPError, OSError)


class ControlLink:
    """One ElasticTrainingJob as its agent sees it: spec, target, and the leader's status.

    ``start`` launches the watch and the publisher threads; ``close`` flushes what is pending
    (bounded) and stops them. ``publish`` never blocks on the network.
    """

    def __init__(
        self,
        name: str,
        namespace: str,
        *,
        kubeconfig: str | None = None,
        publish_interval_s: float = 2.0,
        request_timeout_s: float = 10.0,
        watch_timeout_s: int = 300,
    ) -> None:
        self.name, self.namespace = name, namespace
        self.publish_interval_s = publish_interval_s
        self.watch_timeout_s = watch_timeout_s
        try:
            config = kube_config(kubeconfig)
        except ConfigError as err:
            raise ControlError(f"no Kubernetes API to talk to: {err}; pass --kubeconfig") from err
        # Separate clients: the watch holds its connection open for minutes.
        timeout = httpx2.Timeout(request_timeout_s)
        self._client = Client(config, namespace=namespace, timeout=timeout,
                              field_manager="tidal-agent")
        self._watch_client = Client(config, namespace=namespace, timeout=timeout)
        # lightkube reads a watch without a timeout: a half-open connection would hang it
        # for good, and close() could not stop it. The server ends a watch after
        # watch_timeout_s; the client gives up a little later.
        grace = min(10.0, watch_timeout_s)
        self._watch_client._client._watch_timeout.read = watch_timeout_s + grace
        self._target: Target | None = None
        self._bad_target: Any = None
        self._cond = threading.Condition()
        self._pending: dict[str, Any] = {}
        self._urgent = False
        self._closing = False
        self._stopped = threading.Event()
        self._last_patch = float("-inf")
        self._threads: list[threading.Thread] = []
        self.patches = 0  # status patches sent

    def job(self, *, retry_for_s: float = 60.0) -> ElasticTrainingJob:
        """The job as it is now, parsed; API errors are retried for ``retry_for_s``."""
        deadline, delay = time.monotonic() + retry_for_s, 0.5
        while True:
            try:
                obj = self._client.get(ElasticTrainingJobResource, self.name,
                                       namespace=self.namespace)
                break
            except _API_ERRORS as err:
                if time.monotonic() + delay > deadline:
                    raise ControlError(
                        f"cannot read ElasticTrainingJob {self.namespace}/{self.name}: {err}"
                    ) from err
                log.warning("reading the job failed (%s); retrying in %.1f s", err, delay)
                time.sleep(delay)
                delay = min(2 * delay, 10.0)
        raw = _plain(obj)
        self._take_target(raw)
        return parse_job(raw, f"ElasticTrainingJob {self.namespace}/{self.name}")

    def target(self) -> Target | None:
        """The operator's current ``status.target`` as last seen."""
        return self._target

    def start(self) -> None:
        """Follow the target and publish status from now on."""
        for run, name in ((self._watch, "watch"), (self._publisher, "publish")):
            thread = threading.Thread(target=run, name=f"tidal-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def publish(self, **fields: Any) -> None:
        """Queue agent-owned status fields (snake_case names of ``tidal_api.JobStatus``).

        They go out as one merge patch at most every ``publish_interval_s``, later values
        replacing earlier ones; a new ``generation`` goes out at once.
        """
        unknown = set(fields) - AGENT_FIELDS
        if unknown:
            raise ValueError(f"not agent-owned status fields: {sorted(unknown)}")
        status = JobStatus.model_validate(fields)
        wire = status.model_dump(mode="json", by_alias=True, include=set(fields))
        with self._cond:
            self._pending.update(wire)
            self._urgent |= "generation" in fields
            self._cond.notify()

    def close(self, flush_timeout_s: float = 10.0) -> None:
        """Send what is pending (waiting at most ``flush_timeout_s``) and stop."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        deadline = time.monotonic() + flush_timeout_s
        for thread in self._threads:
            if thread.name == "tidal-publish":
                thread.join(max(0.0, deadline - time.monotonic()))
        self._stopped.set()
        with self._cond:
            if self._pending:
                log.warning("status fields not published before exit: %s", sorted(self._pending))
        self._watch_client.close()
        self._client.close()

    def _take_target(self, raw: Mapping[str, Any]) -> None:
        target = (raw.get("status") or {}).get("target")
        if target is None:
            self._target = None
            return
        try:
            self._target = Target.model_validate(target)
        except ValidationError as err:
            if target != self._bad_target:  # once per bad value, not once per event
                log.error("ignoring status.target %s: %s", target, err)
                self._bad_target = target

    def _watch(self) -> None:
        delay = 0.5
        while not self._stopped.is_set():
            try:
                events = self._watch_client.watch(
                    ElasticTrainingJobResource, namespace=self.namespace,
                    fields={"metadata.name": self.name}, server_timeout=self.watch_timeout_s,
                )
                for kind, obj in events:
                    delay = 0.5
                    raw = _plain(obj)
                    if raw.get("metadata", {}).get("name") != self.name:
                        continue
                    if kind == "DELETED":
                        log.warning("the ElasticTrainingJob was deleted; training goes on")
                        continue
                    self._take_target(raw)
            except httpx2.ReadTimeout:
                continue  # a quiet job past the watch's timeout: watch again
            except _API_ERRORS as err:
                if self._stopped.is_set():
                    return
                log.warning("watching the job failed (%s); reconnecting in %.1f s", err, delay)
            except Exception:  # noqa: BLE001 - a bug here must not stop training either
                if self._stopped.is_set():
                    return
                log.exception("watching the job failed; reconnecting in %.1f s", delay)
            self._stopped.wait(delay)
            delay = min(2 * delay, 30.0)

    def _publisher(self) -> None:
        delay = 0.5
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                wait = self._last_patch + self.publish_interval_s - time.monotonic()
                if wait > 0 and not (self._urgent or self._closing):
                    self._cond.wait(wait)
                    continue
                patch, self._pending, self._urgent = self._pending, {}, False
            try:
                self._client.patch(
                    ElasticTrainingJobResource.Status, self.name, {"status": patch},
                    namespace=self.namespace, patch_type=PatchType.MERGE,
                )
                self._last_patch = time.monotonic()
                self.patches += 1
                delay = 0.5
            except _API_ERRORS as err:
                log.warning("publishing status failed (%s); retrying in %.1f s", err, delay)
                with self._cond:
                    self._pending = {**patch, **self._pending}
                    self._urgent |= "generation" in patch
                time.sleep(min(delay, 1.0) if self._closing else delay)
                delay = min(2 * delay, 30.0)


def _plain(obj: Any) -> dict[str, Any]:
    """A lightkube generic object as plain JSON-like data."""
    return json.loads(json.dumps(obj, default=lambda o: o.to_dict()))


# ---- membership through the rendezvous store --------------------------------------------------

Chooser = Callable[[int, int], tuple[Layout, float | None]]
"""Layout (and predicted step seconds) for a worker count, given generation 0's count."""


def _gen_json(gen: Generation, layout: Layout) -> dict[str, Any]:
    return {"index": gen.index, "at_step": gen.at_step, "members": list(gen.members),
            "layout": layout.to_dict()}


def _gen_from(data: Mapping[str, Any]) -> tuple[Generation, Layout]:
    gen = Generation(index=data["index"], at_step=data["at_step"],
                     members=tuple(data["members"]))
    return gen, Layout(**data["layout"])


class ControlledGenerations:
    """A ``GenerationSource`` driven by the operator's targets, agreed on through the store.

    The leader decides; everyone else reads. Keys (under the rendezvous prefix):
    ``reg/count`` and ``reg/<n>`` (pods in registration order), ``pod/<pod>`` (registered),
    ``gen/<pod>`` (the generation a pod starts in, the one before it, the number of
    recoveries so far and, for generation 0, the checkpoint it starts from),
    ``ctl/<recoveries>/<step>`` (``null``, the generation that starts at ``step + 1``, or
    at ``step`` for a shrink,
    ``{"halt": step}`` when the leader is asked to stop, or ``{"fault": ...}`` once the
    leader is recovering), ``end`` (the step training ended at:
    standby pods leave), ``beat/<pod>`` (a counter each pod's heartbeat thread advances) and,
    for the k-th recovery, ``fault/<k>/at/<pod>`` (a survivor's report) and
    ``fault/<k>/decision`` (the leader's: where the survivors go on, or why they cannot).

    The fault path (``recover``): every survivor reports; the leader waits until each member of
    the failed generation (and of one announced after it) has either reported or been silent
    for ``lost_after_s`` (no heartbeat), then names the survivors' generation. Pods the
    newest target releases are not in it, so a pod the operator deleted at a drain deadline
    ends in the generation that target asked for, under its number. Training resumes at the
    newest step boundary the survivors' peer snapshots hold whole (their reports say what each
    holds; ``tidal_agent.snapshot.choose_cut``), else at the newest complete checkpoint under
    ``checkpoint_root`` that is not past the failed step, else from step 0 (everything is a
    function of the seed and the step, so the replay is exact).
    A failure with no member lost is a bug, not a fault: every survivor raises its error.

    Generation 0 starts from the newest complete checkpoint under ``checkpoint_root`` if there
    is one (the job restarted, or was applied again), else from step 0.

    The leader lost (its store gone): the job cannot go on, but what the peer snapshots hold
    need not be lost with it. The other members agree without the store (``rescue``: a
    FileStore under ``checkpoint_root``, named by the run's id, which every pod learns with its
    generation) on the newest boundary they hold whole, rebuild it in a layout of theirs and
    save it, for the operator's restart to start from.
    """

    def __init__(
        self,
        *,
        me: str,
        leader: str,
        store: dist.Store,
        min_workers: int,
        steps: int,
        choose: Chooser,
        target: Callable[[], Target | None] = lambda: None,
        report: AgentReport | None = None,
        poll_s: float = 0.05,
        checkpoint_root: str | None = None,
        heartbeat: dist.Store | None = None,
        beat_s: float = 0.5,
        lost_after_s: float = 5.0,
        fault_wait_s: float = 300.0,
        rescue_wait_s: float = 30.0,
        stop: threading.Event | None = None,
    ) -> None:
        self.me, self._leader, self.store = me, leader, store
        self.stop = stop  # set on SIGTERM: a pod in standby leaves at once; the leader halts
        self.departed = False  # this pod left unasked (depart)
        self.min_workers, self.steps = min_workers, steps
        self._choose, self._target, self._report = choose, target, report
        self.poll_s = poll_s
        self.checkpoint_root = checkpoint_root
        self.resume_from: str | None = None  # the checkpoint generation 0 starts from
        self.lost_after_s, self.fault_wait_s = lost_after_s, fault_wait_s
        self.rescue_wait_s = rescue_wait_s
        self.run = uuid.uuid4().hex[:12] if me == leader else ""  # this run of the job
        self._layouts: dict[int, Layout] = {}
        self.current: Generation | None = None  # the leader's newest generation
        self._first: Generation | None = None  # the leader's generation 0
        self.applied = -1  # the newest target generation acted on (the leader's)
        self._skipped: tuple[Target, str] | None = None  # the last target not applied, and why
        self.recoveries = 0  # fault paths taken, the same count on every member
        # (recoveries, step) of the boundary a shrink was announced and switched at: the new
        # generation asks there again, and its key (read by every member, maybe not yet) holds
        # the shrink, so that boundary announces nothing more.
        self._switched_at: tuple[int, int] | None = None
        self.lost: set[str] = set()  # members lost to faults (the leader's view)
        self._beating = threading.Event()
        if heartbeat is not None:  # its own connection: never queued behind a blocking get
            threading.Thread(target=self._beat, args=(heartbeat, beat_s), daemon=True,
                             name="tidal-heartbeat").start()

    @property
    def leader(self) -> str:
        return self._leader

    def layout(self, gen: Generation) -> Layout:
        return self._layouts[gen.index]

    def _beat(self, store: dist.Store, every_s: float) -> None:
        """Advance ``beat/<me>`` until this pod leaves: how the leader tells a lost member
        from a slow one."""
        try:
            while not self._beating.wait(every_s):
                store.add(f"beat/{self.me}", 1)
        except RuntimeError as err:  # the store is gone: training is over or lost anyway
            log.debug("heartbeat stopped: %s", err)

    def stop_beating(self) -> None:
        """Stop the heartbeat: this pod is done with the job (or, in tests, dead)."""
        self._beating.set()

    def register(self) -> int:
        """Make this pod known to the leader; its place in the registration order."""
        n = self.store.add("reg/count", 1)
        self.store.set(f"reg/{n}", self.me)
        self.store.set(f"pod/{self.me}", str(n))
        return n

    def registered(self) -> list[str]:
        """Every pod registered so far, in registration order."""
        count = self.store.add("reg/count", 0)
        return [self.store.get(f"reg/{i}").decode() for i in range(1, count + 1)]

    def start(self, me: str) -> tuple[Generation, Generation | None] | None:
        self.register()
        if me == self._leader:
            return self._first_generation(), None
        key = f"gen/{me}"
        waited = time.monotonic()
        while not self.store.check([key]):
            if self.store.check(["end"]) or (self.stop is not None and self.stop.is_set()):
                return None
            if time.monotonic() - waited > 60:
                log.info("%s waits in standby", me)
                waited = time.monotonic()
            time.sleep(self.poll_s)
        data = json.loads(self.store.get(key))
        gen, layout = _gen_from(data)
        self._layouts[gen.index] = layout
        self.recoveries = data.get("recoveries", 0)
        self.run = data.get("run", "")
        previous = None
        if data.get("previous"):
            previous, old_layout = _gen_from(data["previous"])
            self._layouts[previous.index] = old_layout
        else:
            self.resume_from = data.get("checkpoint")
        return gen, previous

    def _first_generation(self) -> Generation:
        members = self._initial_members()
        saved = (checkpoint.latest(self.checkpoint_root, at_most=self.steps)
                 if self.checkpoint_root else None)
        if saved is not None:
            self.resume_from = str(saved[1])
        gen = Generation(index=0, at_step=saved[0] if saved else 0, members=members)
        layout, predicted = self._choose(len(members), len(members))
        self._layouts[0] = layout
        for pod in members[1:]:
            self.store.set(f"gen/{pod}", json.dumps({**_gen_json(gen, layout), "previous": None,
                                                     "checkpoint": self.resume_from,
                                                     "run": self.run}))
        self._first = self.current = gen
        self.applied = 0
        log.info("generation 0: %s in %s from step %d%s", list(gen.members), layout.describe(),
                 gen.at_step, f" ({self.resume_from})" if self.resume_from else "")
        if self._report is not None:
            self._report.planned(0, predicted)
            self._report.applied(gen, layout)
        return gen

    def _initial_members(self) -> tuple[str, ...]:
        """Generation 0: the pods a generation-0 target joins (the operator writes one with the
        job's first pods), else the leader and the first ``min_workers - 1`` others to
        register. Waits until they have registered."""
        target = self._target()
        named: tuple[str, ...] | None = None
        if target is not None and target.generation == 0 and target.join:
            if self._leader in target.join:
                named = (self._leader, *(p for p in target.join if p != self._leader))
            else:
                log.error("generation 0's target %s leaves out the leader %s; taking the "
                          "first pods to register", list(target.join), self._leader)
        waited = time.monotonic()
        while True:
            pods = self.registered()
            if named is None and len(pods) >= self.min_workers:
                others = [p for p in pods if p != self._leader][: self.min_workers - 1]
                return (self._leader, *others)
            if named is not None and set(named) <= set(pods):
                return named
            if time.monotonic() - waited > 60:
                log.info("generation 0 waits for %s; registered: %s",
                         list(named) if named else f"{self.min_workers} pods", pods)
                waited = time.monotonic()
            time.sleep(self.poll_s)

    def following(self, gen: Generation, step: int) -> Generation | Halt | None:
        from tidal_agent.worker import Halt

        key = f"ctl/{self.recoveries}/{step}"
        if self._switched_at == (self.recoveries, step):
            return None
        if self.me != self._leader:
            data = json.loads(self.store.get(key))
            if data is None:
                return None
            if "fault" in data:
                raise LeaderRecovering(f"at step {step}: {data['fault']}")
            if "halt" in data:
                return Halt(data["halt"])
            following, layout = _gen_from(data)
            self._layouts[following.index] = layout
            return self._switching(following, step)
        if self.stop is not None and self.stop.is_set():  # the job cannot go on without me
            log.warning("asked to stop: the job halts at step %d", step)
            self.store.set(key, json.dumps({"halt": step}))
            return Halt(step)
        following = self._decide(gen, step)
        if following is None:
            self.store.set(key, "null")
        else:
            layout = self._layouts[following.index]
            announced = {**_gen_json(following, layout), "previous": _gen_json(gen, self.layout(gen))}
            for pod in following.members:  # a joiner also learns the recoveries so far, which
                if pod not in gen.members:  # number the control keys it reads from now on
                    self.store.set(f"gen/{pod}", json.dumps(
                        {**announced, "recoveries": self.recoveries, "run": self.run}))
            self.store.set(key, json.dumps(announced))
            self.current = self._switching(following, step)
            log.info("step %d: generation %d (%s) in %s from step %d", step, following.index,
                     list(following.members), layout.describe(), following.at_step)
        if step >= 2:  # everyone has read it: members read every key in turn
            self.store.delete_key(f"ctl/{self.recoveries}/{step - 2}")
        return following

    def _switching(self, following: Generation, step: int) -> Generation:
        """``following``, announced at ``step``; remember the boundary if it switches there."""
        if following.at_step == step:
            self._switched_at = (self.recoveries, step)
        return following

    def end(self, step: int) -> None:
        """Training is over: pods still in standby leave."""
        self.store.set("end", str(step))
        self.stop_beating()

    def depart(self, me: str, step: int) -> None:
        """Say goodbye (``bye/<pod>``): the leader counts this pod lost at once, without
        waiting ``lost_after_s`` for its silence."""
        self.store.set(f"bye/{me}", str(step))
        self.departed = True
        self.stop_beating()

    def leave(self) -> None:
        """Forget this pod, so that a later pod of the same name registers afresh."""
        self.stop_beating()
        self.store.delete_key(f"gen/{self.me}")
        self.store.delete_key(f"pod/{self.me}")

    def recover(self, me: str, trained: Generation, step: int, error: Exception,
                held: dict[str, Any] | None = None) -> Recovery | None:
        from tidal_agent.worker import LeaderLost, Recovery

        fault = f"fault/{self.recoveries}"
        try:
            self.store.set(f"{fault}/at/{me}", json.dumps(
                {"step": step, "error": f"{type(error).__name__}: {error}"[:500],
                 "held": held or {}}))
            if me == self._leader:
                decision = self._recovery(trained, step, fault, error)
                self.store.set(f"{fault}/decision", json.dumps(decision))
            else:
                # The leader may wait fault_wait_s for members, then plan: wait past that.
                self.store.wait([f"{fault}/decision"], timedelta(seconds=self.fault_wait_s + 60))
                decision = json.loads(self.store.get(f"{fault}/decision"))
        except dist.DistNetworkError as err:  # (a timeout is DistStoreError: not this)
            raise LeaderLost(f"the rendezvous store on {self._leader} is gone: {err}") from error
        self.recoveries += 1
        if "abort" in decision:
            log.error("no recovery: %s", decision["abort"])
            raise error
        gen, layout = _gen_from(decision["generation"])
        self._layouts[gen.index] = layout
        cut = Cut.from_json(decision["snapshot"]) if decision.get("snapshot") else None
        source = ("peer snapshots" if cut is not None else decision["checkpoint"]
                  or "from scratch")
        log.warning("recovery %d: %s lost at step %d; %s go on in %s from step %d (%s)",
                    self.recoveries, decision["lost"], decision["failed_at"], list(gen.members),
                    layout.describe(), gen.at_step, source)
        if me not in gen.members:
            return None
        return Recovery(generation=gen, world=f"recovery{self.recoveries}",
                        checkpoint=decision["checkpoint"], failed_at=decision["failed_at"],
                        lost=tuple(decision["lost"]), snapshot=cut,
                        left=tuple(decision.get("left", ())))

    def rescue(self, me: str, trained: Generation,
               held: dict[str, Any] | None) -> tuple[Generation, Cut, dist.Store] | None:
        """The leader is lost, and the store with it: the other members of ``trained`` agree
        through a FileStore under ``checkpoint_root`` on the newest boundary their peer
        snapshots hold whole. Their generation (whose world saves that boundary's copies as
        they are), the cut, and the store to build its world on; None where that cannot be: no
        checkpoint root or snapshots, a member missing after ``rescue_wait_s``, no whole
        boundary."""
        survivors = tuple(p for p in trained.members if p != self._leader)
        if not self.checkpoint_root or held is None or not self.run or me not in survivors:
            return None
        path = Path(self.checkpoint_root) / f".rescue-{self.run}-{self.recoveries}"
        path.parent.mkdir(parents=True, exist_ok=True)
        store = dist.FileStore(str(path), -1)
        store.set(f"at/{me}", json.dumps(held))
        deadline = time.monotonic() + self.rescue_wait_s
        while not store.check([f"at/{p}" for p in survivors]):
            if time.monotonic() > deadline:
                missing = [p for p in survivors if not store.check([f"at/{p}"])]
                log.error("no rescue: %s did not report within %.0f s", missing,
                          self.rescue_wait_s)
                return None
            time.sleep(self.poll_s)
        cut = choose_cut({p: json.loads(store.get(f"at/{p}")) for p in survivors})
        if cut is None:
            log.error("no rescue: the peer snapshots of %s hold no whole boundary",
                      list(survivors))
            return None
        return Generation(index=trained.index + 1, at_step=cut.step, members=survivors), cut, store

    def _recovery(self, trained: Generation, step: int, fault: str,
                  error: Exception) -> dict[str, Any]:
        """The leader's decision on the fault path: the survivors' generation, or why not."""
        # Members waiting at a step boundary for the leader's word get it now.
        for boundary in (step, step + 1, step + 2):
            self.store.compare_set(f"ctl/{self.recoveries}/{boundary}", "",
                                   json.dumps({"fault": f"{type(error).__name__}"}))
        members = list(dict.fromkeys((*trained.members, *self.current.members)))
        target = self._target()
        released = set(target.release) if target is not None else set()
        # A pod the newest target releases is no survivor whatever it does: not waited for.
        reported, lost = self._survivors([p for p in members if p not in released], fault)
        lost += [p for p in members if p in released and not self.store.check(
            [f"{fault}/at/{p}"])]
        if not lost:
            return {"abort": f"every member survived the failure at step {step} "
                             f"({type(error).__name__}: {error}); not a lost worker"}
        survivors = tuple(p for p in members if p in reported)
        index = self.applied
        if (target is not None and set(lost) <= released and target.workers == len(survivors)
                and target.generation >= self.applied):
            index = target.generation  # the scale-down the lost pods did not drain for
        try:
            layout, predicted = self._choose(len(survivors), len(self._first.members))
        except LayoutError as err:
            return {"abort": f"no layout for the {len(survivors)} survivors: {err}"}
        resume, path = 0, None
        cut = choose_cut({p: json.loads(self.store.get(f"{fault}/at/{p}")).get("held", {})
                          for p in survivors})
        saved = checkpoint.latest(self.checkpoint_root, at_most=step) if self.checkpoint_root \
            else None
        if cut is not None and (saved is None or cut.step >= saved[0]):
            resume = cut.step
        elif saved is not None:
            resume, path, cut = saved[0], str(saved[1]), None
        else:
            log.warning("no whole peer snapshot and no complete checkpoint to recover from: the "
                        "survivors start afresh from step 0 (set spec.checkpoint to lose less)")
        gen = Generation(index=index, at_step=resume, members=survivors)
        self._layouts[index] = layout
        self.current, self.applied = gen, index
        self.lost.update(lost)
        if self._report is not None:
            self._report.planned(index, predicted)
        left = [p for p in lost if self.store.check([f"bye/{p}"])]
        return {"generation": _gen_json(gen, layout), "lost": lost, "left": left, "failed_at": step,
                "checkpoint": path, "snapshot": cut.to_json() if cut is not None else None}

    def _survivors(self, members: list[str], fault: str) -> tuple[set[str], list[str]]:
        """Wait until every member has reported on the fault path or fallen silent: (the
        reporters, the lost in member order). A member neither reporting nor silent by
        ``fault_wait_s`` counts as lost."""
        deadline = time.monotonic() + self.fault_wait_s
        heard: dict[str, tuple[int, float]] = {}  # member -> (its beat count, when it moved)
        while True:
            now = time.monotonic()
            reported = {p for p in members if self.store.check([f"{fault}/at/{p}"])}
            silent = []
            for pod in members:
                if pod in reported:
                    continue
                if self.store.check([f"bye/{pod}"]):  # it left when asked to stop
                    silent.append(pod)
                    continue
                beats = self.store.add(f"beat/{pod}", 0)
                if pod not in heard or heard[pod][0] != beats:
                    heard[pod] = (beats, now)
                if now - heard[pod][1] >= self.lost_after_s:
                    silent.append(pod)
            if len(reported) + len(silent) == len(members):
                return reported, silent
            if now > deadline:
                return reported, [p for p in members if p not in reported]
            time.sleep(self.poll_s)

    def _decide(self, gen: Generation, step: int) -> Generation | None:
        """The generation the target asks for, if it can start: a scale-up at the next
        boundary (its world is built while this step trains), a scale-down at this one, so
        that the pods it releases leave a step sooner (a pending pod is waiting for them)."""
        target = self._target()
        if target is None or target.generation <= self.applied or step + 1 >= self.steps:
            return None
        try:
            following = next_generation(replace(gen, index=self.applied), target,
                                        at_step=step + 1)
            if following.members == gen.members:  # nothing moves: acknowledge it
                self.applied = target.generation
                if self._report is not None:
                    self._report.acknowledged(target.generation)
                return None
            joiners = [p for p in following.members if p not in gen.members]
            if not joiners:  # a scale-down
                following = replace(following, at_step=step)
            missing = [p for p in joiners if not self.store.check([f"pod/{p}"])]
            if missing:
                self._skip(target, f"waiting for {missing} to register")
                return None
            layout, predicted = self._choose(len(following.members), len(self._first.members))
        except (TargetError, LayoutError) as err:
            self._skip(target, f"cannot apply it: {err}", level=logging.ERROR)
            return None
        self._layouts[following.index] = layout
        if self._report is not None:
            self._report.planned(following.index, predicted)
        self.applied = target.generation
        return following

    def _skip(self, target: Target, why: str, level: int = logging.INFO) -> None:
        if (target, why) != self._skipped:  # once, not at every step
            log.log(level, "target generation %d: %s", target.generation, why)
            self._skipped = (target, why)


# ---- the leader's report ------------------------------------------------------------------------


def applied_layout(layout: Layout) -> AppliedLayout:
    return AppliedLayout(
        dp=layout.dp, pp=layout.pp, partition=layout.partition, schedule=layout.schedule.value,
        virtual_stages=layout.virtual_stages, micro_batch_size=layout.micro_batch_size,
        num_micro_batches=layout.num_micro_batches,
    )


class AgentReport:
    """The worker's events (``put``) as status fields and metrics on the leader, and as a
    JSON report.

    Every pod has one; only the leader's has a link and metrics, and sees step and switch
    events.
    """

    def __init__(self, link: ControlLink | None, *, tokens_per_step: int, window: int = 10,
                 metrics: JobMetrics | None = None):
        self.link, self.tokens_per_step, self.metrics = link, tokens_per_step, metrics
        self.steps: list[dict[str, Any]] = []
        self.reconfigurations: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self.generations: list[dict[str, Any]] = []
        self.digests: dict[int, tuple[str, str]] | None = None
        self.left_at: int | None = None
        self.halted: dict[str, Any] | None = None  # where the job halted, and its checkpoint
        self._recent: deque[float] = deque(maxlen=window)
        self._predicted: dict[int, float | None] = {}

    def put(self, event: tuple) -> None:
        kind, _, payload = event[:3]
        if kind == "step":
            self._step(payload)
        elif kind == "reconfig":
            self.reconfigurations.append(payload)
            if self.metrics is not None:
                self.metrics.switched(*payload["workers"], payload["pause_s"],
                                      payload["bytes_moved"])
            gen = Generation(index=payload["generation"], at_step=payload["at_step"],
                             members=tuple(payload["members"]))
            self.applied(gen, Layout(**payload["to"]), switch_s=payload["pause_s"])
        elif kind == "recovered":
            self._recovered(payload)
        elif kind == "done":
            self.digests = payload
        elif kind == "left":
            self.left_at = payload
        elif kind == "halted":
            self.halted = payload

    def _recovered(self, payload: dict[str, Any]) -> None:
        """The survivors of a fault go on from ``resumed_at``: the steps from there on are
        replayed, and their results replace the ones reported before the fault."""
        resumed = payload["resumed_at"]
        replayed = sum(1 for s in self.steps if s["step"] >= resumed)
        self.steps = [s for s in self.steps if s["step"] < resumed]
        self.recoveries.append({**payload, "replayed_steps": replayed})
        if self.metrics is not None:
            self.metrics.recovered(len(payload["lost"]), replayed)
        if self.link is not None:  # goes out with the survivors' generation, below
            self.link.publish(step=resumed, lost=tuple(dict.fromkeys(
                p for r in self.recoveries for p in r["lost"])))
        gen = Generation(index=payload["generation"], at_step=resumed,
                         members=tuple(payload["members"]))
        self.applied(gen, Layout(**payload["layout"]), switch_s=payload["pause_s"])

    def planned(self, index: int, predicted_step_s: float | None) -> None:
        self._predicted[index] = predicted_step_s

    def applied(self, gen: Generation, layout: Layout, switch_s: float | None = None) -> None:
        """Generation ``gen`` runs now (the leader's view)."""
        self.generations.append({"generation": gen.index, "at_step": gen.at_step,
                                 "members": list(gen.members), "layout": layout.to_dict(),
                                 "switch_s": switch_s})
        self._recent.clear()  # step times of another layout
        if self.metrics is not None:
            self.metrics.applied(gen.index, len(gen.members), layout.dp, layout.pp,
                                 self._predicted.get(gen.index))
        if self.link is None:
            return
        fields: dict[str, Any] = {
            "generation": gen.index, "members": gen.members, "layout": applied_layout(layout),
            "predicted_step_seconds": self._predicted.get(gen.index),
        }
        if switch_s is not None:
            fields["last_switch_seconds"] = switch_s
        self.link.publish(**fields)

    def acknowledged(self, generation: int) -> None:
        """A target that changes nothing, applied as it is."""
        if self.link is not None:
            self.link.publish(generation=generation)

    def _step(self, payload: dict[str, Any]) -> None:
        self.steps.append(payload)
        self._recent.append(payload["seconds"])
        log.info("step %5d  pp%d  loss %.4f  %7.1f ms", payload["step"], payload["layout"]["pp"],
                 payload["loss"], payload["seconds"] * 1e3)
        seconds = statistics.median(self._recent)
        if self.metrics is not None:
            self.metrics.stepped(payload["step"], payload["loss"], payload["seconds"],
                                 self.tokens_per_step / seconds)
        if self.link is not None:
            self.link.publish(step=payload["step"] + 1, loss=payload["loss"],
                              step_seconds=seconds, tokens_per_second=self.tokens_per_step / seconds)


# ---- tidal agent ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class PodIdentity:
    """Who this agent is: its job, its pod, and where the job's rendezvous is."""

    job: str
    namespace: str
    pod: str
    rendezvous_host: str
    rendezvous_port: int = keys.RENDEZVOUS_PORT

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> PodIdentity:
        names = (keys.ENV_JOB, keys.ENV_NAMESPACE, keys.ENV_POD, keys.ENV_RENDEZVOUS_HOST)
        if missing := [n for n in names if not env.get(n)]:
            raise ControlError(
                f"set {', '.join(missing)}: the operator puts them in every worker pod"
            )
        port = env.get(keys.ENV_RENDEZVOUS_PORT) or str(keys.RENDEZVOUS_PORT)
        if not port.isdigit():
            raise ControlError(f"{keys.ENV_RENDEZVOUS_PORT}={port!r} is not a port number")
        return cls(job=env[keys.ENV_JOB], namespace=env[keys.ENV_NAMESPACE],
                   pod=env[keys.ENV_POD], rendezvous_host=env[keys.ENV_RENDEZVOUS_HOST],
                   rendezvous_port=int(port))

    @property
    def leader(self) -> str:
        return f"{self.job}-worker-0"


def run_agent(
    identity: PodIdentity,
    *,
    kubeconfig: str | None = None,
    threads: int = 1,
    steps: int | None = None,
    plan_device: str = "cpu",
    publish_interval_s: float = 2.0,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    report_path: str | Path | None = None,
    metrics_port: int | None = None,
) -> dict[str, Any]:
    """Train as ``identity.pod`` until the job's last step or until released; the leader
    returns (and writes to ``report_path``) the run's report, other pods what they saw.
    With ``metrics_port``, Prometheus metrics (tidal_agent.metrics) are served on it."""
    link = ControlLink(identity.job, identity.namespace, kubeconfig=kubeconfig,
                       publish_interval_s=publish_interval_s)
    metrics = AgentMetrics(namespace=identity.namespace, job=identity.job, pod=identity.pod,
                           leader=identity.pod == identity.leader)
    try:
        if metrics_port:
            try:
                metrics.serve(metrics_port)
            except OSError as err:
                raise ControlError(f"cannot serve metrics on port {metrics_port}: {err}") from err
        return _run(identity, link, threads=threads, steps=steps, plan_device=plan_device,
                    timeout_s=timeout_s, backend=backend, report_path=report_path,
                    metrics=metrics.job)
    finally:
        link.close()
        metrics.close()


def _run(identity: PodIdentity, link: ControlLink, *, threads: int, steps: int | None,
         plan_device: str, timeout_s: float, backend: str,
         report_path: str | Path | None, metrics: JobMetrics | None) -> dict[str, Any]:
    from tidal_agent.worker import WorkerOptions, train
    from tidal_agent.world import Rendezvous
    from tidal_plan.devices import load_device
    from tidal_plan.planner import LayoutPlanner

    job = link.job()
    spec = job.spec
    if spec.gpus_per_worker != 1:
        raise ControlError(
            f"spec.gpusPerWorker is {spec.gpus_per_worker}: tidal agent runs one rank per pod "
            "for now; set gpusPerWorker: 1"
        )
    steps = steps or spec.training.steps
    if steps > spec.training.steps:
        raise ControlError(f"--steps {steps} exceeds spec.training.steps ({spec.training.steps})")
    leading = identity.pod == identity.leader
    # The job's long-lived store, on the leader: it must outlive every other pod's use of it.
    host = dist.TCPStore(
        identity.rendezvous_host, identity.rendezvous_port, is_master=True,
        wait_for_workers=False, timeout=timedelta(seconds=timeout_s), use_libuv=True,
    ) if leading else None
    rendezvous = Rendezvous(host=identity.rendezvous_host, port=identity.rendezvous_port,
                            prefix=f"{identity.job}/", timeout_s=timeout_s, backend=backend)
    report = AgentReport(link if leading else None, metrics=metrics,
                         tokens_per_step=spec.training.global_batch_size * spec.model.seq_len)
    device = load_device(plan_device)
    planner = LayoutPlanner(job, device)

    def choose(workers: int, first_workers: int) -> tuple[Layout, float | None]:
        """The layout ``tidal run`` would pick for this count (dp by the same rule)."""
        dp = data_parallel_degree(spec, first_workers, workers)
        layout, prediction = planner.layout(workers, dp)
        return layout, prediction.step_seconds

    stop = _stop_on_sigterm(identity.pod)
    store = rendezvous.connect()
    source = ControlledGenerations(
        me=identity.pod, leader=identity.leader, store=store, min_workers=spec.workers.min,
        steps=steps, choose=choose, target=link.target, report=report,
        checkpoint_root=spec.checkpoint.path, heartbeat=rendezvous.connect(),
        fault_wait_s=2 * timeout_s + 30,  # past any member's own timeout on a dead peer
        stop=stop,
    )
    if leading:
        link.start()
        threading.Thread(target=_publish_scale_table, args=(link, job, device),
                         name="tidal-plan", daemon=True).start()
    opts = WorkerOptions(
        rendezvous=rendezvous, steps=steps, threads=threads,
        checkpoint_root=spec.checkpoint.path, checkpoint_every=spec.checkpoint.every_steps,
        peer_snapshots=spec.checkpoint.peer_snapshots, stop=stop,
    )
    train(identity.pod, spec, opts, report, source)
    if leading and report.halted is not None:
        _halt(identity, source, report, store, report_path, timeout_s)
    if report.digests is not None:  # a final member: the leader hashes all parameters
        store.set(f"digest/{identity.pod}", json.dumps(report.digests))
    if not leading:
        source.leave()
        if source.departed:  # the leader counts it lost, not among the pods that exit
            return {"pod": identity.pod, "left_at": report.left_at, "done": False}
        store.add("exited", 1)
        return {"pod": identity.pod, "left_at": report.left_at, "done": report.digests is not None}
    result = _leader_report(identity.job, spec, source, report, store)
    link.publish(step=steps)
    _end(source, store, steps, result, report_path, timeout_s)
    del host  # only now may the store go down
    return result


def _halt(identity: PodIdentity, source: ControlledGenerations, report: AgentReport,
          store: dist.Store, report_path: str | Path | None, timeout_s: float) -> None:
    """The leader, asked to stop, has halted the job at a step boundary that every member
    saved: standby pods leave, the others exit, and so does the leader, with SIGTERM's exit
    status (its pod fails), for the operator to restart the job from that checkpoint."""
    from tidal_agent.worker import STOPPED

    halted = report.halted
    _end(source, store, halted["step"], {**_run_record(identity.job, source, report),
                                         "halted": halted}, report_path, timeout_s)
    log.warning("%s: halted at step %d; the operator restarts the job from %s", identity.pod,
                halted["step"], halted["checkpoint"] or "step 0 (spec.checkpoint.path is unset)")
    raise SystemExit(STOPPED)


def _end(source: ControlledGenerations, store: dist.Store, step: int, result: Mapping[str, Any],
         report_path: str | Path | None, timeout_s: float) -> None:
    """The leader's part at the job's end, at its last step or halted: standby pods leave,
    the report is written, and the store stays up until every other registered pod is done
    with it."""
    source.end(step)
    if report_path is not None:
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        Path(report_path).write_text(json.dumps(result, indent=2) + "\n")
    _wait_for_exits(store, len(set(source.registered()) - source.lost) - 1, timeout_s)


def _stop_on_sigterm(pod: str) -> threading.Event:
    """An event SIGTERM sets (a pod is deleted, preempted or its node drained): the worker
    leaves at its next step boundary rather than die mid-step, or, in a container where the
    agent is PID 1, ignore the signal until the kubelet's SIGKILL."""
    stop = threading.Event()

    def on_sigterm(signum: int, frame: Any) -> None:
        if not stop.is_set():
            log.warning("%s: SIGTERM; stopping at the next step boundary", pod)
            stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    return stop


def _leader_report(job: str, spec, source: ControlledGenerations, report: AgentReport,
                   store: dist.Store) -> dict[str, Any]:
    """The run as the leader saw it, with one hash over every final parameter."""
    from tidal_agent.model import global_parameter_names
    from tidal_agent.trainer import model_config, params_sha256

    digests: dict[int, tuple[str, str]] = {}
    for pod in source.current.members:
        received = json.loads(store.get(f"digest/{pod}"))
        digests.update({int(k): (name, digest) for k, (name, digest) in received.items()})
    return {
        **_run_record(job, source, report),
        "params_sha256": params_sha256(digests, len(global_parameter_names(model_config(spec)))),
    }


def _run_record(job: str, source: ControlledGenerations, report: AgentReport) -> dict[str, Any]:
    """The run as the leader saw it: where it started, its generations, steps, switches and
    recoveries, and where it is now."""
    return {
        "job": job, "members": list(source.current.members), "resumed_from": source.resume_from,
        "layout": source.layout(source.current).to_dict(), "generations": report.generations,
        "steps": report.steps, "reconfigurations": report.reconfigurations,
        "recoveries": report.recoveries,
    }


def _publish_scale_table(link: ControlLink, job: ElasticTrainingJob, device) -> None:
    """Plan the job's scale table (as ``tidal plan`` does) off the training thread."""
    from tidal_plan.planner import plan_job

    try:
        table, _ = plan_job(job, device)
    except (LayoutError, ValueError) as err:
        log.error("no scale table: %s", err)
        return
    link.publish(scale_table=table)


def _wait_for_exits(store: dist.Store, others: int, timeout_s: float) -> None:
    """Keep the leader's store up until every other registered pod is done with it."""
    deadline = time.monotonic() + timeout_s
    while store.add("exited", 0) < others and time.monotonic() < deadline:
        time.sleep(0.05)
