"""The local scheduler: binds pending pods to nodes by GPUs, and says why a pod fits nowhere as
kube-scheduler says it.

- Each pending pod (no ``spec.nodeName``, this scheduler's name, no scheduling gate left: as
  kube-scheduler's SchedulingGates plugin, a gated pod waits outside the queue) is bound through
  ``pods/binding`` to the first node, by name, that passes the filters, in kube-scheduler's
  queue order (higher priority first, then oldest).
- The filters run in the order of kube-scheduler's default plugins, and the first to refuse a
  node gives its reason: NoSchedule/NoExecute taints against the pod's tolerations, then
  ``spec.nodeSelector``, then the GPUs left beside the unfinished pods already bound there.
  Other resources, node affinity and preemption are not emulated.
- A pod that fits nowhere gets ``PodScheduled=False`` (reason ``Unschedulable``, as the operator
  watches for) and a Warning ``FailedScheduling`` Event, both with kube-scheduler's message:
  ``0/3 nodes are available: 1 node(s) had untolerated taint {dedicated: inference}, 2
  Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: 1 Preemption is not
  helpful for scheduling, 2 No preemption victims found for incoming pod.``

The scheduler keeps no state, so it may stop, restart or run twice: the pod's condition is its
memory. Both are written only when the message changes, not on every pass; an Event said before
(the same pod, the same message) counts up instead, as client-go's event correlator does.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Iterable

from tidal_kube.clusterapi import (FINISHED, GPU, MERGE, ClusterApi, gpu_request, node_gpus,
                                   with_condition)
from tidal_kube.resources import Obj, now_rfc3339
from tidal_operator.snapshot import BLOCKING_EFFECTS, Node, Placement, node_of

SCHEDULER_NAME = "default-scheduler"
SELECTOR_MISMATCH = "node(s) didn't match Pod's node affinity/selector"
# What preemption says of a node: it could make room (only where GPUs lack), but this
# scheduler never evicts; or nothing it could evict would help.
NO_VICTIMS = "No preemption victims found for incoming pod"
NOT_HELPFUL = "Preemption is not helpful for scheduling"


@dataclasses.dataclass(frozen=True, slots=True)
class Rejection:
    """Why a node cannot take a pod, in the words of the kube-scheduler filter that refuses it."""

    reason: str
    resolvable: bool  # whether evicting other pods could make room


class Scheduler:
    """Binds pending pods to nodes by GPUs (see the module's docstring)."""

    def __init__(self, api: ClusterApi, resource: str = GPU, name: str = SCHEDULER_NAME) -> None:
        self.api = api
        self.resource = resource
        self.name = name

    async def step(self) -> list[str]:
        """One pass over the pending pods; returns ``namespace/name`` of the pods it bound."""
        nodes = sorted((n for n in await self.api.items("/api/v1/nodes") if _ready(n)),
                       key=lambda n: n["metadata"]["name"])
        pods = await self.api.items("/api/v1/pods")
        # GPUs, labels and taints, as the operator's Placement reads them
        views = [node_of(n["metadata"]["name"], node_gpus(n, self.resource),
                         n["metadata"].get("labels"), (n.get("spec") or {}).get("taints"))
                 for n in nodes]
        free = {v.name: v.gpus for v in views}
        for pod in pods:
            node = pod["spec"].get("nodeName")
            if node in free and pod.get("status", {}).get("phase") not in FINISHED:
                free[node] -= gpu_request(pod, self.resource)
        pending = [p for p in pods if not p["spec"].get("nodeName")
                   and not p["spec"].get("schedulingGates")
                   and p["spec"].get("schedulerName", SCHEDULER_NAME) == self.name
                   and p.get("status", {}).get("phase", "Pending") == "Pending"
                   and not p["metadata"].get("deletionTimestamp")]
        pending.sort(key=_queue_order)
        bound = []
        for pod in pending:
            wanted = gpu_request(pod, self.resource)
            where = Placement.of(pod["spec"].get("nodeSelector"), pod["spec"].get("tolerations"))
            rejections = {v.name: self._rejection(v, where, wanted, free[v.name]) for v in views}
            fits = [name for name, rejection in rejections.items() if rejection is None]
            if fits and await self._bind(pod, fits[0]):
                free[fits[0]] -= wanted
                bound.append(f"{pod['metadata']['namespace']}/{pod['metadata']['name']}")
            elif not fits:
                await self._unschedulable(pod, fit_error(r for r in rejections.values() if r))
        return bound

    def _rejection(self, node: Node, where: Placement, wanted: int,
                   free: int) -> Rejection | None:
        """The first filter that refuses ``node``, in kube-scheduler's order; None if it fits."""
        taint = next((t for t in node.taints if t.effect in BLOCKING_EFFECTS
                      and not any(toleration.tolerates(t) for toleration in where.tolerations)),
                     None)
        if taint is not None:
            return Rejection(f"node(s) had untolerated taint {{{taint.key}: {taint.value}}}",
                             resolvable=False)
        if not where.node_selector <= node.labels:
            return Rejection(SELECTOR_MISMATCH, resolvable=False)
        if free < wanted:
            return Rejection(f"Insufficient {self.resource}", resolvable=True)
        return None

    async def _bind(self, pod: Obj, node: str) -> bool:
        meta = pod["metadata"]
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"]},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding"
        status, _ = await self.api.request("POST", path, binding, ok=(404, 409))
        return status < 400  # 404: deleted meanwhile; 409: bound meanwhile (by another scheduler)

    async def _unschedulable(self, pod: Obj, message: str) -> None:
        """Say why, once per reason: the Event first, so that a failed condition write only
        makes the next pass count the Event up."""
        condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": message, "lastProbeTime": None}
        conditions = (pod.get("status") or {}).get("conditions") or []
        current = next((c for c in conditions if c.get("type") == "PodScheduled"), {})
        if (current.get("status"), current.get("reason"), current.get("message")) == (
                "False", "Unschedulable", message):
            return  # said already: no write
        await self._failed_scheduling(pod, message)
        await self.api.patch_status(pod, {"conditions": with_condition(conditions, condition)})

    async def _failed_scheduling(self, pod: Obj, message: str) -> None:
        """A Warning Event on the pod, as kube-scheduler records one (core/v1, as ``kubectl
        describe pod`` lists them). Named after the pod and the message, so that the same
        again counts up."""
        meta = pod["metadata"]
        digest = hashlib.sha256(f"{meta['uid']}\n{message}".encode()).hexdigest()[:16]
        name, now = f"{meta['name']}.{digest}", now_rfc3339()
        path = f"/api/v1/namespaces/{meta['namespace']}/events"
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"],
                               "resourceVersion": meta.get("resourceVersion", "")},
            "type": "Warning", "reason": "FailedScheduling", "action": "Scheduling",
            "message": message, "source": {"component": self.name},
            "reportingComponent": self.name, "reportingInstance": self.name,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        status, _ = await self.api.request("POST", path, event, ok=(409,))
        if status != 409:
            return
        status, seen = await self.api.request("GET", f"{path}/{name}", ok=(404,))
        if status != 404:
            count = {"count": (seen.get("count") or 1) + 1, "lastTimestamp": now}
            await self.api.request("PATCH", f"{path}/{name}", count, ok=(404,), headers=MERGE)


