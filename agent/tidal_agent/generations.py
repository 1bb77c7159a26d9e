"""Membership from the operator: the generations protocol, agreed on through the rendezvous store.

``ControlledGenerations`` is the worker's generation source (tidal_agent.protocol) when
membership comes from the operator. Pods agree through the job's rendezvous store (a TCPStore
in a pod of its own, tidal_agent.host): every pod registers; generation 0 is the pods that a
generation-0 target joins (the operator writes one as it creates the job's first pods), or
without one the first leader (``<job>-worker-0``) and the first ``spec.workers.min - 1``
other pods to register; any
other pod waits in standby until a target names it. At every step boundary the leader compares
the target's generation with the applied one and writes ``ctl/<step>``: ``null`` or the next
generation, which switches at the following step if it grows (its world is built while this
step trains) and at once if it shrinks (the pods it releases leave a step sooner). Every member
reads that key before the step, so all switch at the same boundary; a joiner reads
``gen/<pod>``. A scale-up is announced once every pod it joins has registered. When a member is
lost (the operator deleted it at a drain deadline, or its node went), the survivors agree
through the store on a generation without it, which resumes from the peer snapshots of the
step in flight or from the job's last complete checkpoint (``recover``). The leader is lost
like any member: a survivor takes the lead, from the state the leader kept in the store.

One class over one namespace of store keys: the boundary protocol, the fault path and the
lead handed on share its bookkeeping (the generations announced, their layouts, the
recoveries so far, the leader's state); the rescue's agreement without the store is
:func:`tidal_agent.snapshot.agree_on_files`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tidal_agent import checkpoint
from tidal_agent.presence import Presence
from tidal_agent.protocol import (Halt, LeaderRecovering, Recovery, RendezvousLost, gen_from,
                                   gen_json)
from tidal_agent.report import AgentReport
from tidal_agent.snapshot import Cut, agree_on_files, choose_cut
from tidal_api import Target
from tidal_api.layout import Layout, LayoutError
from tidal_plan.elastic import Generation, TargetError, next_generation

log = logging.getLogger("tidal.agent")


Chooser = Callable[[int], tuple[Layout, float | None]]
"""Layout (and predicted step seconds) for a worker count."""


class ControlledGenerations:
    """A ``GenerationSource`` driven by the operator's targets, agreed on through the store.

    The leader (the first member of the newest generation) decides; everyone else reads. Keys
    (under the rendezvous prefix): ``leader/state`` (what the leader decides from: its newest
    generation, the newest target generation acted on, the members lost; a new leader starts
    from it),
    ``reg/count`` and ``reg/<n>`` (pods in registration order), ``pod/<pod>`` (registered),
    ``gen/<pod>`` (the generation a pod starts in, the one before it, the number of
    recoveries so far and, for generation 0, the checkpoint it starts from),
    ``ctl/<recoveries>/<step>`` (``null``, the generation that starts at ``step + 1``, or
    at ``step`` for a shrink,
    ``{"halt": step}`` when the leader is asked to stop, or ``{"fault": ...}`` once the
    leader is recovering), ``end`` (the step training ended at:
    standby pods leave), ``beat/<pod>`` (a counter each pod's heartbeat thread advances) and,
    for the k-th recovery, ``fault/<k>/at/<pod>`` (a survivor's report) and
    ``fault/<k>/decision`` (the leader's: where the survivors go on, or why they cannot),
    ``fault/<k>/decider`` (who decides it: the leader, or the survivor that took the lead from
    it); ``presence`` and ``gone/...`` are tidal_agent.presence's, ``closed``
    tidal_agent.host's.

    The fault path (``recover``): every survivor reports; the leader waits until each member of
    the failed generation (and of one announced after it) has either reported or is lost: its
    connection to the rendezvous ended (tidal_agent.presence: a process that died), or, the
    backstop for a hung one, its heartbeat was silent for ``lost_after_s``; then it names the
    survivors' generation. Pods the
    newest target releases are not in it, so a pod the operator deleted at a drain deadline
    ends in the generation that target asked for, under its number. Training resumes at the
    newest step boundary the survivors' peer snapshots hold whole (their reports say what each
    holds; ``tidal_agent.snapshot.choose_cut``), else at the newest complete checkpoint under
    ``checkpoint_root`` that is not past the failed step, else from step 0 (everything is a
    function of the seed and the step, so the replay is exact).
    A failure with no member lost is a bug, not a fault: every survivor raises its error.

    Generation 0 starts from the newest complete checkpoint under ``checkpoint_root`` if there
    is one (the job restarted, or was applied again), else from step 0.

    The leader lost: a member waiting for its word (at a step boundary, on the fault path)
    looks every ``leader_wait_s`` whether it is lost, as the fault path counts members lost,
    and the first survivor to see it takes the lead (``fault/<k>/decider``): it loads the
    leader's state, calls ``on_lead`` and decides the fault as the leader would have, first
    in the survivors' generation.

    The rendezvous lost (the store gone): the job cannot go on, but what the peer snapshots
    hold need not be lost with it. The members agree without the store (``rescue``: a
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
        presence: Presence | None = None,
        leader_wait_s: float = 1.0,
    ) -> None:
        # The leader: generation 0's first member (``leader``), then the first member of each
        # generation this pod learns of; a survivor that takes the lead from a lost leader
        # puts itself first in the survivors' generation.
        self.me, self._leader, self.store = me, leader, store
        # How often a member waiting for the leader's word looks whether the leader is lost.
        self.leader_wait_s = leader_wait_s
        # Called when this pod takes the lead from a lost leader, before it decides anything:
        # the pod's part (its link to the API server, the report's history).
        self.on_lead: Callable[[], None] = lambda: None
        self._state: tuple | None = None  # the leader's state as last saved (``_save_state``)
        self._heard: dict[str, tuple[int, float]] = {}  # member -> (its beats, when they moved)
        self.presence = presence  # how a pod that died is known at once (tidal_agent.presence)
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
        self._layouts: dict[tuple[int, int], Layout] = {}
        self.current: Generation | None = None  # the leader's newest generation
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
        return self._layouts[gen.key]

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
        if self.presence is not None:
            self.presence.announce(self.me, n)
        return n

    def gone(self, members: tuple[str, ...]) -> set[str]:
        """Those of ``members`` whose connection to the rendezvous ended: dead, not slow."""
        return self.presence.gone(members) if self.presence is not None else set()

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
        gen, layout = gen_from(data)
        self._layouts[gen.key] = layout
        self._leader = gen.members[0]
        self.recoveries = data.get("recoveries", 0)
        self.run = data.get("run", "")
        previous = None
        if data.get("previous"):
            previous, old_layout = gen_from(data["previous"])
            self._layouts[previous.key] = old_layout
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
        layout, predicted = self._choose(len(members))
        self._layouts[gen.key] = layout
        for pod in members[1:]:
            self.store.set(f"gen/{pod}", json.dumps({**gen_json(gen, layout), "previous": None,
                                                     "checkpoint": self.resume_from,
                                                     "run": self.run}))
        self.current = gen
        self.applied = 0
        log.info("generation 0: %s in %s from step %d%s", list(gen.members), layout.describe(),
                 gen.at_step, f" ({self.resume_from})" if self.resume_from else "")
        if self._report is not None:
            self._report.planned(0, predicted)
            self._report.applied(gen, layout)
        self._save_state()
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
        key = f"ctl/{self.recoveries}/{step}"
        if self._switched_at == (self.recoveries, step):
            return None
        if self.me != self._leader:
            data = json.loads(self._leaders_word(key, f"step {step}"))
            if data is None:
                return None
            if "fault" in data:
                raise LeaderRecovering(f"at step {step}: {data['fault']}")
            if "halt" in data:
                return Halt(data["halt"])
            following, layout = gen_from(data)
            self._layouts[following.key] = layout
            return self._switching(following, step)
        if self.stop is not None and self.stop.is_set():  # the job cannot go on without me
            log.warning("asked to stop: the job halts at step %d", step)
            self.store.set(key, json.dumps({"halt": step}))
            return Halt(step)
        following = self._decide(gen, step)
        if following is None:
            self.store.set(key, "null")
        else:
            layout = self._layouts[following.key]
            announced = {**gen_json(following, layout),
                         "previous": gen_json(gen, self.layout(gen))}
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
        self._save_state()
        return following

    def _leaders_word(self, key: str, where: str) -> bytes:
        """``key`` once the leader writes it; ``LeaderRecovering`` if the leader is lost
        first (looked at every ``leader_wait_s``): the fault path, where a survivor takes the
        lead."""
        while not self._written(key):
            if self._lost(self._leader, time.monotonic()):
                raise LeaderRecovering(f"at {where}: the leader {self._leader} is lost")
        return self.store.get(key)

    def _written(self, key: str) -> bool:
        """Whether ``key`` is written within ``leader_wait_s`` (a store gone raises)."""
        try:
            self.store.wait([key], timedelta(seconds=self.leader_wait_s))
        except dist.DistNetworkError:
            raise
        except dist.DistStoreError:  # a timeout
            return False
        return True

    def _lost(self, pod: str, now: float) -> bool:
        """Whether ``pod`` is lost: its connection to the rendezvous ended (``gone``), it said
        goodbye, or, the backstop for a hung one, its heartbeat has been silent for
        ``lost_after_s`` (a hung process keeps its connection)."""
        if self.gone((pod,)) or self.store.check([f"bye/{pod}"]):
            return True
        beats = self.store.add(f"beat/{pod}", 0)
        if pod not in self._heard or self._heard[pod][0] != beats:
            self._heard[pod] = (beats, now)
        return now - self._heard[pod][1] >= self.lost_after_s

    def _save_state(self) -> None:
        """The leader's: what a new leader would decide from (``leader/state``), if it
        changed."""
        if self.me != self._leader or self.current is None:
            return
        state = (self.current, self.applied, frozenset(self.lost))
        if state == self._state:
            return
        self.store.set("leader/state", json.dumps({
            "current": gen_json(self.current, self.layout(self.current)),
            "applied": self.applied, "lost": sorted(self.lost)}))
        self._state = state

    def _take_lead(self, lost: str) -> None:
        """This survivor leads from now on, in place of ``lost``: the leader's state from the
        store, then the pod's part (``on_lead``)."""
        log.warning("%s takes the lead: the leader %s is lost", self.me, lost)
        data = json.loads(self.store.get("leader/state"))
        self.current, layout = gen_from(data["current"])
        self._layouts[self.current.key] = layout
        self.applied, self.lost = data["applied"], set(data["lost"])
        self._leader = self.me
        self.on_lead()

    @property
    def replans(self) -> bool:
        return True

    @property
    def drops(self) -> bool:
        return True  # status.stragglers[].release asks the operator

    def replan(self, gen: Generation, layout: Layout, *, at_step: int) -> Generation:
        """A re-plan: the operator's generation ``gen.index`` under its next revision (the
        operator numbers membership changes only). Every member calls it at the same
        boundary, having read the same re-plan, and none announces it."""
        following = replace(gen, revision=gen.revision + 1, at_step=at_step)
        self._layouts[following.key] = layout
        if self.me == self._leader:
            self.current = following
            log.info("step %d: generation %d revision %d (%s) in %s", at_step - 1,
                     following.index, following.revision, list(following.members),
                     layout.describe())
            self._save_state()
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
        if self.presence is not None:
            self.presence.close()
        self.store.delete_key(f"gen/{self.me}")
        self.store.delete_key(f"pod/{self.me}")

    def recover(self, me: str, trained: Generation, step: int, error: Exception,
                held: dict[str, Any] | None = None) -> Recovery | None:
        fault = f"fault/{self.recoveries}"
        try:
            self.store.set(f"{fault}/at/{me}", json.dumps(
                {"step": step, "error": f"{type(error).__name__}: {error}"[:500],
                 "held": held or {}}))
            decision = self._decision(trained, step, fault, error)
        except dist.DistNetworkError as err:  # (a timeout is DistStoreError: not this)
            raise RendezvousLost(f"the job's rendezvous store is gone: {err}") from error
        self.recoveries += 1
        if "abort" in decision:
            log.error("no recovery: %s", decision["abort"])
            raise error
        gen, layout = gen_from(decision["generation"])
        self._layouts[gen.key] = layout
        self._leader = gen.members[0]
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

    def _decision(self, trained: Generation, step: int, fault: str,
                  error: Exception) -> dict[str, Any]:
        """The fault's decision: made here if this pod leads, or takes the lead from a lost
        leader (or a lost survivor that had taken it), else waited for."""
        claim, decided = f"{fault}/decider", f"{fault}/decision"
        # The leader may wait fault_wait_s for members, then plan: wait past that.
        deadline = time.monotonic() + self.fault_wait_s + 60
        while True:
            claimed = self.store.check([claim])
            decider = self.store.get(claim).decode() if claimed else self._leader
            if decider == self.me or self._lost(decider, time.monotonic()):
                expected = decider if claimed else ""
                if self.store.compare_set(claim, expected, self.me).decode() == self.me:
                    if self._leader != self.me:
                        self._take_lead(decider)
                    decision = self._recovery(trained, step, fault, error)
                    self.store.set(decided, json.dumps(decision))
                    return decision
            if self._written(decided):
                return json.loads(self.store.get(decided))
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"no decision on {fault} within "
                                          f"{self.fault_wait_s + 60:.0f} s")

    def rescue(self, me: str, trained: Generation,
               held: dict[str, Any] | None) -> tuple[Generation, Cut, dist.Store] | None:
        """The rendezvous is lost, and the store with it: the members of ``trained`` agree
        through a FileStore under ``checkpoint_root`` on the newest boundary their peer
        snapshots hold whole. Their generation (whose world saves that boundary's copies as
        they are), the cut, and the store to build its world on; None where that cannot be: no
        checkpoint root or snapshots, a member missing after ``rescue_wait_s``, no whole
        boundary."""
        survivors = trained.members
        if not self.checkpoint_root or held is None or not self.run or me not in survivors:
            return None
        path = Path(self.checkpoint_root) / f".rescue-{self.run}-{self.recoveries}"
        agreed = agree_on_files(path, me, survivors, held, self.rescue_wait_s, self.poll_s)
        if agreed is None:
            return None
        cut, store = agreed
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
        # This pod leads the survivors: first (rank 0) where it took the lead from a lost one.
        survivors = (self.me, *(p for p in members if p in reported and p != self.me))
        index = self.applied
        if (target is not None and set(lost) <= released and target.workers == len(survivors)
                and target.generation >= self.applied):
            index = target.generation  # the scale-down the lost pods did not drain for
        try:
            layout, predicted = self._choose(len(survivors))
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
        self._layouts[gen.key] = layout
        self.current, self.applied = gen, index
        self.lost.update(lost)
        self._save_state()
        if self._report is not None:
            self._report.planned(index, predicted)
        left = [p for p in lost if self.store.check([f"bye/{p}"])]
        return {"generation": gen_json(gen, layout), "lost": lost, "left": left, "failed_at": step,
                "checkpoint": path, "snapshot": cut.to_json() if cut is not None else None}

    def _survivors(self, members: list[str], fault: str) -> tuple[set[str], list[str]]:
        """Wait until every member has reported on the fault path or is lost: its connection
        to the rendezvous ended (``gone``), it said goodbye, or, the backstop, its heartbeat
        has been silent for ``lost_after_s`` (a hung process keeps its connection). Returns
        (the reporters, the lost in member order). A member neither reporting nor lost by
        ``fault_wait_s`` counts as lost."""
        deadline = time.monotonic() + self.fault_wait_s
        while True:
            now = time.monotonic()
            reported = {p for p in members if self.store.check([f"{fault}/at/{p}"])}
            silent = [p for p in members if p not in reported and self._lost(p, now)]
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
            layout, predicted = self._choose(len(following.members))
        except (TargetError, LayoutError) as err:
            self._skip(target, f"cannot apply it: {err}", level=logging.ERROR)
            return None
        self._layouts[following.key] = layout
        if self._report is not None:
            self._report.planned(following.index, predicted)
        self.applied = target.generation
        return following

    def _skip(self, target: Target, why: str, level: int = logging.INFO) -> None:
        if (target, why) != self._skipped:  # once, not at every step
            log.log(level, "target generation %d: %s", target.generation, why)
            self._skipped = (target, why)
