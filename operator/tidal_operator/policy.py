"""The scaling policy of DESIGN.md section 4, as one pure function: ``decide(snapshot, now)``.

No I/O and no clock: the same snapshot and ``now`` give the same decisions, whatever the order
of the records in the snapshot (ties go to the node name, the job key, the pod key).

Idle GPUs are a node's GPUs less those of the unfinished pods bound to it. Pods that ask for
GPUs, have no node and have not finished are *pending* if they are non-elastic (no
``tidal.dev/job``) or the pods of an elastic job below its minimum: a new job's first pods, or a
lost worker's replacement. A job's minimum is what it was admitted with, owed like any other
pod's GPUs; only the workers above it are idle GPUs lent.

**Scale down** when pods are pending (see :func:`_scale_down`): in FIFO order, each pending
pod that does not fit on a node's free GPUs gets room on one node, from the elastic workers
there whose jobs lose the least throughput, each job shrinking only to a kept scale-table row,
never below its minimum, never releasing its leader. The GPUs of pods an outstanding target
already releases count as free, so a pod waiting for a drain does not cost a second job.

**Restore** first (see :func:`_restore`): a job that a fault left below its minimum gets new
workers back to it, whatever else is pending, idle or due: the minimum is what the job was
admitted with, and the GPUs of its lost pods were its own. New workers that find no free GPUs
are pending pods like any other: the scale-down makes room for them.

**Scale up** only when no pod is pending, GPUs are idle and no elastic worker pod waits for a
node (GPUs promised to a joiner are not counted twice); see :func:`_scale_up`.

Both count only the nodes a pod may run on (:class:`~tidal_operator.snapshot.Placement`: its
node selector, and tolerations for the nodes' NoSchedule and NoExecute taints): a job's new
workers go where its pods may, and GPUs are freed for a pending pod only where it may run.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from tidal_api import ScaleTable
from tidal_operator.snapshot import FINISHED_PHASES, ElasticJob, Placement, Pod, Snapshot

IDLE_GPUS = "IdleGPUs"
PENDING_GPU_PODS = "PendingGPUPods"
BELOW_MINIMUM = "BelowMinimum"


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
    kind: Literal["scale_up", "scale_down"]
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
    free = {node.name: node.gpus for node in snapshot.nodes}
    below = {job.key for job in snapshot.jobs if job.workers < job.min_workers}
    pending: list[Pod] = []
    workers: dict[str, Pod] = {}  # bound, unfinished elastic worker pods by key
    joiner_unbound = False
    for pod in snapshot.pods:
        if pod.gpus <= 0 or pod.phase in FINISHED_PHASES:
            continue
        if pod.node is None:
            if pod.job is None or pod.job in below:
                pending.append(pod)
            else:  # a scale-up's: its GPUs are promised
                joiner_unbound = True
        elif pod.node in free:
            free[pod.node] -= pod.gpus
            if pod.job is not None:
                workers[pod.key] = pod
    where = _Where(snapshot)
    # A restored job is below its minimum, which no scale-down goes under; its new workers
    # are yet to be bound, and no scale-up runs while a joiner waits for its node.
    restored = _restore(snapshot, free, where)
    if pending:
        return restored + _scale_down(snapshot, free, pending, workers, where)
    if joiner_unbound or restored:
        return restored
    return _scale_up(snapshot, _FreeGPUs(free), now, where)


def _restore(snapshot: Snapshot, free: dict[str, int], where: _Where) -> tuple[Decision, ...]:
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
    for job in sorted(snapshot.jobs, key=lambda j: (j.workers, j.key)):
        if job.busy or not 0 < job.workers < job.min_workers:
            continue
        gpus = gpus or _FreeGPUs(free)  # takes the GPUs it places out of ``free``
        count = job.min_workers - job.workers
        nodes = _place(gpus, count, job.gpus_per_worker, where(job.placement))
        waiting = count - len(nodes)
        decisions.append(Decision(
            job=job.key, kind="scale_up", from_workers=job.workers, to_workers=job.min_workers,
            reason=BELOW_MINIMUM, nodes=tuple(nodes),
            message=(f"below its minimum ({job.workers} of {job.min_workers} workers): "
                     f"{count} new workers"
                     + (f" on {_placed(nodes)}" if nodes else "")
                     + (f", {waiting} waiting for GPUs" if waiting else "")),
        ))
    return tuple(decisions)


def _place(free: _FreeGPUs, count: int, size: int, allowed: frozenset[str] | None) -> list[str]:
    """Nodes for up to ``count`` pods of ``size`` GPUs, one at a time by best fit, taken out of
    ``free``; fewer where they do not fit."""
    nodes = []
    for _ in range(count):
        node = free.tightest(size, allowed)
        if node is None:
            break
        free.add(node, -size)
        nodes.append(node)
    return nodes


def _placed(nodes: list[str]) -> str:
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in Counter(nodes).items())


class _Where:
    """The nodes each placement allows, once per distinct placement: None for all of them
    (no selector, and no node has a taint that keeps pods off)."""

    __slots__ = ("_nodes", "_open", "_seen")

    def __init__(self, snapshot: Snapshot) -> None:
        self._nodes = snapshot.nodes
        self._open = (not any(node.taints for node in snapshot.nodes)
                      or all(node.open_to_all for node in snapshot.nodes))
        self._seen: dict[Placement, frozenset[str] | None] = {}

    def __call__(self, placement: Placement) -> frozenset[str] | None:
        if self._open and not placement.node_selector:
            return None
        if placement not in self._seen:
            self._seen[placement] = frozenset(
                n.name for n in self._nodes if placement.allows(n))
        return self._seen[placement]


def arrival_rate(arrivals: list[float], now: float, window: float) -> float:
    """Non-elastic arrivals per second over ``[now - window, now]``; ``arrivals`` sorted."""
    return (bisect_right(arrivals, now) - bisect_left(arrivals, now - window)) / window


class _FreeGPUs:
    """Free GPUs per node; the nodes with any are bucketed by amount, names sorted, so that
    "how many workers fit" and "the tightest node that fits" cost O(distinct amounts)."""

    __slots__ = ("free", "idle", "_buckets")

    def __init__(self, free: dict[str, int]) -> None:
        self.free = free
        self.idle = 0
        self._buckets: dict[int, list[str]] = {}
        for name in sorted(free):
            if free[name] > 0:
                self.idle += free[name]
                self._buckets.setdefault(free[name], []).append(name)

    def slots(self, size: int, allowed: frozenset[str] | None = None) -> int:
        """How many pods of ``size`` GPUs fit, each on one node (of ``allowed``, if given)."""
        return sum((len(names) if allowed is None else sum(n in allowed for n in names))
                   * (amount // size)
                   for amount, names in self._buckets.items() if amount >= size)

    def tightest(self, size: int, allowed: frozenset[str] | None = None) -> str | None:
        """The node with the fewest free GPUs that still fits ``size`` (best fit), among
        ``allowed`` if given."""
        amounts = [amount for amount in self._buckets if amount >= size]
        if allowed is None:
            return self._buckets[min(amounts)][0] if amounts else None
        for amount in sorted(amounts):
            for name in self._buckets[amount]:
                if name in allowed:
                    return name
        return None

    def add(self, node: str, gpus: int) -> None:
        old = self.free[node]
        new = self.free[node] = old + gpus
        self.idle += max(new, 0) - max(old, 0)
        if old > 0:
            bucket = self._buckets[old]
            del bucket[bisect_left(bucket, node)]
            if not bucket:
                del self._buckets[old]
        if new > 0:
            insort(self._buckets.setdefault(new, []), node)


@dataclass(slots=True)
class _Rows:
    """A job's kept scale-table rows as parallel lists, to bisect by worker count."""

    workers: list[int]
    tps: list[float]

    @classmethod
    def of(cls, table: ScaleTable) -> _Rows:
        return cls([r.workers for r in table.rows], [r.tokens_per_second for r in table.rows])

    def at_most(self, workers: int) -> int:
        """Index of the largest row with at most ``workers`` (where the job runs), or -1."""
        return bisect_right(self.workers, workers) - 1


