"""Scale down: room for pending pods, from the elastic workers that cost the least throughput.

See :func:`make_room`. Each job shrinks only to a kept scale-table row, never below its
minimum, never releasing its leader; which pods a job releases and for whom is returned as
:class:`Shrinkable` records, which :func:`tidal_operator.policy.decide` turns into decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal_operator.capacity import FreeGPUs, Rows, Where
from tidal_operator.snapshot import ElasticJob, Pod, Snapshot


@dataclass(slots=True)
class Shrinkable:
    """A job the scale-down may shrink, as it stands after the releases decided so far."""

    job: ElasticJob
    rows: Rows
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
                candidate = (plan[0] + loss, plan[1] + freed, (*plan[2], (job, to)))
                if grown[more] is None or candidate[:2] < grown[more][:2]:
                    grown[more] = candidate
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
    capacity = {node.name: node.gpus for node in snapshot.nodes}
    shrinkable = _shrinkable(snapshot.jobs, workers)
    on_node: dict[str, list[Shrinkable]] = {}
    releasable = dict.fromkeys(capacity, 0)  # an upper bound on what a node can free
    for job in shrinkable:
        for pod in job.pods:
            jobs_here = on_node.setdefault(pod.node, [])
            if not jobs_here or jobs_here[-1] is not job:
                jobs_here.append(job)
            releasable[pod.node] += pod.gpus
    candidates = sorted(on_node)
    cache: dict[str, list[_Plan | None]] = {}
    touched: list[Shrinkable] = []
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
    return touched


def _shrinkable(jobs: tuple[ElasticJob, ...], workers: dict[str, Pod]) -> list[Shrinkable]:
    found = []
    for job in sorted(jobs, key=lambda j: j.key):
        if (not job.enabled or job.busy or job.scale_table is None
                or job.workers <= job.min_workers or len(job.members) != job.workers):
            continue
        pods = [workers[key] for key in job.members[1:]
                if key in workers and workers[key].job == job.key]
        if len(pods) != job.workers - 1:
            continue
        rows = Rows.of(job.scale_table)
        here = rows.at_most(job.workers)
        if here >= 0:
            found.append(Shrinkable(job, rows, rows.tps[here], job.workers, pods))
    return found
