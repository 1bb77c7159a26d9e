"""The event loop: one policy over one trace on a simulated clock, as a report dict.

Nodes hold 8 GPUs. Every job asks for its GPUs at submission and waits in one FIFO queue; a job
starts when its pods (8-GPU pods, and one for the remainder) all fit, best fit, and later jobs
that fit start past a head that does not (backfill without reservation). A non-elastic job holds
its GPUs for its duration. An elastic job starts at its minimum; its work is its duration at the
minimum, done at its scale-table row's speedup; a switch stops its progress for the policy's
overhead, from a step boundary: the job trains on at its old speed until then (a uniform
fraction of a step, and for tidal's scale-up one step more), and released workers hold their
GPUs until the drain after it ends (with peer snapshots, none for a hot switch whose leavers'
keepers all stay: ``tidal_plan.keepers.keepers_stay``, the agent's own rule). Queued jobs show
to ``decide`` from their arrival, in one of two forms (``SimConfig.queue``):
- ``pods``: as their pending pods, as in a cluster whose jobs create their pods at once and
  wait for the scheduler (an elastic job's labelled with it);
- ``workloads``: as the pending records of a Kueue Workload not yet admitted, as the operator
  turns one into demand (issue 39: ``kueue:<ns>/<workload>/<podset>/<i>``, no job label; an
  elastic job's minimum queues that way too, through its ``spec.queueName``), as in a cluster
  that holds its batch work in a queue before any pod exists.
Either way a queued elastic job is there as the operator sees a new one, with no member yet,
below its minimum, so the operator's own scale-down makes room for them. A third, ``hidden``,
is the Kueue cluster as the operator saw it before issue 39: a non-elastic job that queues
shows nothing until it starts, neither demand nor an arrival.

At every arrival, completion, switch end and periodic tick, the elastic policies build a
:class:`Snapshot` and apply ``tidal_operator.policy.decide`` unchanged:
- ``static``: no decisions; elastic jobs run at their minimum;
- ``greedy``: decide with no Poisson rule, gain floor or cooldown; checkpoint-restart;
- ``flextrain``: decide's Poisson rule, checkpoint-restart, a scale-down goes to the minimum;
- ``tidal``: decide's Poisson rule, the hot switch, partial scale-down.

Switch overheads (stated, per FlexTrain size small/medium/large): the hot switch 2/4/8 s,
bench/reshard.py's 0.147 s for 49.4M parameters scaled up by state size with room for
coordination; checkpoint-restart 60/120/240 s (bench/reshard.py measures 6.06 s, 41x the
hot switch, for a model far smaller than FlexTrain's; save and load grow with state).

At about 590 lines this module is over the house's 400 on purpose: ``Simulation`` is one clock
over one state (nodes, queue, running jobs, pending switches), and each handler reads and moves
all of it; split, the handlers would pass that state around or reach into each other's. The
scale tables it reads, which need none of that state, live in :mod:`tidal_sim.tables`.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from statistics import fmean

from tidal_operator.capacity import FreeGPUs
from tidal_operator.policy import Arrivals, Load, decide, scale_up_offer, start_workers
from tidal_plan.keepers import keepers_stay
from tidal_sim.config import (
    HOT_SWITCH_SECONDS,
    RESTART_SAVE_FRACTION,
    RESTART_SECONDS,
    THRESHOLDS,
    SimConfig,
)
from tidal_sim.tables import job_table, load_tables
from tidal_sim.trace import GPUS_PER_NODE, TraceJob
from tidal_operator.snapshot import ElasticJob, Node, Pod, Snapshot

@dataclass(slots=True)
class _Job:
    trace: TraceJob
    pods: list[Pod] = field(default_factory=list)  # bound pods; members in rank order
    start: float | None = None
    end: float | None = None
    # elastic only
    spec: ElasticJob | None = None  # while it queues, as the operator sees a new job
    speed: dict[int, float] = field(default_factory=dict)
    work: float = 0.0  # seconds at the minimum left
    paused_until: float = 0.0
    next_pod: int = 0
    step_s: float = 0.0  # seconds per step at the minimum: its table's first row
    switch_at: float = 0.0  # the step boundary the newest switch starts at
    before: int = 0  # the workers that train until then
    end_at: float | None = None  # the one live "end" event of an elastic job
    pending: tuple[Pod, ...] = ()  # see waiting()
    sizes: list[int] = field(default_factory=list)  # its pods' GPUs, largest first (_arrive)
    lowest: int | None = None  # start below its request: the fewest workers it runs with
    count: int = 0  # ... and the workers it starts with (what was free at its arrival)

    @property
    def key(self) -> str:
        return self.trace.job_id

    def pod_sizes(self) -> list[int]:
        if self.count:
            return [GPUS_PER_NODE] * self.count
        g = self.trace.gpus
        rest = g % GPUS_PER_NODE
        return [GPUS_PER_NODE] * (g // GPUS_PER_NODE) + ([rest] if rest else [])

    def waiting(self, queue: str) -> tuple[Pod, ...]:
        """Its demand as decide sees it while it queues (``queue``: SimConfig's), made when a
        snapshot first needs it (most jobs start as they arrive, unseen): its pending pods,
        or its Workload's pending records, one a pod of its one pod set."""
        if not self.pending:
            if queue == "workloads":
                keys, job = [f"kueue:sim/{self.key}/main/{i}" for i in range(len(self.sizes))], None
            else:
                keys = [f"{self.key}/{i}" for i in range(len(self.sizes))]
                job = self.key if self.trace.size else None
            self.pending = tuple(Pod(key, size, None, "Pending", job, created=self.trace.submit)
                                 for key, size in zip(keys, self.sizes, strict=True))
        return self.pending


class Simulation:
    """The state of one run; :meth:`run` drives it to the last completion.

    ``progress``, if given, is called now and then with the fraction of jobs finished.
    """

    def __init__(self, jobs: list[TraceJob], config: SimConfig,
                 progress: Callable[[float], None] | None = None) -> None:
        self.config = config
        self.free = {f"node-{i:04d}": GPUS_PER_NODE for i in range(config.nodes)}
        # nodes by free GPUs (index 0..8), kept with ``free``: cheap tests of what could fit
        self.nodes_with = [0] * GPUS_PER_NODE + [config.nodes]
        self.nodes = tuple(Node(n, GPUS_PER_NODE) for n in self.free)
        self.names = sorted(self.free)  # best fit's order among nodes with as many GPUs free
        self.capacity = GPUS_PER_NODE * config.nodes
        too_big = [j.job_id for j in jobs if j.gpus > self.capacity]
        if too_big:
            raise ValueError(f"jobs larger than the cluster ({config.nodes} nodes of "
                             f"{GPUS_PER_NODE} GPUs): {', '.join(too_big[:3])}; give more --nodes")
        self.tables = load_tables(config) if any(j.size for j in jobs) else {}
        self.rng = random.Random(config.seed)
        self.progress = progress
        self.jobs = [_Job(j) for j in jobs]
        self.queue: list[_Job] = []
        self.tried = 0  # the queued jobs known not to fit (_start_fitting)
        self.running: dict[str, _Job] = {}
        self.elastic: dict[str, _Job] = {}  # the running elastic jobs, in start order
        # the non-elastic arrivals so far, in time order, with their GPUs (Arrivals reads its
        # window of them by bisection, so they are never trimmed)
        self.arrivals = Arrivals([], [], ordered=True)
        self.events: list[tuple[float, int, str, str]] = []
        self.seq = 0
        self.now = 0.0
        self.last = 0.0
        self.held = 0  # GPUs held by pods
        # GPUs owed (Snapshot.owed_share): the non-elastic pods' and the running elastic
        # jobs' minimums; and their share smoothed over the window, as the operator keeps it
        self.owed = 0
        self.load = Load(0.0)
        self.busy_gpu_seconds = 0.0
        self.timeline: tuple[list[float], list[int]] = ([], [])  # (time, GPUs held) on change
        self.finished = 0
        self.scale_ups = self.scale_downs = 0
        self.released_at_once = 0  # tidal's scale-downs whose leavers left at the boundary
        self.switch_seconds = 0.0
        self.checks: list = []  # callables(sim) run after every step (tests)

    # --- events -------------------------------------------------------------------------
    def push(self, at: float, kind: str, key: str = "") -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, key))

    def run(self) -> dict:
        for job in self.jobs:
            self.push(job.trace.submit, "arrive", job.key)
        by_key = {j.key: j for j in self.jobs}
        if self.jobs:
            self.now = self.last = self.load.at = self.jobs[0].trace.submit
        elastic = self.config.policy != "static" and any(j.trace.size for j in self.jobs)
        if elastic:
            self.push(self.now + self.config.tick_seconds, "tick")
        steps = 0
        while self.events:
            at = self.events[0][0]
            self._advance(at)
            while self.events and self.events[0][0] == at:
                _, _, kind, key = heapq.heappop(self.events)
                if kind == "arrive":
                    self._arrive(by_key[key])
                elif kind == "end":
                    job = self.running.get(key)
                    if job is None or (job.spec is not None and job.end_at != at):
                        continue  # superseded by a switch
                    self._finish(job)
                elif kind == "released" and key in self.running:
                    self._released(self.running[key])
                elif kind == "tick":
                    self.push(at + self.config.tick_seconds, "tick")
            self._start_fitting()
            if elastic and self._may_decide():
                self._apply(decide(self._snapshot(), self.now))
                self._start_fitting()
            self._schedule_ends()
            self._record()
            for check in self.checks:
                check(self)
            steps += 1
            if self.progress is not None and steps % 512 == 0:
                self.progress(self.finished / len(self.jobs))
            if not self.queue and not self.running and all(e[2] == "tick" for e in self.events):
                break
        if self.progress is not None:
            self.progress(1.0)
        return self.report()

    def _advance(self, at: float) -> None:
        dt = at - self.last
        if dt > 0:
            self.busy_gpu_seconds += dt * self.held
            self.load.observe(at, self.owed / self.capacity, self.config.window_seconds)
            for job in self.elastic.values():
                job.work -= dt * self._rate(job)
        self.now = self.last = at

    def _rate(self, job: _Job) -> float:
        """An elastic job's progress (seconds at its minimum per second) from ``self.last`` to
        the next event: events fall on every switch's start and end."""
        if self.last < job.switch_at:
            return job.speed[job.before]
        if self.last < job.paused_until:
            return 0.0
        return job.speed[job.spec.workers]

    def _record(self) -> None:
        times, held = self.timeline
        if not held or held[-1] != self.held:
            times.append(self.now)
            held.append(self.held)

    def _arrive(self, job: _Job) -> None:
        if job.trace.size is None:
            if self.config.queue != "hidden":  # (hidden: seen when it starts, _start)
                self.arrivals.append(job.trace.submit, job.trace.gpus)
        elif self.config.start_below > 0 and self.config.policy != "static":
            self._start_below(job)
        job.sizes = job.pod_sizes()
        if job.trace.size:  # as the operator sees a new job: no member yet, below its minimum
            m = job.count or job.trace.gpus // GPUS_PER_NODE
            job.spec = ElasticJob(key=job.key, min_workers=m, max_workers=m, workers=0,
                                  gpus_per_worker=GPUS_PER_NODE, busy=True)
        self.queue.append(job)

    def _finish(self, job: _Job) -> None:
        job.end = self.now
        for pod in job.pods:
            self._give(pod)
        job.pods = []
        del self.running[job.key]
        if self.elastic.pop(job.key, None) is not None:
            self.owed -= job.spec.min_workers * job.spec.gpus_per_worker
        self.finished += 1

    def _take(self, pod: Pod) -> None:
        self._move(pod.node, -pod.gpus)
        self.held += pod.gpus
        if pod.job is None:
            self.owed += pod.gpus

    def _give(self, pod: Pod) -> None:
        self._move(pod.node, pod.gpus)
        self.held -= pod.gpus
        if pod.job is None:
            self.owed -= pod.gpus
        self.tried = 0  # GPUs came back: every queued job may fit (_start_fitting)

    def _move(self, node: str, gpus: int) -> None:
        """Add ``gpus`` (negative: take them) to ``node``'s free GPUs, and to its count."""
        old = self.free[node]
        self.free[node] = old + gpus
        self.nodes_with[old] -= 1
        self.nodes_with[old + gpus] += 1

    def _schedule_ends(self) -> None:
        for job in self.elastic.values():
            at = self._end_time(job)
            if at != job.end_at:
                job.end_at = at
                self.push(at, "end", job.key)

    def _end_time(self, job: _Job) -> float:
        """When an elastic job's work runs out: at its old speed until its switch starts, if
        it gets that far, else at its speed after the pause."""
        work, t = max(job.work, 0.0), self.now
        if t < job.switch_at:
            before = (job.switch_at - t) * job.speed[job.before]
            if work <= before:
                return t + work / job.speed[job.before]
            work -= before
        return max(t, job.paused_until) + work / job.speed[job.spec.workers]

    # --- placement ----------------------------------------------------------------------
    def _place(self, sizes: list[int]) -> list[str] | None:
        """Best-fit nodes for pods of ``sizes`` (largest first), or None if they do not all
        fit: each on a node with the fewest free GPUs that hold it, the first by name."""
        amounts = self._best_fit(sizes)
        if amounts is None:
            return None
        free = dict(self.free)
        chosen = []
        for size, amount in zip(sizes, amounts, strict=True):
            node = next(n for n in self.names if free[n] == amount)
            free[node] -= size
            chosen.append(node)
        return chosen

    def _best_fit(self, sizes: list[int]) -> list[int] | None:
        """The free GPUs of the node best fit puts each pod of ``sizes`` on, or None if they do
        not all fit, from the count of nodes by free GPUs alone: best fit chooses by free GPUs
        (the name only breaks ties among equals)."""
        count = self.nodes_with[:]
        amounts = []
        for size in sizes:
            for amount in range(size, GPUS_PER_NODE + 1):
                if count[amount]:
                    break
            else:
                return None
            count[amount] -= 1
            count[amount - size] += 1
            amounts.append(amount)
        return amounts

    def _start_fitting(self) -> None:
        """Start the queued jobs that fit, in queue order (backfill).

        The first ``self.tried`` failed to fit when last tried and no GPUs came back since,
        so they fail again: a job's pods are whole-node pods and one smaller, and fewer free
        GPUs leave no more whole free nodes and no node holding the smaller pod that was not
        there, or a whole free node, before. Only the jobs after them are tried."""
        waiting = self.queue[:self.tried]
        for job in self.queue[self.tried:]:
            nodes = None
            # the GPUs free in all first: most queued jobs fail there, at no cost
            if sum(job.sizes) <= self.capacity - self.held:
                nodes = self._place(job.sizes)
            if nodes is None:
                waiting.append(job)
                continue
            self._start(job, job.sizes, nodes)
        self.queue = waiting
        self.tried = len(waiting)

    def _start(self, job: _Job, sizes: list[int], nodes: list[str]) -> None:
        job.start = self.now
        for i, (size, node) in enumerate(zip(sizes, nodes, strict=True)):
            pod = Pod(f"{job.key}/{i}", size, node, "Running",
                      job.key if job.trace.size else None, created=job.trace.submit)
            self._take(pod)
            job.pods.append(pod)
        job.next_pod = len(sizes)
        self.running[job.key] = job
        if job.trace.size is None:
            if self.config.queue == "hidden":  # its pods are the first the operator sees of it
                self.arrivals.append(self.now, job.trace.gpus)
            self.push(self.now + job.trace.duration, "end", job.key)
            return
        self.elastic[job.key] = job
        request = job.trace.gpus // GPUS_PER_NODE
        m = job.count or request
        table = job_table(self.tables[job.trace.size], request, job.lowest)
        job.speed = {}
        for w in range(table.min_workers, table.max_workers + 1):
            job.speed[w] = max(r.speedup for r in table.rows if r.workers <= w)
        job.work = job.trace.duration
        job.step_s = self.tables[job.trace.size].rows[0].step_seconds
        job.before = m
        greedy = self.config.policy == "greedy"
        threshold = THRESHOLDS.get(self.config.policy, self.config.threshold)
        job.spec = ElasticJob(
            key=job.key, min_workers=table.min_workers, max_workers=table.max_workers,
            max_scale_factor=-(-table.max_workers // table.min_workers), workers=m,
            gpus_per_worker=GPUS_PER_NODE, members=tuple(p.key for p in job.pods),
            scale_table=table, switch_seconds=self._base_pause(job),
            probability_threshold=threshold,
            loaded_threshold=threshold if greedy or self.config.policy == "flextrain"
            else self.config.loaded_threshold,
            min_gain=0.0 if greedy else 0.05, cooldown_seconds=0.0 if greedy else 60.0,
        )
        self.owed += job.spec.min_workers * job.spec.gpus_per_worker

    def _start_below(self, job: _Job) -> None:
        """A job that may start below its request (``--start-below F``): its fewest workers
        ``F`` of it (at least one), its first workers what is free at its arrival, between
        those and the request, by ``decide``'s own start rule."""
        request = job.trace.gpus // GPUS_PER_NODE
        job.lowest = max(1, math.ceil(self.config.start_below * request))
        asks = ElasticJob(key=job.key, min_workers=job.lowest, max_workers=request,
                          workers=0, gpus_per_worker=GPUS_PER_NODE, preferred_workers=request)
        job.count, _ = start_workers(asks, FreeGPUs(dict(self.free)), None)

    def _base_pause(self, job: _Job) -> float:
        hot = self.config.policy == "tidal"
        table = HOT_SWITCH_SECONDS if hot else RESTART_SECONDS
        return self.config.pause_scale * table[job.trace.size]

    # --- the policy ---------------------------------------------------------------------
    def _may_decide(self) -> bool:
        """False only where ``decide`` on :meth:`_snapshot` provably returns no decision, so
        the call (most of a run's time) is skipped; nothing else changes in between.

        The proof, step by step of ``decide``. The snapshot's queued jobs are busy with no
        worker, and their pods (or Workload records) are its only unbound pods, each pending
        (a non-elastic pod, a record with no job label, or a job's below its minimum): so no
        joiner waits, and pods are pending exactly when a queued job shows (``demand``). Its running jobs are ``self.elastic``'s, busy while paused. Then:
        ``_restore`` acts only on a job below its minimum, ``_drop_stragglers`` on one with
        stragglers (``slow``), both checked here. With pods pending, ``make_room`` shrinks only
        a job that is not busy and above its minimum. With none, ``_scale_up`` places only the
        offers that :func:`~tidal_operator.policy.scale_up_offer` prices on the idle GPUs of
        the snapshot (every node may take every pod here), which it prices here the same way:
        the job as the snapshot has it (not busy), its reach (its cap, and as many more
        workers as fit on the free GPUs, each on one node: ``FreeGPUs.slots``), the arrivals
        in the window with their GPUs, the GPUs idle (the headroom's) and the smoothed share
        of GPUs owed (the threshold's: ``self.load``, the snapshot's ``load``).
        """
        demand = any(self._shows(job) for job in self.queue)
        for job in self.elastic.values():
            spec = job.spec
            if spec.workers < spec.min_workers or spec.slow:
                return True
            if job.paused_until > self.now:  # busy
                continue
            if demand:
                if spec.workers > spec.min_workers:
                    return True
                continue
            reach = min(spec.cap, spec.workers + self._slots(spec.gpus_per_worker))
            if scale_up_offer(spec, reach, self.capacity - self.held, None, self.arrivals,
                              self.config.window_seconds, self.now, self.load.share) is not None:
                return True
        return False

    def _slots(self, size: int) -> int:
        """How many pods of ``size`` GPUs fit on the free GPUs, each on one node."""
        if size == GPUS_PER_NODE:  # every elastic worker: the whole free nodes
            return self.nodes_with[GPUS_PER_NODE]
        return sum(count * (amount // size)
                   for amount, count in enumerate(self.nodes_with) if amount >= size)

    def _shows(self, job: _Job) -> bool:
        """Whether a queued job shows to decide (not where the queue hides it)."""
        return self.config.queue != "hidden" or job.trace.size is not None

    def _snapshot(self) -> Snapshot:
        pods = [p for job in self.running.values() for p in job.pods]
        for job in filter(self._shows, self.queue):
            pods += job.waiting(self.config.queue)
        jobs = []
        for job in self.elastic.values():
            busy = job.paused_until > self.now
            jobs.append(job.spec if busy == job.spec.busy else replace(job.spec, busy=busy))
        jobs += [job.spec for job in self.queue if job.spec is not None]  # (see _arrive)
        times, gpus = self.arrivals.within(self.now, self.config.window_seconds)
        return Snapshot(self.nodes, tuple(pods), tuple(jobs), tuple(times),
                        self.config.window_seconds, tuple(gpus), self.load.share)

    def _apply(self, decisions) -> None:
        for d in decisions:
            job = self.running[d.job]
            spec = job.spec
            # The pause as measured: the base overhead, spread by a lognormal of the seed's.
            pause = self._base_pause(job) * self.rng.lognormvariate(0.0, self.config.jitter)
            # It starts at a step boundary: the next one, where the agent (or a restart's
            # save) acts on the decision, but a hot scale-up one step later, its joiners' world
            # built while that step trains (tidal_agent.generations). Until then the job trains on.
            step = job.step_s / job.speed[spec.workers]
            wait = self.rng.random() * step
            if d.kind == "scale_up" and self.config.policy == "tidal":
                wait += step
            switch_at = self.now + self.config.pause_scale * wait
            releasing: tuple[str, ...] = ()
            if d.kind == "scale_up":
                for node in d.nodes:
                    pod = Pod(f"{job.key}/{job.next_pod}", GPUS_PER_NODE, node, "Running",
                              job.key, created=self.now)
                    self._take(pod)
                    job.pods.append(pod)
                    job.next_pod += 1
                to = d.to_workers
                self.scale_ups += 1
            else:
                release = set(d.release)
                to = d.to_workers
                if self.config.policy == "flextrain":  # restarts at its minimum
                    to = spec.min_workers
                    for pod in reversed(job.pods[1:]):
                        if len(release) >= spec.workers - to:
                            break
                        release.add(pod.key)
                # The released pods hold their GPUs until the drain ends (_released).
                releasing = tuple(p.key for p in job.pods if p.key in release)
                if self.config.policy != "tidal":
                    drain = RESTART_SAVE_FRACTION * pause  # the checkpoint's save
                elif self.config.peer_snapshots and keepers_stay(spec.members, releasing):
                    drain = 0.0  # the leavers go at the boundary: their keepers hold their state
                    self.released_at_once += 1
                else:
                    drain = pause  # the leavers hand their state over first
                self.push(switch_at + drain, "released", job.key)
                self.scale_downs += 1
            members = tuple(p.key for p in job.pods if p.key not in releasing)
            assert len(members) == to, (d, members)
            job.before, job.switch_at = spec.workers, switch_at
            job.paused_until = switch_at + pause
            self.push(switch_at, "switch", job.key)
            self.push(job.paused_until, "resume", job.key)
            self.switch_seconds += pause
            job.spec = replace(spec, workers=to, members=members, releasing=releasing,
                               last_scale_time=self.now, switch_seconds=pause)

    def _released(self, job: _Job) -> None:
        gone = set(job.spec.releasing)
        for pod in job.pods:
            if pod.key in gone:
                self._give(pod)
        job.pods = [p for p in job.pods if p.key not in gone]
        job.spec = replace(job.spec, releasing=())

    # --- the report ---------------------------------------------------------------------
    def report(self) -> dict:
        jct, queue = self.jct_seconds(), self.queue_seconds()
        first = min((j.trace.submit for j in self.jobs), default=0.0)
        makespan = max(self.now - first, 1e-9)
        return {
            "elastic_jobs": len(jct), "non_elastic_jobs": len(queue),
            "elastic_jct_mean_s": fmean(jct) if jct else 0.0,
            "elastic_jct_p50_s": _quantile(jct, 0.5), "elastic_jct_p99_s": _quantile(jct, 0.99),
            "queue_mean_s": fmean(queue) if queue else 0.0,
            "queue_p99_s": _quantile(queue, 0.99),
            "gpu_utilisation": self.busy_gpu_seconds / (makespan * self.capacity),
            "scale_ups": self.scale_ups, "scale_downs": self.scale_downs,
            "released_at_once": self.released_at_once,
            "switch_seconds": self.switch_seconds, "makespan_s": makespan,
        }

    def jct_seconds(self) -> list[float]:
        """Elastic jobs' completion times (end less submission), sorted."""
        return sorted(j.end - j.trace.submit for j in self.jobs if j.trace.size)

    def ceiling_speedup(self) -> float:
        """Static's mean elastic JCT over what it would be if every elastic job ran at its
        table's cap from its start: how much room the tables leave on this cluster (1.0 with
        no elastic job). Read on a finished ``static`` run, whose queue times it keeps; not a
        bound, since elasticity also shortens queues."""
        jobs = [j for j in self.jobs if j.trace.size]
        if not jobs:
            return 1.0
        at_cap = [j.start - j.trace.submit + j.trace.duration / job_table(
            self.tables[j.trace.size], j.trace.gpus // GPUS_PER_NODE).rows[-1].speedup
            for j in jobs]
        return fmean(self.jct_seconds()) / fmean(at_cap)

    def queue_seconds(self) -> list[float]:
        """Non-elastic jobs' queue times (start less submission), sorted."""
        return sorted(j.start - j.trace.submit for j in self.jobs if not j.trace.size)


def _quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile of sorted ``values`` (0 for none)."""
    if not values:
        return 0.0
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def simulate(jobs: list[TraceJob], config: SimConfig) -> dict:
    """Run ``config.policy`` over ``jobs``; the report dict of :meth:`Simulation.report`."""
    return Simulation(jobs, config).run()