def _scale_up(snapshot: Snapshot, free: _FreeGPUs, now: float,
              where: _Where) -> tuple[Decision, ...]:
    """Give idle GPUs to the jobs with the fewest workers first (then by key).

    For each job in turn: the rows above its count, up to its cap (maxWorkers and maxScaleFactor
    x minWorkers) and as far as new workers fit on the idle GPUs of the nodes its placement
    allows (each worker on one node, best fit), are the candidates; it takes the one with the
    most tokens/s, the largest gain ``g`` over its current row. That row must gain at least
    ``minGain`` and pass the Poisson rule: non-elastic pods arrive at rate ``r`` (counted over
    the job's arrival window, else the snapshot's), so the idle window ``T`` is exponential and
    the scale-up pays when ``g x T > overhead``, with probability ``P = exp(-r x overhead /
    g)``, which must exceed ``probabilityThreshold``. The overhead is *two* switches, ``2 x
    switch_seconds``: the window ends with the arrival that takes the GPUs back, and that
    scale-down pauses the job as long as this scale-up does. ``P`` and the gain both grow with
    throughput, so no smaller candidate passes where the chosen one fails. The job's new workers
    then leave the pool for the jobs after it.
    """
    if free.idle <= 0:
        return ()
    arrivals = sorted(snapshot.arrivals)
    decisions = []
    for job in sorted(snapshot.jobs, key=lambda j: (j.workers, j.key)):
        if free.idle <= 0:
            break
        decision = _grow(job, free, where(job.placement), arrivals, snapshot.window_seconds,
                         now)
        if decision is not None:
            decisions.append(decision)
    return tuple(decisions)


