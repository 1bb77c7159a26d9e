"""The fault soak (issue 28): workers lost to SIGKILL again and again in one long run of a small
job, the leader among them, which ends with the bits of a run that lost none.

:class:`FaultSoak` runs the job as ``tidal agent`` processes against the API emulator
(tests/integration/agents.py) and plays the operator. Each fault is a SIGKILL of one worker at a
moment of its kind (:class:`FaultKind`); the survivors notice, agree on a generation without it
and rebuild the newest step boundary their peer snapshots hold whole, replaying the steps since
(``checkpoint.peerSnapshots``; no checkpoint path, so a boundary not whole would restart from
step 0, which the replay count shows). The soak then writes a grow target naming a spare pod,
started ahead and waiting in standby (registered, no target naming it), so that a replacement
costs no process start-up, and the job is back to its ``workers``. The rendezvous runs in a
process of its own (``tidal rendezvous``, the operator's ``<job>-rendezvous`` pod), so the
leader is faulted like any member: a survivor takes the lead, and the report of the run is the
last leader's, with the history every leader kept in the store.

Faults are paced by the leader's steps (fault ``i`` not before step ``WARMUP + i *
steps_per_fault``), so that the job's length, fixed when it starts, covers them all; a job that
runs ahead of its faults fails the soak, asking for more steps per fault. The leader's log (the
newest leader's), read as it grows, says when a step ended and when a generation was announced:
the moments switch and snapshot faults aim at. The fault-free run to compare with trains meanwhile, in a thread (a
fault's wait leaves the cores idle).

A SIGKILLed pod's connection to the rendezvous ends at once (tidal_agent.presence): the
leader counts it lost from that, and a world being built with it is not waited for, so the
agents run with their default ``--lost-after`` (5 s of heartbeat silence, the backstop for a
hung pod, which a SIGKILL never needs) and ``--timeout`` (120 s): a fault that waited on
either would show as a recovery that long.
"""

from __future__ import annotations

import enum
import json
import random
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightkube import Client

from tests.integration.agents import (Observer, Pods, create, differing_bits, job_doc,
                                      set_status, static_run, until)
from tidal_api import parse_job

JOB = "soak"
WARMUP = 10  # steps before the first fault
SPARES = 2  # pods in standby: a switch fault on an old member leaves its joiner pending too


class SoakError(RuntimeError):
    """The soak could not go on: a fault not recovered from, a pod that failed, steps run out.
    The message says what and names the logs."""


class FaultKind(enum.StrEnum):
    """When a worker is killed."""

    STEP = "step"  # at a uniformly random moment while the whole job trains
    SWITCH = "switch"  # while a grow target is applied (SwitchMoment says when)
    SNAPSHOT = "snapshot"  # as a step ends: its boundary's snapshot exchange in flight
    LEADER = "leader"  # the leader, at a uniformly random moment while the job trains


class SwitchMoment(enum.StrEnum):
    """When in a grow a switch fault strikes: each in turn, in an order the seed shuffles."""

    WRITTEN = "written"  # the target just written: the leader has not acted on it
    ANNOUNCED = "announced"  # the leader announced it: the new world is built as a step trains
    SWITCHING = "switching"  # the old generation's last step ended: the state moves


