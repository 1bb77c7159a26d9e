"""Scale down: room for pending pods, from the elastic workers that cost the least throughput.

See :func:`make_room`. Each job shrinks only to a kept scale-table row, never below its
minimum, never releasing its leader; which pods a job releases and for whom is returned as
:class:`Shrinkable` records, which :func:`tidal_operator.policy.decide` turns into decisions.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from dataclasses import dataclass, field

from tidal_operator.capacity import FreeGPUs, Rows, Where
from tidal_operator.snapshot import ElasticJob, Pod, Snapshot


@dataclass(slots=True, eq=False)
class Shrinkable:
    """A job the scale-down may shrink, as it stands after the releases decided so far.

    ``on`` counts its releasable pods by node. ``ladder`` is what releasing k of them (k up
    to the most it has on one node) does, whatever the node: for each kept row it can go down
    to, the fewest k that take it there, the new count and the loss. ``floor``, the least loss
    on the ladder, is at most that of any option the job offers now, on any node.
    """

    job: ElasticJob
    rows: Rows
    tps0: float  # tokens/s at the applied count: every loss is a fraction of it
    workers: int
    pods: list[Pod]  # releasable members (all but the leader), rank order
    released: list[str] = field(default_factory=list)
    room_for: list[tuple[Pod, str]] = field(default_factory=list)
    on: dict[str, int] = field(init=False)
    ladder: list[tuple[int, int, float]] = field(init=False)
    floor: float = field(init=False)

    def __post_init__(self) -> None:
        self.on = on = {}
        for pod in self.pods:
            on[pod.node] = on.get(pod.node, 0) + 1
        self._climb()

    def options(self, node: str) -> list[tuple[int, float, int, int]]:
        """Ways to free GPUs on ``node``: (GPUs freed there, loss, GPUs freed, new count).

        Releasing k of the job's pods on the node takes it down to the largest kept row at
        most ``workers - k`` (never below its minimum), which may release more pods than k:
        those come from elsewhere after the ones on the node.
        """
        here = self.on.get(node, 0)
        gpw = self.job.gpus_per_worker
        return [(min(here, self.workers - to) * gpw, loss, (self.workers - to) * gpw, to)
                for k, to, loss in self.ladder if k <= here]

    def shrink(self, to: int, node: str) -> list[Pod]:
        """Release pods to reach ``to`` workers: those on ``node`` first, highest rank first."""
        order = sorted(reversed(self.pods), key=lambda p: p.node != node)
        gone = order[: self.workers - to]
        for pod in gone:
            self.pods.remove(pod)
            self.on[pod.node] -= 1
        self.released += [p.key for p in gone]
        self.workers = to
        self._climb()
        return gone

    def _climb(self) -> None:
        """The ladder and floor of the job at its count."""
        rows, tps = self.rows.workers, self.rows.tps
        now = tps[self.rows.at_most(self.workers)]
        self.ladder = []
        for k in range(1, max(self.on.values(), default=0) + 1):
            i = bisect_right(rows, self.workers - k) - 1
            if i < 0 or rows[i] < self.job.min_workers:
                break
            if not self.ladder or self.ladder[-1][1] != rows[i]:
                self.ladder.append((k, rows[i], max(0.0, (now - tps[i]) / self.tps0)))
        self.floor = min((loss for _, _, loss in self.ladder), default=math.inf)


# A plan frees GPUs on one node: (summed loss, GPUs released, ((job, new count), ...)).
_Plan = tuple[float, int, tuple[tuple[Shrinkable, int], ...]]


def _plans(jobs: list[Shrinkable], node: str, capacity: int) -> list[_Plan | None]:
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
                cost, count = plan[0] + loss, plan[1] + freed
                there = grown[more]
                if there is None or (cost, count) < there[:2]:
                    grown[more] = (cost, count, (*plan[2], (job, to)))
        best = grown
    for d in range(capacity - 1, -1, -1):
        above = best[d + 1]
        if above is not None and (best[d] is None or above[:2] < best[d][:2]):
            best[d] = above
    return best


def make_room(
    snapshot: Snapshot, free_by_node: dict[str, int], pending: list[Pod], workers: dict[str, Pod],
    where: Where,
) -> list[Shrinkable]:
    """Make room for the pending pods, oldest first (creation time, then key).

    A pod that fits on the free GPUs of some node it may run on (best fit) takes them and needs
    nothing. Else, on each node it may run on, the cheapest plan frees the GPUs it lacks there;
    the cheapest over the nodes wins (then the node name). A plan's cost is the jobs' lost
    tokens/s as fractions of their throughput at the start of this call, summed: absolute
    tokens/s of different models do not compare, and the relative loss of one more worker is
    small for a large job and large for a small one, the mirror of the scale-up's gain per
    GPU. Minimising the summed loss for the GPUs needed takes them from the jobs that lose
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
    free = FreeGPUs(free_by_node)
    room = _Room(_shrinkable(snapshot.jobs, workers), free,
                 {node.name: node.gpus for node in snapshot.nodes})
    touched: list[Shrinkable] = []
    for pod in sorted(pending, key=lambda p: (p.created, p.key)):
        allowed = where(pod.placement)
        fits = free.tightest(pod.gpus, allowed)
        if fits is not None:
            free.add(fits, -pod.gpus)
            room.took(fits)
            continue
        chosen = room.cheapest(pod.gpus, allowed)
        if chosen is None:
            continue
        (_, _, steps), node = chosen
        for job, to in steps:
            room.shrink(job, to, node)
            job.room_for.append((pod, node))
            if job not in touched:
                touched.append(job)
        free.add(node, -pod.gpus)
        room.took(node)
    return touched