def _grow(job: ElasticJob, free: _FreeGPUs, allowed: frozenset[str] | None,
          arrivals: list[float], window: float, now: float) -> Decision | None:
    if not job.enabled or job.busy or job.scale_table is None:
        return None
    if job.last_scale_time is not None and now - job.last_scale_time < job.cooldown_seconds:
        return None
    rows = _Rows.of(job.scale_table)
    here = rows.at_most(job.workers)
    first = bisect_right(rows.workers, job.workers)
    last = rows.at_most(min(job.cap, job.workers + free.slots(job.gpus_per_worker, allowed)))
    if here < 0 or last < first:
        return None
    best = max(range(first, last + 1), key=lambda i: (rows.tps[i], -i))
    gain = rows.tps[best] / rows.tps[here] - 1
    if gain <= 0 or gain < job.min_gain:
        return None
    rate = arrival_rate(arrivals, now, job.arrival_window_seconds or window)
    overhead = 2 * job.switch_seconds
    probability = math.exp(-rate * overhead / gain)
    if probability <= job.probability_threshold:
        return None
    idle = free.idle
    to_workers = rows.workers[best]
    nodes = _place(free, to_workers - job.workers, job.gpus_per_worker, allowed)
    assert len(nodes) == to_workers - job.workers, "slots() counted places tightest() cannot find"
    return Decision(
        job=job.key, kind="scale_up", from_workers=job.workers, to_workers=to_workers,
        reason=IDLE_GPUS, nodes=tuple(nodes), probability=probability, gain=gain,
        message=(
            f"{idle} GPUs idle and no GPU pod pending: {len(nodes)} new workers on "
            f"{_placed(nodes)}, {gain:+.1%} tokens/s; P(idle window outlasts {overhead:.3g} s of "
            f"switching) = {probability:.2f} > {job.probability_threshold:.2f} at "
            f"{rate * 3600:.2f} arrivals/h"
        ),
    )


@dataclass(slots=True)
class _Shrinkable:
    """A job the scale-down may shrink, as it stands after the releases decided so far."""

    job: ElasticJob
    rows: _Rows
    tps0: float  # tokens/s at the applied count: every loss is a fraction of it
    workers: int
    pods: list[Pod]  # releasable members (all but the leader), rank order
    released: list[str] = field(default_factory=list)
    room_for: list[tuple[Pod, str]] = field(default_factory=list)

    def options(self, node: str) -> list[tuple[int, float, int, int]]:
        """Ways to free GPUs on ``node``: (GPUs freed there, loss, GPUs freed, new count).

        Releasing k of the job's pods on the node takes it down to the largest kept row at
        most ``workers - k`` (never below its minimum), which may release more pods than k:
        those come from elsewhere after the ones on the node.
        """
        here = sum(1 for p in self.pods if p.node == node)
        gpw = self.job.gpus_per_worker
        now = self.rows.tps[self.rows.at_most(self.workers)]
        options: list[tuple[int, float, int, int]] = []
        for k in range(1, here + 1):
            i = self.rows.at_most(self.workers - k)
            if i < 0 or self.rows.workers[i] < self.job.min_workers:
                break
            to = self.rows.workers[i]
            if options and options[-1][3] == to:
                continue
            released = self.workers - to
            loss = max(0.0, (now - self.rows.tps[i]) / self.tps0)
            options.append((min(here, released) * gpw, loss, released * gpw, to))
        return options

    def shrink(self, to: int, node: str) -> list[Pod]:
        """Release pods to reach ``to`` workers: those on ``node`` first, highest rank first."""
        order = sorted(reversed(self.pods), key=lambda p: p.node != node)
        gone = order[: self.workers - to]
        for pod in gone:
            self.pods.remove(pod)
        self.released += [p.key for p in gone]
        self.workers = to
        return gone


# A plan frees GPUs on one node: (summed loss, GPUs released, ((job, new count), ...)).
_Plan = tuple[float, int, tuple[tuple[_Shrinkable, int], ...]]


