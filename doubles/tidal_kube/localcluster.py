"""A scheduler and a kubelet for the API emulator: the cluster behind the operator's tests and
the one-machine cluster.

Both talk to the API over HTTP and keep no state of their own: every step reads nodes and pods
and writes what follows from them, so they can stop and restart at any time (or run twice)
without binding a pod twice or losing a pod's start time.

- :class:`Scheduler` binds each pending pod (no ``spec.nodeName``) through ``pods/binding`` to
  the first node, by name, whose allocatable GPUs fit its request beside the unfinished pods
  already bound there, in the kube-scheduler's order (higher priority first, then oldest);
  a pod that fits nowhere gets ``PodScheduled=False``, reason ``Unschedulable``, as the
  operator watches for. ``spec.nodeSelector`` and NoSchedule/NoExecute taints (against the
  pod's tolerations) are honoured; other resources and affinity are not.
- :class:`Kubelet` marks bound pods Running (with a start time and ready containers), a pod
  annotated ``tidal.dev/duration-seconds`` Succeeded once it has run that long (so a
  non-elastic job holds its GPUs for its duration and then frees them), and removes deleted
  pods at the start of their grace period (until then they hold their GPUs, as in a cluster).
  Given a :class:`PodRuntime`, the pods that runtime takes really run (the one-machine
  cluster runs worker pods as local processes): their phase follows the process, and a
  deleted pod is removed once its process is gone.

``await run(url)`` runs both until cancelled; from synchronous code,
``EmulatorThread.submit(run(url))`` returns a future whose ``cancel()`` stops it.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any, Protocol

import aiohttp

from tidal_operator.snapshot import Placement, gpus_of, node_of, pod_gpus

Obj = dict[str, Any]

GPU = "nvidia.com/gpu"
DURATION_ANNOTATION = "tidal.dev/duration-seconds"
SCHEDULER_NAME = "default-scheduler"
FINISHED = ("Succeeded", "Failed")
MERGE = {"Content-Type": "application/merge-patch+json"}


class ClusterApi:
    """The few API calls a scheduler and a kubelet make, over one HTTP session."""

    def __init__(self, url: str, session: aiohttp.ClientSession | None = None) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._owned = session is None

    async def __aenter__(self) -> ClusterApi:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._owned and self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, body: Any = None, ok: Iterable[int] = (),
                      headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """Send one request; an error status not in ``ok`` raises ClientResponseError."""
        assert self._session is not None, "use ClusterApi as an async context manager"
        data = None if body is None else json.dumps(body)
        headers = headers or {"Content-Type": "application/json"}
        url = self.url + path
        async with self._session.request(method, url, data=data, headers=headers) as rsp:
            payload = await rsp.json(content_type=None)
            if rsp.status >= 400 and rsp.status not in ok:
                message = payload.get("message") if isinstance(payload, dict) else payload
                raise aiohttp.ClientResponseError(rsp.request_info, (), status=rsp.status,
                                                  message=str(message))
            return rsp.status, payload

    async def items(self, path: str) -> list[Obj]:
        return (await self.request("GET", path))[1]["items"]

    async def patch_status(self, pod: Obj, status: Obj) -> None:
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        await self.request("PATCH", path, {"status": status}, ok=(404,), headers=MERGE)


def node_manifests(count: int, gpus_per_node: int, resource: str = GPU,
                   prefix: str = "node") -> list[Obj]:
    """``count`` Ready nodes named ``{prefix}-{i}`` with ``gpus_per_node`` of ``resource``."""
    nodes = []
    for index in range(count):
        name = f"{prefix}-{index}"
        resources = {resource: str(gpus_per_node), "cpu": "64", "memory": "512Gi", "pods": "110"}
        nodes.append({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "status": {"capacity": resources, "allocatable": resources,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "lastTransitionTime": _now()}]},
        })
    return nodes


def register_nodes(url: str, count: int, gpus_per_node: int, resource: str = GPU,
                   prefix: str = "node") -> list[str]:
    """Create the nodes of :func:`node_manifests` through the API at ``url`` (synchronously: do
    not call it from the emulator's own event loop; use :func:`create_nodes` there). Nodes that
    exist already are left as they are. Returns their names."""
    names = []
    for node in node_manifests(count, gpus_per_node, resource, prefix):
        request = urllib.request.Request(
            f"{url.rstrip('/')}/api/v1/nodes", data=json.dumps(node).encode(), method="POST",
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30):
                pass
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # AlreadyExists: registered before
                raise
        names.append(node["metadata"]["name"])
    return names


async def create_nodes(api: ClusterApi, count: int, gpus_per_node: int, resource: str = GPU,
                       prefix: str = "node") -> list[str]:
    """:func:`register_nodes` for async code."""
    for node in node_manifests(count, gpus_per_node, resource, prefix):
        await api.request("POST", "/api/v1/nodes", node, ok=(409,))
    return [f"{prefix}-{index}" for index in range(count)]


def gpu_request(pod: Obj, resource: str = GPU) -> int:
    """The pod's request of ``resource``, counted as the operator counts it."""
    return pod_gpus(pod.get("spec") or {}, resource)


def node_gpus(node: Obj, resource: str = GPU) -> int:
    status = node.get("status") or {}
    return gpus_of(status.get("allocatable") or status.get("capacity"), resource)


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


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _with_condition(conditions: list[Obj], condition: Obj) -> list[Obj]:
    """``conditions`` with ``condition`` in place of the one of its type; the transition time
    is kept when the condition's status does not change."""
    old = next((c for c in conditions if c.get("type") == condition["type"]), None)
    if old is not None and old.get("status") == condition["status"]:
        condition = {**condition, "lastTransitionTime": old.get("lastTransitionTime") or _now()}
    else:
        condition = {**condition, "lastTransitionTime": _now()}
    return [c for c in conditions if c.get("type") != condition["type"]] + [condition]


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
                   and p["spec"].get("schedulerName", SCHEDULER_NAME) == self.name
                   and p.get("status", {}).get("phase", "Pending") == "Pending"
                   and not p["metadata"].get("deletionTimestamp")]
        pending.sort(key=_queue_order)
        bound = []
        for pod in pending:
            wanted = gpu_request(pod, self.resource)
            where = Placement.of(pod["spec"].get("nodeSelector"), pod["spec"].get("tolerations"))
            selected = [v for v in views if where.node_selector <= v.labels]
            matching = [v.name for v in selected if where.allows(v)]
            fits = [name for name in matching if free[name] >= wanted]
            if fits and await self._bind(pod, fits[0]):
                free[fits[0]] -= wanted
                bound.append(f"{pod['metadata']['namespace']}/{pod['metadata']['name']}")
            elif not fits:
                await self._unschedulable(pod, len(nodes), len(selected), len(matching))
        return bound

    async def _bind(self, pod: Obj, node: str) -> bool:
        meta = pod["metadata"]
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"]},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding"
        status, _ = await self.api.request("POST", path, binding, ok=(404, 409))
        return status < 400  # 404: deleted meanwhile; 409: bound meanwhile (by another scheduler)

    async def _unschedulable(self, pod: Obj, nodes: int, selected: int, matching: int) -> None:
        """Say why, as the kube-scheduler does: ``0/2 nodes are available: 2 Insufficient ...``
        (``selected`` nodes match the pod's selector, ``matching`` of them tolerate it too)."""
        reasons = [f"{matching} Insufficient {self.resource}"] if matching else []
        if selected > matching:
            reasons.append(f"{selected - matching} node(s) had untolerated taint(s)")
        if nodes > selected:
            reasons.append(f"{nodes - selected} node(s) didn't match Pod's node affinity/selector")
        message = f"0/{nodes} nodes are available: {', '.join(reasons)}."
        condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": message, "lastProbeTime": None}
        conditions = (pod.get("status") or {}).get("conditions") or []
        current = next((c for c in conditions if c.get("type") == "PodScheduled"), {})
        if (current.get("status"), current.get("reason"), current.get("message")) == (
                "False", "Unschedulable", message):
            return  # said already: no write
        await self.api.patch_status(pod, {"conditions": _with_condition(conditions, condition)})


