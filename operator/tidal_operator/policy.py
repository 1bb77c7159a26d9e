"""The scaling policy of DESIGN.md section 4, as one pure function: ``decide(snapshot, now)``.

No I/O and no clock: the same snapshot and ``now`` give the same decisions, whatever the order
of the records in the snapshot (ties go to the node name, the job key, the pod key).

Idle GPUs are a node's GPUs less those of the unfinished pods bound to it. Pods that ask for
GPUs, have no node and have not finished are *pending* if they are non-elastic (no
``tidal.dev/job``) or the pods of an elastic job below its minimum: a new job's first pods, or a
lost worker's replacement. A job's minimum is what it was admitted with, owed like any other
pod's GPUs; only the workers above it are idle GPUs lent.

**Scale down** when pods are pending (see :func:`tidal_operator.scale_down.make_room`): in
FIFO order, each pending pod that does not fit on a node's free GPUs gets room on one node,
from the elastic workers there whose jobs lose the least throughput, each job shrinking only to
a kept scale-table row, never below its minimum, never releasing its leader. The GPUs of pods
an outstanding target already releases count as free, so a pod waiting for a drain does not
cost a second job.

**Start** first (see :func:`_start`): a new job (no target yet) gets its preferred count of
workers where they fit on free GPUs, else what fits, never below its minimum.

**Restore** first too (see :func:`_restore`): a job that a fault left below its minimum gets new
workers back to it, whatever else is pending, idle or due: the minimum is what the job was
admitted with, and the GPUs of its lost pods were its own. New workers that find no free GPUs
are pending pods like any other: the scale-down makes room for them.

**Drop a straggler** where its job's agent asks (see :func:`_drop_stragglers`), when no pod is
pending: a scale-down releasing it, by the scale-down's rules.

**Scale up** only when no pod is pending, GPUs are idle and no elastic worker pod waits for a
node (GPUs promised to a joiner are not counted twice), first to the job whose completion time
gains most per GPU, leaving the last free GPUs where an arrival that needs them is likely
within the release latency (the headroom); see :func:`_scale_up` and :func:`_headroom`. Both
price their bets at the job's threshold for how loaded the cluster has been
(:func:`threshold_at`).

Both count only the nodes a pod may run on (:class:`~tidal_operator.snapshot.Placement`: its
node selector, and tolerations for the nodes' NoSchedule and NoExecute taints): a job's new
workers go where its pods may, and GPUs are freed for a pending pod only where it may run.
"""

from __future__ import annotations

import gc
import heapq
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from tidal_operator.capacity import FreeGPUs, Rows, Where, place, placed
from tidal_operator.scale_down import Shrinkable, make_room
from tidal_operator.snapshot import FINISHED_PHASES, ElasticJob, Pod, Snapshot

IDLE_GPUS = "IdleGPUs"
PENDING_GPU_PODS = "PendingGPUPods"
BELOW_MINIMUM = "BelowMinimum"
STRAGGLER = "Straggler"
STARTED = "Initial"
# The risk a scale-up may take per unit of share / (1 - share) of the GPUs owed (threshold_at)
QUEUE_RISK = 0.06


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """One change of one job's worker count, with the numbers behind it.

    ``release`` (scale down) names the member pods to drain, never ``members[0]``;
    ``room_for`` pairs each pending pod the release makes room for with the node it will fit
    on. ``nodes`` (scale up) is the node chosen for each new worker. ``gain`` is the relative
    change of tokens/s the scale table predicts (negative for a scale down); ``probability``
    is the Poisson rule's chance that the idle window pays for the switches (scale up).
    """

    job: str
    kind: Literal["start", "scale_up", "scale_down"]
    from_workers: int
    to_workers: int
    reason: str
    message: str
    release: tuple[str, ...] = ()
    room_for: tuple[tuple[str, str], ...] = ()
    nodes: tuple[str, ...] = ()
    probability: float | None = None
    gain: float | None = None


