"""Membership over time: which workers form each generation of an elastic job.

Two sources of generations, one rule for forming them: survivors keep their order (so the
leader is rank 0 of every world) and joiners are appended after them.

- A worker schedule ``0:2,4:3,8:4,12:2`` (``tidal run``) says how many workers run from which
  step on; joiners get fresh ids and a shrink releases the last workers.
- A ``status.target`` of the ElasticTrainingJob (the operator, at run time) names the pods that
  join or the pods it releases, which may be any members but the leader: ``next_generation``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from tidal_api import ElasticTrainingJob, JobSpec, Target
from tidal_api.layout import Layout, LayoutError
from tidal_plan.layout import build_layout, resolve_layout


class ScheduleError(ValueError):
    """A worker schedule that cannot be followed; the message says how to fix it."""


class TargetError(ValueError):
    """A status.target the agent cannot apply; the message says what is wrong with it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Generation:
    """Who trains from ``at_step`` on. ``index`` numbers the membership changes (the operator's
    target generations); ``revision`` the re-plans of one membership around stragglers (the
    same members, another layout), which the operator does not number."""

    index: int
    at_step: int
    members: tuple[str, ...]
    revision: int = 0

    @property
    def key(self) -> tuple[int, int]:
        return (self.index, self.revision)

    @property
    def world(self) -> str:
        """The name of its world (with the index, a store prefix of its own)."""
        return "train" if self.revision == 0 else f"replan{self.revision}"


def parse_worker_schedule(text: str, *, steps: int, max_workers: int) -> list[tuple[int, int]]:
    """``"0:2,4:3"`` -> [(0, 2), (4, 3)], checked: starts at step 0, increasing, in range."""
    entries = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+):(\d+)", part)
        if match is None:
            raise ScheduleError(f"worker schedule entry {part!r}: expected STEP:WORKERS, e.g. 4:3")
        entries.append((int(match.group(1)), int(match.group(2))))
    if not entries or entries[0][0] != 0:
        raise ScheduleError("the worker schedule must start at step 0, e.g. 0:2,4:3")
    for (a, _), (b, _) in zip(entries, entries[1:], strict=False):
        if b <= a:
            raise ScheduleError(f"worker schedule steps must increase: {a} then {b}")
    for step, workers in entries:
        if not 1 <= workers <= max_workers:
            raise ScheduleError(
                f"worker schedule {step}:{workers}: use between 1 and {max_workers} workers"
            )
        if step >= steps:
            raise ScheduleError(f"worker schedule step {step} is past the run's {steps} steps")
    return entries


def generations(schedule: list[tuple[int, int]]) -> list[Generation]:
    """The members of every generation; entries that do not change the count are merged."""
    gens: list[Generation] = []
    next_id = 0
    members: tuple[str, ...] = ()
    for at_step, count in schedule:
        if gens and count == len(members):
            continue
        if count <= len(members):
            members = members[:count]
        else:
            fresh = tuple(f"worker-{next_id + i}" for i in range(count - len(members)))
            next_id += len(fresh)
            members = members + fresh
        gens.append(Generation(index=len(gens), at_step=at_step, members=members))
    return gens


def all_workers(gens: list[Generation]) -> list[str]:
    """Every worker id that takes part, in order of first appearance."""
    seen: dict[str, None] = {}
    for gen in gens:
        seen.update(dict.fromkeys(gen.members))
    return list(seen)


def next_generation(current: Generation, target: Target, *, at_step: int) -> Generation:
    """The generation ``target`` asks for after ``current``, switching at ``at_step``.

    The target is read as a desired state, not a delta, so a stale entry left over from an
    earlier target is harmless: pods in ``join`` are members afterwards, pods in ``release``
    are not. Survivors keep their order and new members follow in the target's order; any
    member but the leader (the first) may be released. A switch either adds or removes pods,
    never both, because the state moves over one world that holds every pod involved (the new
    world when growing, the old one when shrinking). ``target.workers`` must agree with the
    result. A target that changes no member gives the same members under a new index.
    """
    generation = target.generation
    if generation <= current.index:
        raise TargetError(f"target generation {generation} is not after the applied {current.index}")
    if current.members[0] in target.release:
        raise TargetError(
            f"target generation {generation} releases the leader {current.members[0]}, "
            "which hosts the rendezvous and must stay"
        )
    if both := sorted(set(target.join) & set(target.release)):
        raise TargetError(f"target generation {generation} both joins and releases {both}")
    joiners = tuple(dict.fromkeys(p for p in target.join if p not in current.members))
    leavers = [m for m in current.members if m in target.release]
    if joiners and leavers:
        raise TargetError(
            f"target generation {generation} adds {list(joiners)} and releases {leavers} at "
            "once: release first, then add in a later generation"
        )
    members = tuple(m for m in current.members if m not in leavers) + joiners
    if len(members) != target.workers:
        raise TargetError(
            f"target generation {generation} asks for {target.workers} workers but "
            f"{len(current.members)} members + {len(joiners)} joining - {len(leavers)} released "
            f"= {len(members)}"
        )
    return Generation(index=generation, at_step=at_step, members=members)