@dataclass(frozen=True, kw_only=True, slots=True)
class SoakConfig:
    """One soak: ``faults`` faults on a job of ``workers`` pods."""

    faults: int = 1000
    seed: int = 0
    workers: int = 3
    # The job's length: WARMUP + (faults + 1) * this: the faults' pace. A recovery and the
    # replacement's grow take well under a second each, so 12 leave the job training most
    # of the time.
    steps_per_fault: int = 12
    step_window: float = 3.0  # a step fault strikes within this many steps' time
    timeout_s: float = 120.0  # the agents' --timeout (their default)
    lost_after_s: float = 5.0  # the agents' --lost-after: the backstop (their default)
    # Steps between peer snapshots (spec.checkpoint.snapshotEverySteps): every boundary, so
    # that every step's swap can be struck; None leaves the field out (the agent's default,
    # an interval chosen from the snapshots' measured cost).
    snapshot_every: int | None = 1

    def __post_init__(self) -> None:
        if self.faults < 1:
            raise ValueError(f"faults is {self.faults}: soak at least one")
        if not 3 <= self.workers <= 4:
            raise ValueError(f"workers is {self.workers}: 3 or 4 (the job's spec.workers.max is "
                             "4; with 2 a fault would leave the leader training alone every time)")
        if self.steps_per_fault < 4:
            raise ValueError(f"steps_per_fault is {self.steps_per_fault}: at least 4, room for "
                             "a replayed step, a grow and the moment a fault strikes")
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise ValueError(f"snapshot_every is {self.snapshot_every}: at least 1, or None for "
                             "the agent's default")

    @property
    def steps(self) -> int:
        return WARMUP + (self.faults + 1) * self.steps_per_fault

    def doc(self) -> dict[str, Any]:
        """The job: examples/tiny.yaml with a quarter of its tokens per step (4 micro-batches of
        2x32: a step of tens of milliseconds), long enough for every fault, with peer
        snapshots."""
        doc = job_doc(JOB, self.steps)
        doc["spec"]["model"]["seqLen"] = 32
        doc["spec"]["training"]["globalBatchSize"] = 8
        doc["spec"]["checkpoint"] = {"peerSnapshots": True}
        if self.snapshot_every is not None:
            doc["spec"]["checkpoint"]["snapshotEverySteps"] = self.snapshot_every
        parse_job(doc)  # a field this checkout's spec lacks is refused here, not pruned
        return doc


@dataclass(kw_only=True, slots=True)
class Fault:
    """One SIGKILL, and the leader's report of the recovery from it."""

    kind: FaultKind
    victim: str
    moment: SwitchMoment | None = None  # a switch fault's
    joiner: bool = False  # a switch fault's victim is the grow's joiner, not an old member
    in_switch: bool = False  # a switch fault's grow had not shown its first step yet
    after_step: int = -1  # the newest step the leader had logged done
    killed_s: float = 0.0  # since the soak began
    recovered_s: float = 0.0  # the kill to the survivors' generation in status
    recovery: dict[str, Any] = field(default_factory=dict)

    @property
    def replayed(self) -> int:
        """Steps done before the fault and done again after it."""
        return self.recovery["failed_at"] - self.recovery["resumed_at"]

    def record(self) -> dict[str, Any]:
        switch = ({"moment": self.moment.value, "joiner": self.joiner,
                   "in_switch": self.in_switch} if self.kind is FaultKind.SWITCH else {})
        return {"kind": self.kind.value, **switch, "victim": self.victim,
                "after_step": self.after_step, "killed_s": round(self.killed_s, 3),
                "failed_at": self.recovery["failed_at"],
                "resumed_at": self.recovery["resumed_at"], "replayed": self.replayed,
                "pause_s": round(self.recovery["pause_s"], 3),
                "swapping": self.recovery.get("swapping", False),
                "recovered_s": round(self.recovered_s, 3)}


@dataclass(kw_only=True, slots=True)
class SoakRun:
    """What a soak did: its job, the leader's report, the fault-free run's, every fault, and
    how long it took."""

    config: SoakConfig
    doc: dict[str, Any]
    report: dict[str, Any]
    static: dict[str, Any]
    faults: list[Fault]
    grows_s: list[float]  # a replacement's grow target written to applied in status
    wall_s: float
    stillborn: list[str]  # spares that never registered (killed and replaced, never named)

    @property
    def differs(self) -> str | None:
        """Where the soak's bits are not the fault-free run's (None: they are, every one)."""
        return differing_bits(self.report, self.static, self.config.steps)

    def summary(self) -> dict[str, Any]:
        replayed = [f.replayed for f in self.faults]
        switches = [f for f in self.faults if f.kind is FaultKind.SWITCH]
        return {
            "bitwise_equal": self.differs is None,
            "faults": len(self.faults),
            "by_kind": {kind.value: sum(f.kind is kind for f in self.faults)
                        for kind in FaultKind},
            "switch": {
                "by_moment": {m.value: sum(f.moment is m for f in switches)
                              for m in SwitchMoment},
                "joiners": sum(f.joiner for f in switches),
                "in_switch": sum(f.in_switch for f in switches),
            },
            # The leader's own snapshot swap was still under way as it failed.
            "swap_in_flight": sum(bool(f.recovery.get("swapping")) for f in self.faults),
            "replayed_steps": {"mean": statistics.fmean(replayed), "max": max(replayed),
                               "counts": {str(k): v for k, v in sorted(Counter(replayed).items())}},
            "replayed_by_kind": {
                kind.value: {"mean": statistics.fmean(r), "max": max(r)}
                for kind in FaultKind
                if (r := [f.replayed for f in self.faults if f.kind is kind])},
            # The leader's: the failure to training again.
            "pause_s": _spread([f.recovery["pause_s"] for f in self.faults]),
            # The soak's: the kill to the survivors' generation in status.
            "recover_s": _spread([f.recovered_s for f in self.faults]),
            "regrow_s": _spread(self.grows_s) if self.grows_s else None,
            "steps": self.config.steps,
            "workers": self.config.workers,
            "snapshot_every": self.config.snapshot_every,
            "wall_s": self.wall_s,
            "seconds_per_fault": self.wall_s / len(self.faults),
            "stillborn_spares": self.stillborn,
        }