def decide(snapshot: Snapshot, now: float) -> tuple[Decision, ...]:
    """The scale decisions for ``snapshot`` at ``now`` (epoch seconds), at most one per job."""
    with collector_paused():
        return _decide(snapshot, now)


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector held off for the block, then as it was. A decision at
    10,000 nodes makes tens of thousands of short-lived objects just after the snapshot's
    hundred thousand: left on, the collector runs 40-50 passes inside the call, some of them
    over the whole snapshot (150-200 ms each, docs/benchmarks.md). What a decision leaves
    is freed by reference counting; the collector's next pass, after it, finds the rest."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _decide(snapshot: Snapshot, now: float) -> tuple[Decision, ...]:
    free = {node.name: node.gpus for node in snapshot.nodes}
    pending, workers, joiner_unbound = _tally(snapshot, free)
    where = Where(snapshot)
    # A restored job is below its minimum, which no scale-down goes under; its new workers
    # are yet to be bound, and no scale-up runs while a joiner waits for its node.
    restored = _start(snapshot, free, where) + _restore(snapshot, free, where)
    if pending:
        shrunk = make_room(snapshot, free, pending, workers, where)
        return restored + tuple(_released(job) for job in shrunk)
    if joiner_unbound or restored:
        return restored
    dropped = _drop_stragglers(snapshot)
    busy = {d.job for d in dropped}
    grown = _scale_up(snapshot, FreeGPUs(free), now, where, skip=busy)
    return dropped + grown


def _tally(snapshot: Snapshot, free: dict[str, int]) -> tuple[list[Pod], dict[str, Pod], bool]:
    """Take the GPUs of the unfinished pods bound to a node out of ``free``. Returns the
    pending pods, the bound unfinished elastic worker pods by key, and whether a scale-up's
    pod waits for its node (its GPUs are promised). The loop over every pod: locals only."""
    below = {job.key for job in snapshot.jobs if job.workers < job.min_workers}
    pending: list[Pod] = []
    workers: dict[str, Pod] = {}
    joiner_unbound = False
    finished = FINISHED_PHASES
    for pod in snapshot.pods:
        gpus = pod.gpus
        if gpus <= 0 or pod.phase in finished:
            continue
        node = pod.node
        if node is None:
            if pod.job is None or pod.job in below:
                pending.append(pod)
            else:
                joiner_unbound = True
        elif node in free:
            free[node] -= gpus
            if pod.job is not None:
                workers[pod.key] = pod
    return pending, workers, joiner_unbound


def start_workers(job: ElasticJob, free: FreeGPUs, allowed: frozenset[str] | None
                  ) -> tuple[int, list[str]]:
    """A new job's first workers: its preferred count where that many fit on the free GPUs,
    else what fits, never below its minimum (the rest wait for GPUs, pending pods that the
    scale-down makes room for); and the nodes of those that fit, taken out of ``free``."""
    nodes = place(free, job.preferred, job.gpus_per_worker, allowed)
    return max(job.min_workers, len(nodes)), nodes


def _start(snapshot: Snapshot, free: dict[str, int], where: Where) -> tuple[Decision, ...]:
    """The first workers of each new job (no target yet), by key: see :func:`start_workers`.
    Neither the Poisson rule nor the cooldown applies: the minimum is owed, and the workers
    above it are what its owner asked for, on GPUs no pod waits for."""
    decisions = []
    gpus = None
    for job in sorted(snapshot.jobs, key=lambda j: j.key):
        if not job.unstarted:
            continue
        gpus = gpus or FreeGPUs(free)  # takes the GPUs it places out of ``free``
        count, nodes = start_workers(job, gpus, where(job.placement))
        below = f", {job.preferred - count} below its preferred {job.preferred}" if (
            count < job.preferred) else ""
        decisions.append(Decision(
            job=job.key, kind="start", from_workers=0, to_workers=count, reason=STARTED,
            nodes=tuple(nodes),
            message=f"{count} workers{below}: {len(nodes)} fit on free GPUs"
                    + (f" ({placed(nodes)})" if nodes else ""),
        ))
    return tuple(decisions)


