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
from itertools import repeat
from operator import attrgetter, eq

from tidal_operator.capacity import FreeGPUs, Rows, Where
from tidal_operator.snapshot import ElasticJob, Pod, Snapshot

_KEY, _JOB = attrgetter("key"), attrgetter("job")


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
        leaving = set(map(id, gone))
        self.pods = [pod for pod in self.pods if id(pod) not in leaving]
        for pod in gone:
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


def _cheapest(jobs: list[Shrinkable], node: str, capacity: int, lack: int) -> _Plan | None:
    """The cheapest plan freeing at least ``lack`` GPUs on ``node``: the least summed loss,
    then the fewest GPUs released, as :func:`_plans` finds it, ties and all.

    Most nodes need no knapsack: where one job's option frees enough at a loss below the
    least any two jobs' options could sum to (or no other job has an option there), no plan
    of two jobs or more can match it, and the knapsack's answer is that option (the fewest
    GPUs freed there among equals, then the first job and option, as the knapsack keeps them).
    """
    offers = [(job, options) for job in jobs if (options := job.options(node))]
    single = None  # (loss, freed, freed there, job, new count)
    for job, options in offers:
        for freed_here, loss, freed, to in options:
            here = min(capacity, freed_here)
            if here >= lack and (single is None or (loss, freed, here) < single[:3]):
                single = (loss, freed, here, job, to)
    if len(offers) > 1:
        least = sorted(min(loss for _, loss, _, _ in options) for _, options in offers)
        if single is None or single[0] >= least[0] + least[1]:
            return _plans(offers, capacity)[lack]
    if single is None:
        return None
    return (0.0 + single[0], single[1], ((single[3], single[4]),))


def _plans(offers: list[tuple[Shrinkable, list[tuple[int, float, int, int]]]],
           capacity: int) -> list[_Plan | None]:
    """For each deficit d in 0..capacity, the cheapest plan freeing at least d GPUs on a node,
    from the options each job offers there (:meth:`Shrinkable.options`).

    A multiple-choice knapsack over the jobs with workers there (each job takes one option or
    none), with states capped at the node's capacity: few jobs share a node, so it is small.
    Cheapest means the least summed loss, then the fewest GPUs released.
    """
    best: list[_Plan | None] = [None] * (capacity + 1)
    best[0] = (0.0, 0, ())
    reached = [0]  # the deficits best has a plan for, in order
    for job, options in offers:
        grown = best[:]
        for have in reached:
            plan = best[have]
            for freed_here, loss, freed, to in options:
                more = min(capacity, have + freed_here)
                cost, count = plan[0] + loss, plan[1] + freed
                there = grown[more]
                if there is None or (cost, count) < there[:2]:
                    grown[more] = (cost, count, (*plan[2], (job, to)))
        best = grown
        reached = [have for have, plan in enumerate(best) if plan is not None]
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
    touched: dict[int, Shrinkable] = {}  # by id, in the order first shrunk
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
            touched.setdefault(id(job), job)
        free.add(node, -pod.gpus)
        room.took(node)
    return list(touched.values())


