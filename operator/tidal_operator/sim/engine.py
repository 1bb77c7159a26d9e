"""The event loop: one policy over one trace on a simulated clock, as a report dict.

Nodes hold 8 GPUs. Every job asks for its GPUs at submission and waits in one FIFO queue;
a job starts when its pods (8-GPU pods, and one for the remainder) all fit, best fit, and
later jobs that fit start past a head that does not (backfill without reservation). A
non-elastic job holds its GPUs for its duration. An elastic job starts at its minimum; its
work is its duration at the minimum, done at its scale-table row's speedup; a switch stops
its progress for the policy's overhead. Queued jobs show to ``decide`` as pending pods, so
the operator's own scale-down makes room for them.

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
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import fmean

from tidal_api import ScaleTable
from tidal_api.scale import ScaleRow
from tidal_operator.policy import decide
from tidal_operator.sim.trace import GPUS_PER_NODE, TraceJob
from tidal_operator.snapshot import ElasticJob, Node, Pod, Snapshot

POLICIES = ("static", "greedy", "flextrain", "tidal")
HOT_SWITCH_SECONDS = {"small": 2.0, "medium": 4.0, "large": 8.0}
RESTART_SECONDS = {"small": 60.0, "medium": 120.0, "large": 240.0}
_TABLES = Path(__file__).resolve().parents[3] / "examples" / "scale-tables"


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """One run: the policy, the scale tables (``pp`` or ``dp-pp``), cluster and tick."""

    policy: str
    nodes: int
    elastic: str = "pp"
    tick_seconds: float = 600.0
    window_seconds: float = 28800.0
    tables_dir: Path = _TABLES

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        if self.elastic not in ("pp", "dp-pp"):
            raise ValueError(f"elastic must be pp or dp-pp, got {self.elastic!r}")
        if self.nodes < 1 or self.tick_seconds <= 0:
            raise ValueError("need nodes >= 1 and tick_seconds > 0")


def load_tables(config: SimConfig) -> dict[str, ScaleTable]:
    return {size: ScaleTable.model_validate_json(
        (config.tables_dir / f"flextrain-{size}-{config.elastic}.json").read_text())
        for size in ("small", "medium", "large")}


def job_table(table: ScaleTable, min_workers: int) -> ScaleTable:
    """``table``'s speedups over a job whose minimum is ``min_workers`` 8-GPU workers: each
    row's worker count scaled by ``min_workers / table.min_workers``, rounded up, and where
    rows land on one count the smallest's speedup (the conservative one); tokens/s is the
    speedup. Built unvalidated: decide reads only rows' workers and tokens/s."""
    best: dict[int, float] = {}
    for row in table.rows:
        w = max(min_workers, math.ceil(row.workers * min_workers / table.min_workers))
        best.setdefault(w, row.speedup)
    rows, top = [], 0.0
    for w in sorted(best):
        if best[w] > top:
            top = best[w]
            rows.append(ScaleRow.model_construct(workers=w, tokens_per_second=top, speedup=top))
    return ScaleTable.model_construct(job=table.job, min_workers=min_workers,
                                      max_workers=rows[-1].workers,
                                      gpus_per_worker=GPUS_PER_NODE, rows=tuple(rows))