def _restore(snapshot: Snapshot, free: dict[str, int], where: Where) -> tuple[Decision, ...]:
    """Back to its minimum, each job that runs below it (after a lost worker, or a raised
    ``workers.min``), fewest workers first.

    Neither the Poisson rule, the gain floor, the cooldown nor ``enabled`` applies: replacing a
    lost worker is not elasticity. The new workers take free GPUs where they fit (best fit,
    ``nodes``); the rest are created anyway and wait for GPUs, pending pods that the next
    rounds' scale-downs make room for. A busy job (a target outstanding) is left alone: its
    target comes first.
    """
    decisions = []
    gpus = None
    below = [job for job in snapshot.jobs if not job.busy and 0 < job.workers < job.min_workers]
    for job in sorted(below, key=lambda j: (j.workers, j.key)):
        gpus = gpus or FreeGPUs(free)  # takes the GPUs it places out of ``free``
        count = job.min_workers - job.workers
        nodes = place(gpus, count, job.gpus_per_worker, where(job.placement))
        waiting = count - len(nodes)
        decisions.append(Decision(
            job=job.key, kind="scale_up", from_workers=job.workers, to_workers=job.min_workers,
            reason=BELOW_MINIMUM, nodes=tuple(nodes),
            message=(f"below its minimum ({job.workers} of {job.min_workers} workers): "
                     f"{count} new workers"
                     + (f" on {placed(nodes)}" if nodes else "")
                     + (f", {waiting} waiting for GPUs" if waiting else "")),
        ))
    return tuple(decisions)


def _drop_stragglers(snapshot: Snapshot) -> tuple[Decision, ...]:
    """Release the stragglers the agents ask to drop (``status.stragglers[].release``: the
    agent predicts that the pipeline without one is faster than the one re-planned around
    it), one per job and round, through the normal scale-down: never the leader, never below
    the minimum, only to a worker count the scale table keeps. A busy job waits."""
    decisions = []
    for job in sorted((job for job in snapshot.jobs if job.slow), key=lambda j: j.key):
        slow = [m for m in job.slow if m in job.members[1:]]
        if job.busy or not slow or job.workers - 1 < job.min_workers or job.scale_table is None:
            continue
        rows = Rows.of(job.scale_table)
        if job.workers - 1 not in rows.workers or rows.at_most(job.workers) < 0:
            continue
        # The table's figures assume equal workers: what the job would lose without a straggler.
        table_gain = rows.tps[rows.workers.index(job.workers - 1)] / rows.tps[
            rows.at_most(job.workers)] - 1
        decisions.append(Decision(
            job=job.key, kind="scale_down", from_workers=job.workers,
            to_workers=job.workers - 1, reason=STRAGGLER, release=(slow[0],), gain=table_gain,
            message=(f"{slow[0]} is a straggler that the agent predicts the job runs faster "
                     f"without: releasing it, {job.workers} -> {job.workers - 1} workers "
                     f"({table_gain:+.1%} tokens/s by the table, which assumes equal workers)"),
        ))
    return tuple(decisions)


def arrival_rate(arrivals: list[float], now: float, window: float) -> float:
    """Non-elastic arrivals per second over ``[now - window, now]``; ``arrivals`` sorted."""
    return (bisect_right(arrivals, now) - bisect_left(arrivals, now - window)) / window


class Arrivals:
    """Non-elastic arrivals in time order, with their GPUs: the Poisson rule's rate, and the
    rate of those that would not fit in what a scale-up leaves free."""

    __slots__ = ("times", "gpus", "_sizes")

    def __init__(self, times: Sequence[float], gpus: Sequence[int] = (), *,
                 ordered: bool = False) -> None:
        """``gpus`` empty: unknown, each the least a GPU pod asks for (one). ``ordered``: the
        times are sorted already, and the lists are kept as they are (and may grow)."""
        gpus = gpus or [1] * len(times)
        if ordered:
            self.times, self.gpus = times, gpus
        else:
            pairs = sorted(zip(times, gpus, strict=True))
            self.times, self.gpus = [t for t, _ in pairs], [g for _, g in pairs]
        self._sizes: dict[tuple[float, float], list[int]] = {}

    def append(self, time: float, gpus: int) -> None:
        """One more arrival, no earlier than the others."""
        self.times.append(time)
        self.gpus.append(gpus)
        self._sizes.clear()

    def within(self, now: float, window: float) -> tuple[Sequence[float], Sequence[int]]:
        """The times and GPUs of the arrivals over ``[now - window, now]``."""
        first, end = bisect_left(self.times, now - window), bisect_right(self.times, now)
        return self.times[first:end], self.gpus[first:end]

    def rate(self, now: float, window: float) -> float:
        return arrival_rate(self.times, now, window)

    def sizes(self, now: float, window: float) -> list[int]:
        """The GPUs of the arrivals over the window, in increasing order."""
        key = (now, window)
        if key not in self._sizes:
            if len(self._sizes) > 64:  # a long-lived one (the simulator's) moves on in time
                self._sizes.clear()
            self._sizes[key] = sorted(self.within(now, window)[1])
        return self._sizes[key]

    def rate_needing(self, left: int, idle: int, now: float, window: float) -> float:
        """Arrivals per second over the window that the ``idle`` GPUs would hold and the
        ``left`` of them would not: more than ``left`` GPUs, at most ``idle``."""
        sizes = self.sizes(now, window)
        return (bisect_right(sizes, idle) - bisect_right(sizes, left)) / window