class PodRuntime(Protocol):
    """What really runs the containers of some pods; the kubelet asks it at every step, from
    one thread, and never blocks on it."""

    def takes(self, pod: Obj) -> bool:
        """Whether this runtime runs ``pod`` (else the kubelet runs it in name only)."""

    def start(self, pod: Obj) -> None:
        """Start the pod's containers (once: a second call for the same pod does nothing)."""

    def exit_code(self, pod: Obj) -> int | None:
        """None while the pod's containers run; their exit code once they have stopped."""

    def stop(self, pod: Obj) -> bool:
        """Stop the pod's containers within its grace period; True once they are gone."""

    def keep_only(self, uids: set[str]) -> None:
        """Stop the containers of pods that are no longer in the API (force-deleted)."""


class Kubelet:
    """Runs bound pods: in name only (Pending -> Running -> Succeeded after their duration), or
    through ``runtime`` for the pods it takes (Running while they run, then Succeeded or
    Failed by their exit code)."""

    def __init__(self, api: ClusterApi, runtime: PodRuntime | None = None) -> None:
        self.api = api
        self.runtime = runtime

    async def step(self, now: datetime.datetime | None = None) -> None:
        now = now or datetime.datetime.now(datetime.UTC)
        pods = await self.api.items("/api/v1/pods")
        if self.runtime is not None:
            self.runtime.keep_only({p["metadata"]["uid"] for p in pods})
        for pod in pods:
            if not pod["spec"].get("nodeName"):
                continue
            runtime = self.runtime if self.runtime is not None and self.runtime.takes(pod) else None
            if pod["metadata"].get("deletionTimestamp"):
                if runtime is None or runtime.stop(pod):
                    await self._terminated(pod)
                continue
            phase = pod.get("status", {}).get("phase")
            if phase == "Pending":
                if runtime is not None:
                    runtime.start(pod)
                await self.api.patch_status(pod, self._running(pod, now))
            elif phase == "Running" and runtime is not None:
                code = runtime.exit_code(pod)
                if code is not None:
                    await self.api.patch_status(pod, self._finished(pod, now, code))
            elif phase == "Running" and self._done(pod, now):
                await self.api.patch_status(pod, self._finished(pod, now))

    async def _terminated(self, pod: Obj) -> None:
        """A deleted pod's containers are gone at once: remove it (what a kubelet does once
        the grace period's kill is over). Finalizers, if any, still hold it."""
        if pod["metadata"].get("deletionGracePeriodSeconds"):
            meta = pod["metadata"]
            path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
            options = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                       "preconditions": {"uid": meta["uid"]}}
            await self.api.request("DELETE", path, options, ok=(404, 409))

    @staticmethod
    def _done(pod: Obj, now: datetime.datetime) -> bool:
        duration = (pod["metadata"].get("annotations") or {}).get(DURATION_ANNOTATION)
        started = pod.get("status", {}).get("startTime")
        if duration is None or started is None:
            return False
        return (now - _parse_time(started)).total_seconds() >= float(duration)

    @staticmethod
    def _running(pod: Obj, now: datetime.datetime) -> Obj:
        started = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        conditions = (pod.get("status") or {}).get("conditions") or []
        for kind in ("Initialized", "ContainersReady", "Ready"):
            conditions = _with_condition(conditions, {"type": kind, "status": "True"})
        return {
            "phase": "Running", "startTime": started, "hostIP": "127.0.0.1", "podIP": "127.0.0.1",
            "conditions": conditions,
            "containerStatuses": [
                {"name": c["name"], "image": c.get("image", ""),
                 "imageID": f"local://{c.get('image', '')}", "ready": True, "started": True,
                 "restartCount": 0, "state": {"running": {"startedAt": started}}}
                for c in pod["spec"].get("containers") or []],
        }

    @staticmethod
    def _finished(pod: Obj, now: datetime.datetime, exit_code: int = 0) -> Obj:
        """Succeeded on exit code 0, else Failed (a negative code: killed by that signal)."""
        finished = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        status = pod.get("status") or {}
        conditions = status.get("conditions") or []
        reason = "PodCompleted" if exit_code == 0 else "PodFailed"
        for kind in ("ContainersReady", "Ready"):
            condition = {"type": kind, "status": "False", "reason": reason}
            conditions = _with_condition(conditions, condition)
        code = exit_code if exit_code >= 0 else 128 - exit_code  # as a shell reports a signal
        return {
            "phase": "Succeeded" if exit_code == 0 else "Failed", "conditions": conditions,
            "containerStatuses": [
                {**c, "ready": False, "started": False,
                 "state": {"terminated": {"exitCode": code,
                                          "reason": "Completed" if exit_code == 0 else "Error",
                                          "startedAt": status.get("startTime"),
                                          "finishedAt": finished}}}
                for c in status.get("containerStatuses") or []],
        }


async def run(url: str, interval_s: float = 0.2, resource: str = GPU,
              runtime: PodRuntime | None = None) -> None:
    """Schedule and run pods against the API at ``url`` every ``interval_s`` seconds, until
    cancelled (``runtime``: see :class:`Kubelet`). A lost connection is retried on the next
    step; an error answer is raised (it means a bug here or in the emulator)."""
    async with ClusterApi(url) as api:
        scheduler, kubelet = Scheduler(api, resource), Kubelet(api, runtime)
        while True:
            try:
                await scheduler.step()
                await kubelet.step()
            except (aiohttp.ClientConnectionError, TimeoutError):
                pass  # the API may restart; the next step starts afresh
            await asyncio.sleep(interval_s)