class _Room:
    """The nodes where releases can make room, and the search for the cheapest plan there.

    Each node's plans (:func:`_plans`) are kept until one of its jobs shrinks. A pod that may
    run anywhere takes the least key (loss, GPUs released, node name) from a heap per pod
    size. For every node that could free enough for that size, the heap holds an entry no
    greater than the node's key: its exact key, or a lower bound (the least ``floor`` of the
    node's jobs, sorting before any exact key of the same loss). The search turns bounds into
    exact keys until an exact key is least: nodes whose bound lies above it never have their
    plans computed.

    Entries are stamped with their node's version, which every change makes anew. An exact
    entry is exact for its version only, but stays a lower bound while the node's key cannot
    have fallen: a pod placed there only raises it (the plan for a larger lack), a shrink of
    one of its jobs may lower it, so a new bound goes into every heap (``lowered``). A node
    left out of a heap stays out: its free and releasable GPUs never grow in a call (a release
    moves GPUs from one to the other, a placed pod takes free ones). A pod with a placement
    scans the nodes it may run on, by name.
    """

    __slots__ = ("free", "capacity", "on_node", "releasable", "floor", "version", "lowered",
                 "_plans", "_heaps")

    def __init__(self, jobs: list[Shrinkable], free: FreeGPUs, capacity: dict[str, int]) -> None:
        self.free = free
        self.capacity = capacity
        self.on_node: dict[str, list[Shrinkable]] = {}
        self.releasable = dict.fromkeys(capacity, 0)  # an upper bound on what a node can free
        self.floor: dict[str, float] = {}
        for job in jobs:
            for pod in job.pods:
                jobs_here = self.on_node.setdefault(pod.node, [])
                if not jobs_here or jobs_here[-1] is not job:
                    jobs_here.append(job)
                    self.floor[pod.node] = min(self.floor.get(pod.node, math.inf), job.floor)
                self.releasable[pod.node] += pod.gpus
        self.version = dict.fromkeys(self.on_node, 0)
        self.lowered = dict.fromkeys(self.on_node, 0)  # the version of the last shrink there
        self._plans: dict[str, list[_Plan | None]] = {}
        self._heaps: dict[int, list[tuple[float, int, str, int]]] = {}

    def cheapest(self, gpus: int, allowed: frozenset[str] | None) -> tuple[_Plan, str] | None:
        """The cheapest plan (least loss, fewest GPUs released, then node name) that frees
        what a pod of ``gpus`` lacks on a node of ``allowed`` (None: any), and its node."""
        if allowed is not None:
            return self._scan(gpus, allowed)
        heap = self._heaps.get(gpus)
        if heap is None:
            free, releasable, floor = self.free.free, self.releasable, self.floor
            heap = self._heaps[gpus] = [(floor[node], -1, node, version)
                                        for node, version in self.version.items()
                                        if free[node] + releasable[node] >= gpus]
            heapq.heapify(heap)
        while heap:
            _, released, node, version = heap[0]
            if version < self.lowered[node]:
                heapq.heappop(heap)
            elif released >= 0 and version == self.version[node]:
                return self._plan(node, gpus), node
            elif (plan := self._plan(node, gpus)) is not None:
                heapq.heapreplace(heap, (plan[0], plan[1], node, self.version[node]))
            else:
                heapq.heappop(heap)
        return None

    def _scan(self, gpus: int, allowed: frozenset[str]) -> tuple[_Plan, str] | None:
        chosen: tuple[_Plan, str] | None = None
        for node in sorted(n for n in self.on_node if n in allowed):
            plan = self._plan(node, gpus)
            if plan is not None and (chosen is None or plan[:2] < chosen[0][:2]):
                chosen = (plan, node)
        return chosen

    def _plan(self, node: str, gpus: int) -> _Plan | None:
        """The cheapest plan freeing what a pod of ``gpus`` lacks on ``node``, or None."""
        lack = gpus - self.free.free[node]
        if lack > self.releasable[node] or lack > self.capacity[node]:
            return None
        plans = self._plans.get(node)
        if plans is None:
            plans = self._plans[node] = _plans(self.on_node[node], node, self.capacity[node])
        return plans[lack]

    def took(self, node: str) -> None:
        """A pod took free GPUs on ``node``: a new version, whose key is no less."""
        if node in self.version:
            self.version[node] += 1

    def shrink(self, job: Shrinkable, to: int, node: str) -> None:
        """Shrink ``job`` to ``to`` workers, releasing on ``node`` first; its GPUs go free.
        Every node it ran on gets new plans, a new floor and a new bound in every heap."""
        nodes = {p.node for p in job.pods}
        for gone in job.shrink(to, node):
            self.free.add(gone.node, gone.gpus)
            self.releasable[gone.node] -= gone.gpus
        free, releasable = self.free.free, self.releasable
        for other in nodes:
            self._plans.pop(other, None)
            version = self.version[other] = self.lowered[other] = self.version[other] + 1
            floor = self.floor[other] = _least_floor(self.on_node[other], other)
            for gpus, heap in self._heaps.items():
                if free[other] + releasable[other] >= gpus:
                    heapq.heappush(heap, (floor, -1, other, version))


def _least_floor(jobs: list[Shrinkable], node: str) -> float:
    """The least floor of the jobs with pods on ``node``: at most any plan's loss there."""
    least = math.inf
    for job in jobs:
        if job.floor < least and job.on.get(node):
            least = job.floor
    return least


def _shrinkable(jobs: tuple[ElasticJob, ...], workers: dict[str, Pod]) -> list[Shrinkable]:
    found = []
    for job in sorted(jobs, key=lambda j: j.key):
        if (not job.enabled or job.busy or job.scale_table is None
                or job.workers <= job.min_workers or len(job.members) != job.workers):
            continue
        pods = []
        for key in job.members[1:]:
            pod = workers.get(key)
            if pod is None or pod.job != job.key:
                break
            pods.append(pod)
        if len(pods) != job.workers - 1:
            continue
        rows = Rows.of(job.scale_table)
        here = rows.at_most(job.workers)
        if here >= 0:
            found.append(Shrinkable(job, rows, rows.tps[here], job.workers, pods))
    return found