def _scale_up(snapshot: Snapshot, free: FreeGPUs, now: float,
              where: Where, skip: frozenset[str] | set[str] = frozenset()) -> tuple[Decision, ...]:
    """Give idle GPUs first to the job whose predicted completion time gains most per GPU
    (per second it holds it: :class:`Offer`).

    Each job's offer (:func:`scale_up_offer`) is priced on the GPUs idle now; the best per
    GPU is priced again on what is left when its turn comes (the jobs before it took GPUs) and
    placed if it is still the best, else put back in its place (a lazy greedy: a job whose
    best row no longer fits may still want a smaller one). Ties go to the fewest workers, then
    the key. A job takes one row per round; its new workers leave the pool for the jobs after
    it. The free GPUs reach an offer only through the most workers it could have (``reach``)
    and the GPUs idle (the headroom's): an offer whose reach is unchanged and whose GPUs idle
    are unchanged, or still at least its ``steady``, is priced again to the same offer, so it
    is kept.
    """
    if free.idle <= 0:
        return ()
    arrivals = Arrivals(snapshot.arrivals, snapshot.arrival_gpus)

    def offer(job: ElasticJob, stale: Offer | None = None) -> Offer | None:
        allowed = where(job.placement)
        reach = min(job.cap, job.workers + free.slots(job.gpus_per_worker, allowed))
        if stale is not None and stale.reach == reach and (
                stale.idle == free.idle or free.idle >= stale.steady):
            return stale
        return scale_up_offer(job, reach, free.idle, allowed, arrivals, snapshot.window_seconds,
                              now, snapshot.load)

    queue = [o.rank() for job in snapshot.jobs
             if job.key not in skip and (o := offer(job)) is not None]
    heapq.heapify(queue)
    decisions = []
    while queue and free.idle > 0:
        stale = heapq.heappop(queue)[-1]
        fresh = offer(stale.job, stale)
        if fresh is None:
            continue
        if queue and fresh.rank() > queue[0]:
            heapq.heappush(queue, fresh.rank())
            continue
        decisions.append(fresh.take(free))
    return tuple(decisions)