def _spread(values: list[float]) -> dict[str, float]:
    """Median, 90th and 99th percentiles and maximum."""
    values = sorted(values)
    return {"median": statistics.median(values),
            "p90": values[min(len(values) - 1, int(0.9 * len(values)))],
            "p99": values[min(len(values) - 1, int(0.99 * len(values)))], "max": values[-1]}


class _LeaderLog:
    """The leader's log, read as it grows: the newest step it reports done (``step``), the
    newest generation it announced (``announced``) and the step that generation starts at
    (``starts``)."""

    _STEP = re.compile(rb"tidal\.agent INFO step +(\d+)  pp")
    _ANNOUNCED = re.compile(rb"tidal\.agent INFO step \d+: generation (\d+) .* from step (\d+)$")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.step = self.announced = self.starts = -1
        self._file = None
        self._partial = b""

    def poll(self) -> bool:
        """Read what was written since; whether a step ended meanwhile."""
        if self._file is None:
            if not self.path.exists():
                return False
            self._file = self.path.open("rb")
        chunk = self._file.read()
        if not chunk:
            return False
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        stepped = False
        for line in lines:
            if found := self._STEP.search(line):
                self.step, stepped = int(found[1]), True
            elif (found := self._ANNOUNCED.search(line)) and int(found[1]) > self.announced:
                self.announced, self.starts = int(found[1]), int(found[2])
        return stepped

    def wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll every half millisecond until ``done()``: a moment to strike at."""
        deadline = time.monotonic() + timeout_s
        self.poll()
        while not done():
            if time.monotonic() > deadline:
                raise SoakError(f"no {what} within {timeout_s:.0f} s: see {self.path}")
            time.sleep(0.0005)
            self.poll()

    def next_step(self, timeout_s: float) -> None:
        """Wait for the next step to end."""
        self.poll()
        step = self.step
        self.wait(lambda: self.step != step, timeout_s, "step's end")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class _StaticRun(threading.Thread):
    """The fault-free run of the soak's job, trained in a thread meanwhile."""

    def __init__(self, doc: dict[str, Any], steps: int) -> None:
        super().__init__(name="soak-static-run", daemon=True)
        self.doc, self.steps = doc, steps
        self.report: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.report = static_run(self.doc, self.steps)
        except BaseException as err:  # noqa: BLE001 - raised in the soak's thread by result()
            self.error = err

    def result(self, timeout_s: float) -> dict[str, Any]:
        self.join(timeout_s)
        if self.is_alive():
            raise SoakError(f"the static run of {self.steps} steps took over {timeout_s:.0f} s")
        if self.report is None:
            raise SoakError("the static run failed") from self.error
        return self.report