def logical_replicas(spec: JobSpec) -> int:
    """L, the job's logical data-parallel replicas (``parallelism.logicalReplicas``).

    The global batch's micro-batches split into L contiguous logical replicas; each one's
    gradient is summed in micro-batch order, and the L sums in one fixed binary tree over the
    logical indices, so the result does not depend on the physical dp (a power of two dividing
    L). Unset: 1 (the plain micro-batch order), or with strict ``elastic: dp-pp`` the smallest
    power of two at least ``workers.max`` that divides the micro-batch count (else the largest
    that does).
    """
    par, micro_batches = spec.parallelism, spec.training.num_micro_batches
    if par.logical_replicas is not None:
        if micro_batches % par.logical_replicas:
            raise LayoutError(spec.contradiction())
        return par.logical_replicas
    if par.elastic != "dp-pp" or par.consistency != "strict":
        return 1
    return default_logical_replicas(spec.workers.max, micro_batches)


def default_logical_replicas(max_workers: int, micro_batches: int) -> int:
    """The smallest power of two at least ``max_workers`` that divides ``micro_batches``
    (else the largest that does): room for every dp a table up to ``max_workers`` may use."""
    replicas = 1
    while replicas < max_workers and micro_batches % (2 * replicas) == 0:
        replicas *= 2
    return replicas


def subtrees(start: int, end: int) -> list[tuple[int, int]]:
    """The subtrees of the binary tree over logical replicas that replicas ``start`` to
    ``end - 1`` alone complete, as (level, index) in order: left to right, a subtree and the
    one before it of the same level form their parent where the one before is a left child."""
    out: list[tuple[int, int]] = []
    for leaf in range(start, end):
        level, index = 0, leaf
        while out and out[-1][0] == level and out[-1][1] % 2 == 0:
            level, index = level + 1, out.pop()[1] // 2
        out.append((level, index))
    return out


def replica_subtrees(layout: Layout, logical: int) -> list[list[tuple[int, int]]]:
    """Each data-parallel replica's subtrees of the ``logical`` replicas' tree (its share of
    the micro-batches must be whole logical replicas): one each where the shares are even."""
    per = layout.global_micro_batches // logical
    out = []
    for replica in range(layout.dp):
        first, count = layout.replica_offset(replica), layout.replica_micro_batches(replica)
        if first % per or count % per:
            raise LayoutError(
                f"{layout.describe()}: replica {replica}'s micro-batches are not whole logical "
                f"replicas of {per}; give each replica a multiple of {per}")
        out.append(subtrees(first // per, (first + count) // per))
    return out


def share_unit(spec: JobSpec, layout: Layout) -> int:
    """The micro-batches a replica's share of the step is made of: in strict mode a logical
    replica's (the physical replicas themselves where the job has no logical ones), else one."""
    if spec.parallelism.consistency != "strict":
        return 1
    replicas = logical_replicas(spec)
    return layout.global_micro_batches // (replicas if replicas > 1 else layout.dp)


def strict_data_parallel(spec: JobSpec) -> bool:
    """Whether dp may change under strict consistency (the logical replicas' tree)."""
    return spec.parallelism.elastic == "dp-pp" and spec.parallelism.consistency == "strict"


def data_parallel_degree(spec: JobSpec) -> int | None:
    """dp at any worker count: 1 with ``elastic: pp``; None with ``elastic: dp-pp``, the
    planner's pick per count (strict: a dp that divides the logical replicas; relaxed: any dp
    that divides the micro-batches, their gradients summed by the backend's all-reduce)."""
    return None if spec.parallelism.elastic == "dp-pp" else 1


def _replicas_of_the_first(spec: JobSpec, base_workers: int, workers: int) -> int:
    """dp without the planner: relaxed ``dp-pp`` runs k data-parallel replicas of the first
    pipeline at k times the first count (where the micro-batches split evenly); anything else
    scales pp at dp 1."""
    par = spec.parallelism
    if par.elastic != "dp-pp" or par.consistency != "relaxed" or workers % base_workers:
        return 1
    k = workers // base_workers
    return k if spec.training.num_micro_batches % k == 0 else 1


LayoutChooser = Callable[[int, int | None], Layout]


def elastic_plan(
    job: ElasticTrainingJob,
    schedule: list[tuple[int, int]],
    *,
    kind: str | None = None,
    choose: LayoutChooser | None = None,
) -> tuple[list[Generation], list[Layout]]:
    """Generations and their layouts for a worker schedule like [(0, 2), (4, 3)].

    ``choose(workers, dp)`` (the planner) picks each layout where given, at
    ``data_parallel_degree``'s dp; otherwise the units are split evenly under the spec's
    schedule (or ``kind``), in replicas of the first pipeline where relaxed ``dp-pp`` allows.
    """
    gens = generations(schedule)
    base = len(gens[0].members)
    micro_batches = job.spec.training.num_micro_batches
    layouts = []
    for gen in gens:
        n = len(gen.members)
        if choose is not None:
            layouts.append(choose(n, data_parallel_degree(job.spec)))
            continue
        dp = _replicas_of_the_first(job.spec, base, n)
        if dp == 1:
            layouts.append(resolve_layout(job, workers=n, schedule=kind))
        else:
            first = resolve_layout(job, workers=base, schedule=kind)
            layouts.append(build_layout(
                num_units=first.num_units, workers=n, dp=dp, partition=first.partition,
                micro_batch_size=first.micro_batch_size, num_micro_batches=micro_batches,
                schedule=first.schedule, virtual_stages=first.virtual_stages,
                activation_checkpointing=first.activation_checkpointing,
            ))
    return gens, layouts