@dataclass(frozen=True, slots=True)
class Offer:
    """A job's best scale-up on the idle GPUs as they are: its row and what it is worth.

    ``per_gpu`` is the completion time it saves per second of each GPU it adds: a job with
    ``W`` seconds of work left at tokens/s ``s`` that grows to ``s'`` finishes ``W (1/s -
    1/s')`` sooner and holds the new GPUs ``W / s'``, so it saves ``(s'/s - 1)`` per added
    GPU-second, the gain over the GPUs, whatever ``W`` (FlexTrain's cluster simulations:
    1.644x PP and 1.999x DP+PP this way, 1.640x and 1.976x by the seconds saved per GPU)."""

    job: ElasticJob
    allowed: frozenset[str] | None
    reach: int  # the most workers the idle GPUs allowed it when priced (scale_up_offer)
    idle: int  # the GPUs idle when priced
    # With as many GPUs idle or more (and the same reach), the headroom passes the same row:
    # its new workers and the largest arrival of the window fit (inf: the headroom cut it).
    steady: float
    to_workers: int
    gain: float  # tokens/s over the current row's, less one
    per_gpu: float
    probability: float
    threshold: float  # the job's at the cluster's load (threshold_at)
    rate: float  # non-elastic arrivals per second
    overhead: float

    def rank(self) -> tuple[float, int, str, Offer]:
        """The order of the offers: most saved per GPU first, then fewest workers, the key."""
        return (-self.per_gpu, self.job.workers, self.job.key, self)

    def take(self, free: FreeGPUs) -> Decision:
        """The decision, its new workers placed on (and taken out of) ``free``."""
        job, idle = self.job, free.idle
        nodes = place(free, self.to_workers - job.workers, job.gpus_per_worker, self.allowed)
        assert len(nodes) == self.to_workers - job.workers, \
            "slots() counted places tightest() cannot find"
        return Decision(
            job=job.key, kind="scale_up", from_workers=job.workers, to_workers=self.to_workers,
            reason=IDLE_GPUS, nodes=tuple(nodes), probability=self.probability, gain=self.gain,
            message=(
                f"{idle} GPUs idle and no GPU pod pending: {len(nodes)} new workers on "
                f"{placed(nodes)}, {self.gain:+.1%} tokens/s; P(idle window outlasts "
                f"{self.overhead:.3g} s of switching) = {self.probability:.2f} > "
                f"{self.threshold:.2f} at {self.rate * 3600:.2f} arrivals/h"
            ),
        )


def scale_up_offer(job: ElasticJob, reach: int, idle: int, allowed: frozenset[str] | None,
                   arrivals: Arrivals, window: float, now: float, load: float = 0.0
                   ) -> Offer | None:
    """The job's scale-up, or None. The rows above its count up to ``reach`` (its cap,
    maxWorkers and maxScaleFactor x minWorkers, and as far as new workers fit on the idle GPUs
    of the nodes its placement allows, each worker on one node, best fit) are the candidates;
    it takes the one with the most tokens/s, the largest gain ``g`` over its current row. That
    row must gain at least ``minGain`` and pass the Poisson rule: non-elastic pods arrive at
    rate ``r`` (counted over the job's arrival window, else the snapshot's), so the idle window
    ``T`` is exponential and the scale-up pays when ``g x T > overhead``, with probability
    ``P = exp(-r x overhead / g)``, which must exceed the threshold (``probabilityThreshold``
    at the cluster's smoothed ``load``: :func:`threshold_at`). The overhead is
    *two* switches, ``2 x switch_seconds``: the window ends with the arrival that takes the
    GPUs back, and that scale-down pauses the job as long as this scale-up does. ``P`` and the
    gain both grow with throughput, so no smaller candidate passes where the chosen one fails.
    """
    if not job.enabled or job.busy or job.scale_table is None or reach <= job.workers:
        return None
    if job.last_scale_time is not None and now - job.last_scale_time < job.cooldown_seconds:
        return None
    rows = Rows.of(job.scale_table)
    here = rows.at_most(job.workers)
    first = bisect_right(rows.workers, job.workers)
    last = rows.at_most(reach)
    if here < 0 or last < first:
        return None
    window = job.arrival_window_seconds or window
    threshold = threshold_at(job, load)
    top = last
    last = _headroom(job, rows, first, last, idle, arrivals, now, window, threshold)
    if last < first:
        return None
    steady = math.inf
    if last == top:
        sizes = arrivals.sizes(now, window)
        steady = (rows.workers[last] - job.workers) * job.gpus_per_worker + (
            sizes[-1] if sizes else 0)
    # the most tokens/s, the fewest workers among equals
    best = rows.tps.index(max(rows.tps[first:last + 1]), first)
    gain = rows.tps[best] / rows.tps[here] - 1
    if gain <= 0 or gain < job.min_gain:
        return None
    rate = arrivals.rate(now, window)
    overhead = 2 * job.switch_seconds
    probability = math.exp(-rate * overhead / gain)
    if probability <= threshold:
        return None
    per_gpu = gain / ((rows.workers[best] - job.workers) * job.gpus_per_worker)
    return Offer(job=job, allowed=allowed, reach=reach, idle=idle, steady=steady,
                 to_workers=rows.workers[best], gain=gain, per_gpu=per_gpu,
                 probability=probability, threshold=threshold, rate=rate, overhead=overhead)


