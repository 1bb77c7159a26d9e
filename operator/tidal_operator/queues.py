"""Demand that a batch queue holds before its pods exist, as pending pods for ``decide()``.

Kueue keeps a job suspended (no pods) until it admits the job's Workload; Volcano holds a
PodGroup Pending or Inqueue before its pods run. Without these records the policy sees no
demand while jobs wait in such a queue, and keeps the GPUs they wait for. Each waiting pod of
a queued job becomes a :class:`~tidal_operator.snapshot.Pod` with no node, phase Pending, no
job, the GPUs of one pod, the placement of its pod template and the queued object's creation
time, keyed so that it never collides with a real pod (``kueue:<ns>/<workload>/<podset>/<i>``,
``volcano:<ns>/<podgroup>/<i>``). The policy then treats them as it treats pending pods.

Nothing is counted twice:

- a Workload that has reserved quota (``QuotaReserved`` True) has, or is about to have, pods:
  those count, as pods; a finished or deactivated one waits for nothing;
- a Workload owned by pods is Kueue's record of plain pods (one pod, or a pod group: pods
  labelled ``kueue.x-k8s.io/pod-group-name``). Those pods exist, held by the scheduling gate
  ``kueue.x-k8s.io/admission`` (Pending, no node, PodScheduled False SchedulingGated), and
  count as pending pods; the Workload does not;
- a PodGroup's demand is what its pods that exist do not cover: its members (pods annotated
  ``scheduling.k8s.io/group-name``) that have not finished count as pods, pending or bound.

A PodGroup's GPUs are ``spec.minResources`` where it names the GPU resource, else
``minMember`` times the GPUs of its pods (the largest member's: a group's members are alike
as a rule); a group without either and without pods asks for nothing Tidal can see. The
missing GPUs are split into pods of one member's GPUs (from its pods, else ``minResources``
over ``minMember``, rounded up), placed as its first member is, else anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tidal_operator.snapshot import ANYWHERE, Placement, Pod, gpus_of, parse_time, pod_gpus

KUEUE_GROUP = "kueue.x-k8s.io"
VOLCANO_GROUP = "scheduling.volcano.sh"
# The resources Tidal watches (versionless: the version the API server prefers).
WORKLOADS = f"workloads.{KUEUE_GROUP}"
PODGROUPS = f"podgroups.{VOLCANO_GROUP}"

# Kueue's plain-pod integration: the gate its webhook adds, the labels and annotation of a pod
# group (kubernetes-sigs/kueue pkg/controller/constants, site docs "Run Plain Pods").
KUEUE_ADMISSION_GATE = f"{KUEUE_GROUP}/admission"
KUEUE_QUEUE_LABEL = f"{KUEUE_GROUP}/queue-name"
KUEUE_POD_GROUP_LABEL = f"{KUEUE_GROUP}/pod-group-name"
KUEUE_POD_GROUP_COUNT = f"{KUEUE_GROUP}/pod-group-total-count"
# The annotation that makes a pod a member of a Volcano PodGroup.
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
# PodGroup phases in which the group waits: not yet enqueued, or enqueued and not running.
WAITING_PHASES = frozenset({"Pending", "Inqueue"})
# The sources, as the keys of their pod records begin ("kueue:...", "volcano:...").
SOURCES = ("kueue", "volcano")


def source_of(pod: Pod) -> str | None:
    """The queue a pending pod record stands in for, or None for a real pod (a pod's key,
    "ns/name", has no colon: Kubernetes names cannot)."""
    source, colon, _ = pod.key.partition(":")
    return source if colon else None


def _conditions(status: Mapping[str, Any]) -> dict[str, str]:
    return {c.get("type"): c.get("status") for c in status.get("conditions") or ()}


def _owned_by_pods(meta: Mapping[str, Any]) -> bool:
    return any(ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1"
               for ref in meta.get("ownerReferences") or ())


def workload_waits(body: Mapping[str, Any]) -> bool:
    """Whether a Kueue Workload waits for admission and no pod stands for it: not admitted
    (no ``QuotaReserved`` condition, or not True), active, not finished, not being deleted, and
    not the Workload of plain pods (see the module's docstring)."""
    meta, spec = body["metadata"], body.get("spec") or {}
    conditions = _conditions(body.get("status") or {})
    return (conditions.get("QuotaReserved") != "True" and conditions.get("Finished") != "True"
            and spec.get("active", True) is not False and not meta.get("deletionTimestamp")
            and not _owned_by_pods(meta))


def workload_demand(body: Mapping[str, Any], resource: str) -> tuple[Pod, ...]:
    """The pending pods of a Kueue Workload that waits (:func:`workload_waits`): each pod
    set's ``count`` pods of its template's GPUs; none for a Workload that does not wait."""
    if not workload_waits(body):
        return ()
    meta = body["metadata"]
    where = f"{meta.get('namespace', 'default')}/{meta['name']}"
    created = parse_time(meta.get("creationTimestamp")) or 0.0
    pods: list[Pod] = []
    for pod_set in body["spec"].get("podSets") or ():
        spec = (pod_set.get("template") or {}).get("spec") or {}
        gpus = pod_gpus(spec, resource)
        if gpus <= 0:
            continue
        placement = Placement.of(spec.get("nodeSelector"), spec.get("tolerations"))
        name = pod_set.get("name", "main")
        pods += [Pod(key=f"kueue:{where}/{name}/{i}", gpus=gpus, created=created,
                     placement=placement) for i in range(int(pod_set.get("count", 1)))]
    return tuple(pods)


@dataclass(frozen=True, slots=True)
class PodGroup:
    """A Volcano PodGroup that waits (phase Pending or Inqueue): ``key`` is "ns/name",
    ``gpus`` the GPUs of ``spec.minResources`` (None where it names none)."""

    key: str
    min_member: int
    gpus: int | None
    created: float


def podgroup_view(body: Mapping[str, Any], resource: str) -> PodGroup | None:
    """The index entry of a PodGroup: what its demand needs, while it waits; else None."""
    meta, spec = body["metadata"], body.get("spec") or {}
    if (body.get("status") or {}).get("phase", "Pending") not in WAITING_PHASES or meta.get(
            "deletionTimestamp"):
        return None
    minimum = spec.get("minResources") or {}
    return PodGroup(key=f"{meta.get('namespace', 'default')}/{meta['name']}",
                    min_member=int(spec.get("minMember") or 0),
                    gpus=gpus_of(minimum, resource) if resource in minimum else None,
                    created=parse_time(meta.get("creationTimestamp")) or 0.0)


def podgroup_of(body: Mapping[str, Any]) -> str | None:
    """The "ns/name" of the PodGroup a pod belongs to (its group-name annotation), or None."""
    meta = body["metadata"]
    group = (meta.get("annotations") or {}).get(VOLCANO_GROUP_ANNOTATION)
    return f"{meta.get('namespace', 'default')}/{group}" if group else None


def podgroup_demand(group: PodGroup, members: Iterable[Pod]) -> tuple[Pod, ...]:
    """The pending pods of a waiting PodGroup: the GPUs it asks for that its unfinished
    members do not hold or ask for already, in pods of one member's GPUs (see the module's
    docstring)."""
    members = sorted(members, key=lambda p: p.key)
    live = [m for m in members if not m.finished]
    each = max((m.gpus for m in members), default=0)
    total = group.gpus if group.gpus is not None else group.min_member * each
    missing = total - sum(m.gpus for m in live)
    if missing <= 0:
        return ()
    each = each or math.ceil(total / max(group.min_member, 1))
    placement = members[0].placement if members else ANYWHERE
    count = math.ceil(missing / each)
    return tuple(Pod(key=f"volcano:{group.key}/{i}", created=group.created, placement=placement,
                     gpus=each if i < count - 1 else missing - each * (count - 1))
                 for i in range(count))