def _plans(jobs: list[_Shrinkable], node: str, capacity: int) -> list[_Plan | None]:
    """For each deficit d in 0..capacity, the cheapest plan freeing at least d GPUs on node.

    A multiple-choice knapsack over the jobs with workers there (each job takes one option or
    none), with states capped at the node's capacity: few jobs share a node, so it is small.
    Cheapest means the least summed loss, then the fewest GPUs released.
    """
    best: list[_Plan | None] = [None] * (capacity + 1)
    best[0] = (0.0, 0, ())
    for job in jobs:
        options = job.options(node)
        if not options:
            continue
        grown = best[:]
        for have, plan in enumerate(best):
            if plan is None:
                continue
            for freed_here, loss, freed, to in options:
                more = min(capacity, have + freed_here)
                candidate = (plan[0] + loss, plan[1] + freed, (*plan[2], (job, to)))
                if grown[more] is None or candidate[:2] < grown[more][:2]:
                    grown[more] = candidate
        best = grown
    for d in range(capacity - 1, -1, -1):
        above = best[d + 1]
        if above is not None and (best[d] is None or above[:2] < best[d][:2]):
            best[d] = above
    return best


def _scale_down(
    snapshot: Snapshot, free_by_node: dict[str, int], pending: list[Pod], workers: dict[str, Pod],
    where: _Where,
) -> tuple[Decision, ...]:
    """Make room for the pending pods, oldest first (creation time, then key).

    A pod that fits on the free GPUs of some node it may run on (best fit) takes them and needs
    nothing. Else, on each node it may run on, the cheapest plan frees the GPUs it lacks there;
    the cheapest over the nodes wins (then the node name). A plan's cost is the jobs' lost
    tokens/s as fractions of their throughput at the start of this call, summed: absolute
    tokens/s of different models do not compare, and the relative loss of one more worker is
    small for a large job and large for a small one, the mirror of the fewest-workers-first
    scale-up. Minimising the summed loss for the GPUs needed takes them from the jobs that lose
    least per freed GPU, and shrinks each only as far as needed. Jobs that are busy, disabled,
    without a scale table, or whose members are not all bound and labelled theirs are not
    touched. A pod no plan makes room for just waits; the GPUs of later decisions stay free for
    others.
    """
    for job in snapshot.jobs:
        for key in job.releasing:
            pod = workers.pop(key, None)
            if pod is not None:
                free_by_node[pod.node] += pod.gpus
    free = _FreeGPUs(free_by_node)
    capacity = {node.name: node.gpus for node in snapshot.nodes}
    shrinkable = _shrinkable(snapshot.jobs, workers)
    on_node: dict[str, list[_Shrinkable]] = {}
    releasable = dict.fromkeys(capacity, 0)  # an upper bound on what a node can free
    for job in shrinkable:
        for pod in job.pods:
            jobs_here = on_node.setdefault(pod.node, [])
            if not jobs_here or jobs_here[-1] is not job:
                jobs_here.append(job)
            releasable[pod.node] += pod.gpus
    candidates = sorted(on_node)
    cache: dict[str, list[_Plan | None]] = {}
    touched: list[_Shrinkable] = []
    for pod in sorted(pending, key=lambda p: (p.created, p.key)):
        allowed = where(pod.placement)
        fits = free.tightest(pod.gpus, allowed)
        if fits is not None:
            free.add(fits, -pod.gpus)
            continue
        chosen: tuple[_Plan, str] | None = None
        for node in candidates if allowed is None else [n for n in candidates if n in allowed]:
            lack = pod.gpus - free.free[node]
            if lack > releasable[node] or lack > capacity[node]:
                continue
            plans = cache.get(node)
            if plans is None:
                plans = cache[node] = _plans(on_node[node], node, capacity[node])
            plan = plans[lack]
            if plan is not None and (chosen is None or plan[:2] < chosen[0][:2]):
                chosen = (plan, node)
        if chosen is None:
            continue
        (_, _, steps), node = chosen
        for job, to in steps:
            for other in {p.node for p in job.pods}:
                cache.pop(other, None)
            for gone in job.shrink(to, node):
                free.add(gone.node, gone.gpus)
                releasable[gone.node] -= gone.gpus
            job.room_for.append((pod, node))
            if job not in touched:
                touched.append(job)
        free.add(node, -pod.gpus)
    return tuple(_released(job) for job in touched)


def _shrinkable(jobs: tuple[ElasticJob, ...], workers: dict[str, Pod]) -> list[_Shrinkable]:
    found = []
    for job in sorted(jobs, key=lambda j: j.key):
        if (not job.enabled or job.busy or job.scale_table is None
                or job.workers <= job.min_workers or len(job.members) != job.workers):
            continue
        pods = [workers[key] for key in job.members[1:]
                if key in workers and workers[key].job == job.key]
        if len(pods) != job.workers - 1:
            continue
        rows = _Rows.of(job.scale_table)
        here = rows.at_most(job.workers)
        if here >= 0:
            found.append(_Shrinkable(job, rows, rows.tps[here], job.workers, pods))
    return found


def _released(job: _Shrinkable) -> Decision:
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