def _headroom(job: ElasticJob, rows: Rows, first: int, last: int, idle: int,
              arrivals: Arrivals, now: float, window: float, threshold: float) -> int:
    """The last candidate row that leaves enough GPUs free. A scale-up does not take the last
    free GPUs where a non-elastic arrival that needs them is likely within the release latency
    (the wait for the job's step boundary, at most a step, then the drain, a switch), priced as
    the scale-up rule prices its window: the arrivals are Poisson at the rate over the job's
    window, counting only those that the idle GPUs would hold and what the row leaves free
    would not, and ``P(none within the latency) = exp(-rate x latency)`` must exceed
    ``threshold``. (An arrival of unknown size counts as one GPU, the least.)"""
    latency = rows.step_s[rows.at_most(job.workers)] + job.switch_seconds
    while last >= first:
        left = idle - (rows.workers[last] - job.workers) * job.gpus_per_worker
        rate = arrivals.rate_needing(left, idle, now, window)
        if math.exp(-rate * latency) > threshold:
            break
        last -= 1
    return last


def threshold_at(job: ElasticJob, load: float) -> float:
    """The job's probability threshold on a cluster whose GPUs have lately been ``load``
    owed (:attr:`Snapshot.load`): ``probabilityThreshold``, slid toward ``loadedThreshold``.

    Why it slides: a scale-up that loses its bet makes a non-elastic pod wait for a step and
    a switch, and what that wait costs depends on the wait the pod has anyway. On a lightly
    used cluster pods barely queue, so every wait for a lent GPU is one they never had: the
    spec's threshold holds. On a loaded cluster they queue anyway, about as long as
    ``load / (1 - load)`` says (an M/M/1 queue's length at that utilisation), and an elastic
    job that finishes sooner gives its minimum back to that queue sooner; so the risk taken,
    ``1 - threshold``, may grow as ``QUEUE_RISK x load / (1 - load)``. The threshold is never
    above ``probabilityThreshold``, never below ``loadedThreshold`` (one at or below that does
    not slide). On the ITP traces (docs/simulator.md) it keeps 0.99 for most of cluster01's
    scale-ups (11% used) and 0.9 for most of cluster03's (median load at a scale-up 0.67)."""
    high = job.probability_threshold
    if high <= job.loaded_threshold or load <= 0:
        return high
    risk = QUEUE_RISK * load / (1 - load) if load < 1 else math.inf
    return max(job.loaded_threshold, min(high, 1 - risk))


@dataclass(slots=True)
class Load:
    """:meth:`Snapshot.owed_share` smoothed exponentially over a window, across rounds: how
    loaded the cluster has lately been (:func:`threshold_at`), not how full it is this second.
    The operator keeps one (a restarted one begins again from the share it sees), the
    simulator one per run."""

    share: float | None = None
    at: float = 0.0

    def observe(self, now: float, share: float, window: float) -> float:
        """Blend in ``share``, the share owed since the last observation; the smoothed one."""
        if self.share is None:
            self.share = share
        else:
            keep = math.exp(-max(now - self.at, 0.0) / window)
            self.share = keep * self.share + (1 - keep) * share
        self.at = now
        return self.share


def _released(job: Shrinkable) -> Decision:
    """The scale-down decision of a job ``make_room`` shrank."""
    gain = job.rows.tps[job.rows.at_most(job.workers)] / job.tps0 - 1
    room = ", ".join(f"{pod.key} ({pod.gpus} GPUs) on {node}" for pod, node in job.room_for)
    return Decision(
        job=job.job.key, kind="scale_down", from_workers=job.job.workers,
        to_workers=job.workers, reason=PENDING_GPU_PODS, release=tuple(job.released),
        room_for=tuple((pod.key, node) for pod, node in job.room_for), gain=gain,
        message=(
            f"pending GPU pods: releasing {', '.join(job.released)} to make room for {room}, "
            f"{gain:+.1%} tokens/s"
        ),
    )