class FaultSoak:
    """Run one soak (:meth:`run`); ``progress`` gets a line per fault."""

    def __init__(self, config: SoakConfig, *, api: Client, kubeconfig: str, workdir: Path,
                 progress: Callable[[str], None] = lambda line: None) -> None:
        self.config, self.api, self.progress = config, api, progress
        self.doc = config.doc()
        self.rng = random.Random(config.seed)
        self.moments = self.rng.sample(list(SwitchMoment), len(SwitchMoment))
        self.pods = Pods(kubeconfig, workdir, job=JOB, report=workdir / "report.json",
                         timeout_s=config.timeout_s,
                         args=("--modeled-table", "--lost-after", str(config.lost_after_s)))
        self.observer: Observer | None = None
        self.leader_log = _LeaderLog(self.pods.log_path(self.pods.name(0)))
        self.static: _StaticRun | None = None  # started at the first fault
        self.members: tuple[str, ...] = ()  # as the status shows them
        self.pending: list[str] = []  # the newest target's joiners that are no members yet
        self.spares: list[str] = []  # started, named by no target
        self.stillborn: list[str] = []
        self.killed: set[str] = set()
        self.generation = 0  # the newest target's
        self.grow_written = 0.0  # when the newest grow target was written (monotonic)
        self.grows_s: list[float] = []
        self.faults: list[Fault] = []
        self._pods = 0  # pod indices given out
        self._store: dist.Store | None = None  # the rendezvous's, once a spare is asked for
        self._began = 0.0

    def run(self) -> SoakRun:
        config = self.config
        create(self.api, self.doc)
        self._began = time.monotonic()
        self.observer = Observer(self.api, JOB, history=False, every_s=0.02)
        try:
            self._start()
            kinds = self._schedule()
            for index in range(config.faults):
                self.faults.append(self._fault(index, self._kind(kinds, index)))
                self._replace(remaining=config.faults - index - 1)
            self._whole()
            self._finish()
        except BaseException:
            self._print_logs()
            raise
        finally:
            self.observer.stop()
            self.pods.stop()
            self.leader_log.close()
        report = json.loads(self.pods.report_of(self.members[0]).read_text())
        self._match(report["recoveries"])
        static = self.static.result(600)
        return SoakRun(config=config, doc=self.doc, report=report, static=static,
                       faults=self.faults, grows_s=self.grows_s, stillborn=self.stillborn,
                       wall_s=time.monotonic() - self._began)

    def _print_logs(self, lines: int = 15) -> None:
        """The last lines of every pod's log, for a failed soak's report (pytest shows what a
        failed test printed)."""
        for pod in self.pods.procs:
            if not self.pods.log_path(pod).exists():
                print(f"---- {pod}: no log (its process never started) ----")
                continue
            tail = self.pods.log(pod).splitlines()[-lines:]
            print(f"---- {pod} ({'killed' if pod in self.killed else 'running'}), the last "
                  f"{len(tail)} lines of its log ----", *tail, sep="\n")

    # ---- the job's pods ------------------------------------------------------------------------

    def _start_pod(self) -> str:
        self._pods += 1
        return self.pods.start(self._pods - 1)

    def _start(self) -> None:
        """Generation 0 on ``workers`` pods (its target first, as the operator writes it), and
        the spares."""
        members = [self.pods.name(i) for i in range(self.config.workers)]
        set_status(self.api, {"target": {"workers": len(members), "generation": 0,
                                         "join": members, "release": [], "reason": "Initial"}},
                   name=JOB)
        for _ in members:
            self._start_pod()
        self._stock(self.config.faults)
        self.observer.until(lambda s: s.get("members") == members, 300, "generation 0")
        self.members = tuple(members)

    def _stock(self, remaining: int) -> None:
        """Spares enough for the faults to come; none started that the job's end would find
        still starting (it could not reach the rendezvous any more)."""
        while len(self.spares) < min(SPARES, remaining):
            self.spares.append(self._start_pod())

    def _spare(self, within_s: float = 30.0) -> str:
        """The oldest spare that has registered with the rendezvous (``pod/<pod>`` in its
        store). One that has not within ``within_s`` of the ask is killed, counted and
        replaced: seen about once in 150 faults here, a forked pod that never ran its first
        line, or never got as far as registering."""
        if self._store is None:  # the job's rendezvous, as the pods see it
            self._store = dist.PrefixStore(f"{JOB}/", dist.TCPStore(
                "127.0.0.1", self.pods.port, is_master=False, timeout=timedelta(seconds=30)))
        while True:
            pod = self.spares.pop(0) if self.spares else self._start_pod()
            deadline = time.monotonic() + within_s
            while not self._store.check([f"pod/{pod}"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._store.check([f"pod/{pod}"]):
                return pod
            self.progress(f"{pod} never registered: killed and replaced")
            self.pods.kill(pod)
            self.killed.add(pod)
            self.stillborn.append(pod)

    def _finish(self) -> None:
        """Every pod not killed exits 0: the leader once the report is written, the members at
        the last step, the spares from standby, and then the rendezvous."""
        steps_left = self.config.steps - max(self.leader_log.step, 0)
        leader = self.members[0]
        last = self.pods.rendezvous
        for pod in [leader, *(p for p in self.pods.procs if p not in (leader, last)), last]:
            if pod not in self.killed and self.pods.wait(pod, 120 + steps_left) != 0:
                raise SoakError(f"{pod} failed: see {self.pods.log_path(pod)}")

    # ---- the operator's part ---------------------------------------------------------------------

    def _applied(self, status: dict[str, Any]) -> bool:
        return (status.get("generation") == self.generation
                and len(status.get("members", ())) == self.config.workers)

    def _whole(self) -> None:
        """Wait until the job is back to ``workers`` pods, in the newest target's generation."""
        status = self.observer.until(self._applied, 120, f"generation {self.generation}")
        if self.pending:
            self.grows_s.append(time.monotonic() - self.grow_written)
        self.members, self.pending = tuple(status["members"]), []

    def _replace(self, remaining: int) -> None:
        """The survivors' generation is in status: a grow target back to ``workers`` pods, with
        the joiners still pending and as many spares as that needs (not waited for)."""
        status = self.observer.latest
        self.members = tuple(status["members"])
        self.pending = [p for p in self.pending if p not in self.members and p not in self.killed]
        if self._applied(status):
            self.pending = []
            return
        missing = self.config.workers - len(self.members) - len(self.pending)
        self.pending += [self._spare() for _ in range(missing)]
        self.generation = max(self.generation, status.get("generation", 0)) + 1
        set_status(self.api, {"target": {
            "workers": self.config.workers, "generation": self.generation,
            "join": self.pending, "release": [], "reason": "LostWorker"}}, name=JOB)
        self.grow_written = time.monotonic()
        self._stock(remaining)

    def _shrink(self) -> None:
        """Release a member and write the grow that replaces it: a switch to fault, where the
        faults so far left none pending."""
        leaver = self.rng.choice(self.members[1:])
        self.progress(f"releasing {leaver}: the faults left no grow for a switch fault")
        self.generation += 1
        set_status(self.api, {"target": {
            "workers": self.config.workers - 1, "generation": self.generation, "join": [],
            "release": [leaver], "reason": "PendingGPUPods"}}, name=JOB)
        self.observer.until(lambda s: s.get("generation") == self.generation
                            and leaver not in s.get("members", ()), 120, f"{leaver} released")
        if self.pods.wait(leaver, 60) != 0:
            raise SoakError(f"{leaver}, released, failed: see {self.pods.log_path(leaver)}")
        self._replace(remaining=1)

    # ---- faults ----------------------------------------------------------------------------------

    def _schedule(self) -> list[FaultKind]:
        """As many faults of each kind as can be (the first ones in kind order), shuffled."""
        kinds = [list(FaultKind)[i % len(FaultKind)] for i in range(self.config.faults)]
        self.rng.shuffle(kinds)
        return kinds

    def _kind(self, kinds: list[FaultKind], index: int) -> FaultKind:
        """Fault ``index``'s kind. A switch fault needs a grow in flight: with none (at the
        start, or after a switch fault whose joiner the survivors took in), a later fault of
        another kind comes first, or at the end a shrink makes one."""
        if kinds[index] is FaultKind.SWITCH and not self.pending:
            later = next((j for j in range(index + 1, len(kinds))
                          if kinds[j] is not FaultKind.SWITCH), None)
            if later is None:
                self._whole()
                self._shrink()
            else:
                kinds[index], kinds[later] = kinds[later], kinds[index]
        return kinds[index]

    def _fault(self, index: int, kind: FaultKind) -> Fault:
        """Strike as ``kind`` says, then wait for the survivors' generation."""
        log = self.leader_log
        if kind is FaultKind.SWITCH:
            fault = self._in_switch()
        else:
            self._whole()
            fault = Fault(kind=kind, victim=self.members[0] if kind is FaultKind.LEADER
                          else self.rng.choice(self.members[1:]))
            delay = self.rng.uniform(0.0, self.config.step_window)  # in steps
            self._reach(WARMUP + index * self.config.steps_per_fault)
            if kind is FaultKind.SNAPSHOT:
                log.next_step(60)
            else:
                time.sleep(delay * (self.observer.latest.get("stepSeconds") or 0.1))
        self.pods.kill(fault.victim)
        killed = time.monotonic()
        self.killed.add(fault.victim)
        log.poll()
        fault.after_step, fault.killed_s = log.step, killed - self._began
        if fault.moment is not None:
            fault.in_switch = log.announced < self.generation or log.step < log.starts
        if self.static is None:  # from now on the cores wait with the survivors
            self.static = _StaticRun(self.doc, self.config.steps)
        self.observer.until(lambda s: fault.victim in s.get("lost", ())
                            and fault.victim not in s.get("members", ()),
                            2 * self.config.timeout_s + 90, f"the survivors of {fault.victim}")
        fault.recovered_s = time.monotonic() - killed
        self._follow(self.observer.latest["members"][0])
        self.progress(f"fault {index + 1}/{self.config.faults}: {kind.value}"
                      f"{f' ({fault.moment.value})' if fault.moment else ''}, killed "
                      f"{fault.victim}{' (joining)' if fault.joiner else ''} after step "
                      f"{fault.after_step}; survivors training {fault.recovered_s:.1f} s later")
        return fault

    def _follow(self, leader: str) -> None:
        """Read ``leader``'s log from now on, if another pod led before."""
        if self.leader_log.path != self.pods.log_path(leader):
            self.leader_log.close()
            self.leader_log = _LeaderLog(self.pods.log_path(leader))
            self.leader_log.poll()

    def _in_switch(self) -> Fault:
        """A switch fault's victim (the joiner or an old member) and moment, waited for."""
        moment = self.moments[sum(f.kind is FaultKind.SWITCH for f in self.faults)
                              % len(self.moments)]
        # The leader alone (a switch fault took the other old member): the joiner.
        joiner = self.rng.random() < 0.5 or len(self.members) == 1
        victim = self.rng.choice(self.pending if joiner else self.members[1:])
        log, generation = self.leader_log, self.generation
        if moment is not SwitchMoment.WRITTEN:
            log.wait(lambda: log.announced >= generation, 60, f"generation {generation}")
        if moment is SwitchMoment.SWITCHING:
            log.wait(lambda: log.step >= log.starts - 1, 60, "the old generation's last step")
        return Fault(kind=FaultKind.SWITCH, victim=victim, moment=moment, joiner=joiner)

    def _reach(self, step: int) -> None:
        """Wait until the leader has done ``step`` steps (the faults' pace); fail where the
        job has fewer than ``steps_per_fault`` steps left: its end would come first."""
        log = self.leader_log

        def reached() -> bool:
            log.poll()
            return log.step >= step

        until(reached, 300, f"step {step}")
        if log.step >= self.config.steps - self.config.steps_per_fault:
            raise SoakError(f"fault {len(self.faults) + 1} found the job at step {log.step} of "
                            f"{self.config.steps}: the faults took more steps than planned; "
                            "raise steps_per_fault")

    def _match(self, recoveries: list[dict[str, Any]]) -> None:
        """Each fault's recovery from the last leader's report (with the history the leaders
        before it kept): one per fault, losing its victim."""
        lost = [r["lost"] for r in recoveries]
        if lost != [[f.victim] for f in self.faults]:
            raise SoakError(f"the leader's recoveries lost {lost}, the soak killed "
                            f"{[f.victim for f in self.faults]}")
        for fault, recovery in zip(self.faults, recoveries, strict=True):
            fault.recovery = recovery