class _Room:
    """The nodes where releases can make room, and the search for the cheapest plan there.

    A pod that may run anywhere takes the least key (loss, GPUs released, node name) from a
    heap per pod size. For every node that could free enough for that size, the heap holds an
    entry no greater than the node's key, of three kinds, each no greater than the next:
    - a bound: the least ``floor`` of the node's jobs, and the GPUs the pod lacks there (no
      plan releases fewer);
    - a closer bound, once a bound comes up (:meth:`_closer`): the least floor of the jobs
      with enough pods there to free the lack alone, or the two least floors summed (a plan of
      two jobs or more loses at least that);
    - the exact key, once a closer bound comes up (:meth:`_plan`, kept until the node's jobs
      change).
    Equal (loss, GPUs, node), an entry sorts before the next kind. The search refines the
    least entry until it is an exact key: nodes whose bound lies above it never have their
    plans computed, nor their jobs' ladders.

    Entries are stamped with their node's version, which every change makes anew. An exact
    entry is exact for its version only, but stays a lower bound while the node's key cannot
    have fallen: a pod placed there only raises it (the plan for a larger lack), a shrink of
    one of its jobs may lower it, so a new bound goes into every heap (``lowered``): into one
    log, which each heap reads on from where it left off when next searched, passing over the
    nodes changed again since. A node whose free and releasable GPUs cannot hold a pod's size
    is dropped from that size's heap, and stays out: those never grow in a call (a release
    moves GPUs from one to the other, a placed pod takes free ones). A pod with a placement
    scans the nodes it may run on, by name.
    """

    __slots__ = ("free", "capacity", "on_node", "releasable", "floor", "version", "lowered",
                 "_plans", "_heaps", "_log")

    def __init__(self, jobs: list[Shrinkable], free: FreeGPUs, capacity: dict[str, int]) -> None:
        self.free = free
        self.capacity = capacity
        self.on_node: dict[str, list[Shrinkable]] = {}
        self.releasable = dict.fromkeys(capacity, 0)  # an upper bound on what a node can free
        self.floor: dict[str, float] = {}
        on_node, releasable, floor = self.on_node, self.releasable, self.floor
        for job in jobs:
            gpw, least = job.job.gpus_per_worker, job.floor
            for node, count in job.on.items():
                jobs_here = on_node.get(node)
                if jobs_here is None:
                    on_node[node] = [job]
                    floor[node] = least
                else:
                    jobs_here.append(job)
                    floor[node] = min(floor[node], least)
                releasable[node] += count * gpw
        self.version = dict.fromkeys(on_node, 0)
        self.lowered = dict.fromkeys(on_node, 0)  # the version of the last shrink there
        self._plans: dict[str, dict[int, _Plan | None]] = {}  # by lack
        # by pod size: the heap, and how far it has read the log
        self._heaps: dict[int, tuple[list[tuple[float, int, str, int, int]], list[int]]] = {}
        self._log: list[tuple[float, str, int]] = []  # (floor, node, version) of each shrink

    def cheapest(self, gpus: int, allowed: frozenset[str] | None) -> tuple[_Plan, str] | None:
        """The cheapest plan (least loss, fewest GPUs released, then node name) that frees
        what a pod of ``gpus`` lacks on a node of ``allowed`` (None: any), and its node."""
        if allowed is not None:
            return self._scan(gpus, allowed)
        heap = self._heap(gpus)
        lowered, versions = self.lowered, self.version
        while heap:
            _, _, node, kind, version = heap[0]
            if version < lowered[node]:
                heapq.heappop(heap)
            elif kind == 2 and version == versions[node]:
                return self._plan(node, gpus), node
            elif kind == 0:
                closer = self._closer(node, gpus)
                if closer is None:
                    heapq.heappop(heap)
                else:
                    heapq.heapreplace(heap, (closer, heap[0][1], node, 1, version))
            elif (plan := self._plan(node, gpus)) is not None:
                heapq.heapreplace(heap, (plan[0], plan[1], node, 2, versions[node]))
            else:
                heapq.heappop(heap)
        return None

    def _heap(self, gpus: int) -> list[tuple[float, int, str, int, int]]:
        """The heap of ``gpus``, made at its first search, with the log read to its end."""
        free, releasable = self.free.free, self.releasable
        if gpus not in self._heaps:
            heap = [(self.floor[node], max(1, gpus - free[node]), node, 0, version)
                    for node, version in self.version.items()
                    if free[node] + releasable[node] >= gpus]
            heapq.heapify(heap)
            self._heaps[gpus] = (heap, [len(self._log)])
            return heap
        heap, read = self._heaps[gpus]
        lowered = self.lowered
        for floor, node, version in self._log[read[0]:]:
            if version == lowered[node] and free[node] + releasable[node] >= gpus:
                heapq.heappush(heap, (floor, max(1, gpus - free[node]), node, 0, version))
        read[0] = len(self._log)
        return heap

    def _scan(self, gpus: int, allowed: frozenset[str]) -> tuple[_Plan, str] | None:
        chosen: tuple[_Plan, str] | None = None
        for node in sorted(n for n in self.on_node if n in allowed):
            plan = self._plan(node, gpus)
            if plan is not None and (chosen is None or plan[:2] < chosen[0][:2]):
                chosen = (plan, node)
        return chosen

    def _lack(self, node: str, gpus: int) -> int | None:
        """The GPUs a pod of ``gpus`` lacks on ``node``, or None where no plan can free them."""
        lack = gpus - self.free.free[node]
        if lack > self.releasable[node] or lack > self.capacity[node]:
            return None
        return lack

    def _closer(self, node: str, gpus: int) -> float | None:
        """A bound on the loss of any plan on ``node`` for a pod of ``gpus``, or None where
        there is none: the least floor of the jobs whose pods there could free its lack alone,
        and the two least floors summed (a plan of two jobs or more; losses are not
        negative)."""
        lack = self._lack(node, gpus)
        if lack is None:
            return None
        alone = first = second = math.inf
        for job in self.on_node[node]:
            here = job.on.get(node)
            if not here:
                continue
            floor = job.floor
            if floor < alone and here * job.job.gpus_per_worker >= lack:
                alone = floor
            if floor < first:
                first, second = floor, first
            elif floor < second:
                second = floor
        if alone == second == math.inf:
            return None
        return min(alone, first + second)

    def _plan(self, node: str, gpus: int) -> _Plan | None:
        """The cheapest plan freeing what a pod of ``gpus`` lacks on ``node``, or None."""
        lack = self._lack(node, gpus)
        if lack is None:
            return None
        known = self._plans.get(node)
        if known is None:
            known = self._plans[node] = {}
        elif lack in known:
            return known[lack]
        plan = known[lack] = _cheapest(self.on_node[node], node, self.capacity[node], lack)
        return plan

    def took(self, node: str) -> None:
        """A pod took free GPUs on ``node``: a new version, whose key is no less."""
        if node in self.version:
            self.version[node] += 1

    def shrink(self, job: Shrinkable, to: int, node: str) -> None:
        """Shrink ``job`` to ``to`` workers, releasing on ``node`` first; its GPUs go free.
        Every node it ran on gets new plans, a new floor and a new bound in the log."""
        nodes = {p.node for p in job.pods}
        for gone in job.shrink(to, node):
            self.free.add(gone.node, gone.gpus)
            self.releasable[gone.node] -= gone.gpus
        for other in nodes:
            self._plans.pop(other, None)
            version = self.version[other] = self.lowered[other] = self.version[other] + 1
            floor = self.floor[other] = _least_floor(self.on_node[other], other)
            self._log.append((floor, other, version))


def _least_floor(jobs: list[Shrinkable], node: str) -> float:
    """The least floor of the jobs with pods on ``node``: at most any plan's loss there."""
    least = math.inf
    for job in jobs:
        if job.floor < least and job.on.get(node):
            least = job.floor
    return least


def _shrinkable(jobs: tuple[ElasticJob, ...], workers: dict[str, Pod]) -> list[Shrinkable]:
    """The jobs a scale-down may shrink, by key: enabled, not busy, with a scale table, above
    their minimum, and every member but the leader bound and labelled theirs."""
    found = []
    bound = workers.get
    for job in sorted(jobs, key=_KEY):
        if (not job.enabled or job.busy or job.scale_table is None
                or job.workers <= job.min_workers or len(job.members) != job.workers):
            continue
        pods = list(map(bound, job.members[1:]))
        if not all(pods) or not all(map(eq, repeat(job.key), map(_JOB, pods))):
            continue
        rows = Rows.of(job.scale_table)
        here = rows.at_most(job.workers)
        if here >= 0:
            found.append(Shrinkable(job, rows, rows.tps[here], job.workers, pods))
    return found