@dataclass(slots=True)
class _Job:
    trace: TraceJob
    pods: list[Pod] = field(default_factory=list)  # bound pods; members in rank order
    start: float | None = None
    end: float | None = None
    # elastic only
    spec: ElasticJob | None = None
    speed: dict[int, float] = field(default_factory=dict)
    work: float = 0.0  # seconds at the minimum left
    paused_until: float = 0.0
    next_pod: int = 0
    end_at: float | None = None  # the one live "end" event of an elastic job

    @property
    def key(self) -> str:
        return self.trace.job_id

    def pod_sizes(self) -> list[int]:
        g = self.trace.gpus
        rest = g % GPUS_PER_NODE
        return [GPUS_PER_NODE] * (g // GPUS_PER_NODE) + ([rest] if rest else [])

    def rate(self, now: float) -> float:
        if self.paused_until > now:
            return 0.0
        return self.speed[self.spec.workers]


class Simulation:
    """The state of one run; :meth:`run` drives it to the last completion."""

    def __init__(self, jobs: list[TraceJob], config: SimConfig) -> None:
        self.config = config
        self.free = {f"node-{i:04d}": GPUS_PER_NODE for i in range(config.nodes)}
        self.nodes = tuple(Node(n, GPUS_PER_NODE) for n in self.free)
        too_big = [j.job_id for j in jobs if j.gpus > GPUS_PER_NODE * config.nodes]
        if too_big:
            raise ValueError(f"jobs larger than the cluster ({config.nodes} nodes): {too_big[:3]}")
        self.tables = load_tables(config) if any(j.size for j in jobs) else {}
        self.jobs = [_Job(j) for j in jobs]
        self.queue: list[_Job] = []
        self.running: dict[str, _Job] = {}
        self.arrivals: deque[float] = deque()
        self.events: list[tuple[float, int, str, str]] = []
        self.seq = 0
        self.now = 0.0
        self.last = 0.0
        self.busy_gpu_seconds = 0.0
        self.scale_ups = self.scale_downs = 0
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
            self.now = self.last = self.jobs[0].trace.submit
        elastic = self.config.policy != "static" and any(j.trace.size for j in self.jobs)
        if elastic:
            self.push(self.now + self.config.tick_seconds, "tick")
        while self.events:
            at = self.events[0][0]
            self._advance(at)
            acted = False
            while self.events and self.events[0][0] == at:
                _, _, kind, key = heapq.heappop(self.events)
                if kind == "arrive":
                    self._arrive(by_key[key])
                elif kind == "end":
                    job = self.running.get(key)
                    if job is None or (job.spec is not None and job.end_at != at):
                        continue  # superseded by a switch
                    self._finish(job)
                elif kind == "tick":
                    self.push(at + self.config.tick_seconds, "tick")
                acted = True
            if not acted:
                continue
            self._start_fitting()
            if elastic:
                self._apply(decide(self._snapshot(), self.now))
                self._start_fitting()
            self._schedule_ends()
            for check in self.checks:
                check(self)
            if not self.queue and not self.running and all(e[2] == "tick" for e in self.events):
                break
        return self.report()

    def _advance(self, at: float) -> None:
        dt = at - self.last
        if dt > 0:
            held = GPUS_PER_NODE * len(self.free) - sum(self.free.values())
            self.busy_gpu_seconds += dt * held
            for job in self.running.values():
                if job.spec is not None and job.paused_until <= self.last:
                    job.work -= dt * job.speed[job.spec.workers]
        self.now = self.last = at

    def _arrive(self, job: _Job) -> None:
        if job.trace.size is None:
            self.arrivals.append(job.trace.submit)
        self.queue.append(job)

    def _finish(self, job: _Job) -> None:
        job.end = self.now
        for pod in job.pods:
            self.free[pod.node] += pod.gpus
        job.pods = []
        del self.running[job.key]

    def _schedule_ends(self) -> None:
        for job in self.running.values():
            if job.spec is None:
                continue
            start = max(self.now, job.paused_until)
            at = start + max(job.work, 0.0) / job.speed[job.spec.workers]
            if at != job.end_at:
                job.end_at = at
                self.push(at, "end", job.key)

    # --- placement ----------------------------------------------------------------------
    def _place(self, sizes: list[int]) -> list[str] | None:
        """Best-fit nodes for pods of ``sizes`` (largest first), or None if they do not all fit."""
        free = dict(self.free)
        chosen = []
        for size in sizes:
            fits = [(g, n) for n, g in free.items() if g >= size]
            if not fits:
                return None
            _, node = min(fits)
            free[node] -= size
            chosen.append(node)
        return chosen

    def _start_fitting(self) -> None:
        waiting = []
        for job in self.queue:
            sizes = job.pod_sizes()
            nodes = self._place(sizes)
            if nodes is None:
                waiting.append(job)
                continue
            self._start(job, sizes, nodes)
        self.queue = waiting

    def _start(self, job: _Job, sizes: list[int], nodes: list[str]) -> None:
        job.start = self.now
        for i, (size, node) in enumerate(zip(sizes, nodes, strict=True)):
            self.free[node] -= size
            job.pods.append(Pod(f"{job.key}/{i}", size, node, "Running",
                                job.key if job.trace.size else None, created=job.trace.submit))
        job.next_pod = len(sizes)
        self.running[job.key] = job
        if job.trace.size is None:
            self.push(self.now + job.trace.duration, "end", job.key)
            return
        m = job.trace.gpus // GPUS_PER_NODE
        table = job_table(self.tables[job.trace.size], m)
        job.speed = {}
        rows = list(table.rows)
        for w in range(m, table.max_workers + 1):
            job.speed[w] = max(r.speedup for r in rows if r.workers <= w)
        job.work = job.trace.duration
        policy = self.config.policy
        hot = policy == "tidal"
        overhead = (HOT_SWITCH_SECONDS if hot else RESTART_SECONDS)[job.trace.size]
        greedy = policy == "greedy"
        job.spec = ElasticJob(
            key=job.key, min_workers=m, max_workers=table.max_workers, workers=m,
            gpus_per_worker=GPUS_PER_NODE, members=tuple(p.key for p in job.pods),
            scale_table=table, switch_seconds=overhead,
            probability_threshold=0.0 if greedy else 0.6,
            min_gain=0.0 if greedy else 0.05, cooldown_seconds=0.0 if greedy else 60.0,
        )

    # --- the policy ---------------------------------------------------------------------
    def _snapshot(self) -> Snapshot:
        while self.arrivals and self.arrivals[0] < self.now - self.config.window_seconds:
            self.arrivals.popleft()
        pods = [p for job in self.running.values() for p in job.pods]
        for job in self.queue:
            pods += [Pod(f"{job.key}/{i}", size, None, "Pending", None, created=job.trace.submit)
                     for i, size in enumerate(job.pod_sizes())]
        jobs = []
        for job in self.running.values():
            if job.spec is not None:
                busy = job.paused_until > self.now
                jobs.append(job.spec if busy == job.spec.busy else replace(job.spec, busy=busy))
        return Snapshot(self.nodes, tuple(pods), tuple(jobs), tuple(self.arrivals),
                        self.config.window_seconds)

    def _apply(self, decisions) -> None:
        for d in decisions:
            job = self.running[d.job]
            spec = job.spec
            if d.kind == "scale_up":
                for node in d.nodes:
                    self.free[node] -= GPUS_PER_NODE
                    job.pods.append(Pod(f"{job.key}/{job.next_pod}", GPUS_PER_NODE, node,
                                        "Running", job.key, created=self.now))
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
                for pod in job.pods:
                    if pod.key in release:
                        self.free[pod.node] += pod.gpus
                job.pods = [p for p in job.pods if p.key not in release]
                self.scale_downs += 1
            assert len(job.pods) == to, (d, len(job.pods))
            job.paused_until = self.now + spec.switch_seconds
            self.push(job.paused_until, "resume", job.key)
            self.switch_seconds += spec.switch_seconds
            job.spec = replace(spec, workers=to, members=tuple(p.key for p in job.pods),
                               last_scale_time=self.now)

    # --- the report ---------------------------------------------------------------------
    def report(self) -> dict:
        elastic = [j for j in self.jobs if j.trace.size]
        rigid = [j for j in self.jobs if not j.trace.size]
        jct = sorted(j.end - j.trace.submit for j in elastic)
        queue = sorted(j.start - j.trace.submit for j in rigid)
        first = min((j.trace.submit for j in self.jobs), default=0.0)
        makespan = max(self.now - first, 1e-9)
        return {
            "elastic_jobs": len(elastic), "non_elastic_jobs": len(rigid),
            "elastic_jct_mean_s": fmean(jct) if jct else 0.0,
            "elastic_jct_p50_s": _quantile(jct, 0.5), "elastic_jct_p99_s": _quantile(jct, 0.99),
            "queue_mean_s": fmean(queue) if queue else 0.0,
            "queue_p99_s": _quantile(queue, 0.99),
            "gpu_utilisation": self.busy_gpu_seconds / (makespan * GPUS_PER_NODE * len(self.free)),
            "scale_ups": self.scale_ups, "scale_downs": self.scale_downs,
            "switch_seconds": self.switch_seconds, "makespan_s": makespan,
        }


def _quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile of sorted ``values`` (0 for none)."""
    if not values:
        return 0.0
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def simulate(jobs: list[TraceJob], config: SimConfig) -> dict:
    """Run ``config.policy`` over ``jobs``; the report dict of :meth:`Simulation.report`."""
    return Simulation(jobs, config).run()


def compare(jobs: list[TraceJob], nodes: int, policies=POLICIES, elastic: str = "pp") -> dict:
    """Every policy over ``jobs``, with static's figures as the baseline of the ratios."""
    runs = {p: simulate(jobs, SimConfig(policy=p, nodes=nodes, elastic=elastic))
            for p in dict.fromkeys(("static", *policies))}
    base = runs["static"]
    out = {}
    for p in policies:
        r = dict(runs[p])
        r["jct_speedup"] = base["elastic_jct_mean_s"] / r["elastic_jct_mean_s"] \
            if r["elastic_jct_mean_s"] else 1.0
        r["queue_ratio"] = r["queue_mean_s"] / base["queue_mean_s"] if base["queue_mean_s"] else \
            (1.0 if r["queue_mean_s"] == 0 else math.inf)
        out[p] = r
    return out