def fit_error(rejections: Iterable[Rejection]) -> str:
    """kube-scheduler's message for a pod no node takes: each filter's reason with the count
    of nodes it refused, then what preemption found (as ``FitError.Error()`` writes it)."""
    rejections = list(rejections)
    if not rejections:
        return "no nodes available to schedule pods"
    total = len(rejections)
    filters = _histogram(r.reason for r in rejections)
    preemption = _histogram(NO_VICTIMS if r.resolvable else NOT_HELPFUL for r in rejections)
    return (f"0/{total} nodes are available: {filters}. "
            f"preemption: 0/{total} nodes are available: {preemption}.")


def _histogram(reasons: Iterable[str]) -> str:
    """``2 Insufficient nvidia.com/gpu, 1 node(s) ...``: counts, sorted as kube-scheduler does
    (as strings)."""
    counts = collections.Counter(reasons)
    return ", ".join(sorted(f"{count} {reason}" for reason, count in counts.items()))


def _ready(node: Obj) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = [c for c in conditions if c.get("type") == "Ready"]
    unschedulable = (node.get("spec") or {}).get("unschedulable")
    return not unschedulable and (not ready or ready[0].get("status") == "True")


def _queue_order(pod: Obj) -> tuple[int, str, str, str]:
    """The kube-scheduler's queue: higher priority first, then the oldest."""
    meta = pod["metadata"]
    priority = pod["spec"].get("priority", 0)
    return (-priority, meta["creationTimestamp"], meta["namespace"], meta["name"])
