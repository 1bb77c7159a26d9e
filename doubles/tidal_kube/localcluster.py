"""A local cluster behind the API emulator: Ready GPU nodes (:func:`node_manifests`,
:func:`register_nodes`, :func:`create_nodes`) and :func:`run`, the scheduler
(:mod:`tidal_kube.scheduler`) and the kubelet (:mod:`tidal_kube.kubelet`) stepping together;
:func:`queue_crds` for a cluster that runs Kueue or Volcano. This is the cluster behind the
operator's tests and the one-machine cluster.

``await run(url)`` runs both until cancelled; from synchronous code,
``EmulatorThread.submit(run(url))`` returns a future whose ``cancel()`` stops it.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp

from tidal_kube.clusterapi import GPU, ClusterApi
from tidal_kube.kubelet import Kubelet, PodRuntime
from tidal_kube.resources import Obj, now_rfc3339
from tidal_kube.scheduler import Scheduler
from tidal_kube.serving import load_manifests

__all__ = ["create_nodes", "node_manifests", "queue_crds", "register_nodes", "run"]

# Kueue's Workload and Volcano's PodGroup CRDs, trimmed to what Tidal reads (see each file).
QUEUE_CRDS = {"kueue": Path(__file__).with_name("crds") / "workloads.kueue.x-k8s.io.yaml",
              "volcano": Path(__file__).with_name("crds") / "podgroups.scheduling.volcano.sh.yaml"}


def queue_crds(*sources: str) -> list[Obj]:
    """The CRDs of the batch queues named (``kueue``, ``volcano``), for a cluster that runs
    them: the operator counts the jobs waiting there as demand."""
    return list(load_manifests(QUEUE_CRDS[source] for source in sources))


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
                                       "lastTransitionTime": now_rfc3339()}]},
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


async def run(url: str, interval_s: float = 0.2, resource: str = GPU,
              runtime: PodRuntime | None = None) -> None:
    """Schedule and run pods against the API at ``url`` every ``interval_s`` seconds, until
    cancelled (``runtime``: see :class:`~tidal_kube.kubelet.Kubelet`). A lost connection is
    retried on the next step; an error answer is raised (it means a bug here or in the
    emulator)."""
    async with ClusterApi(url) as api:
        scheduler, kubelet = Scheduler(api, resource), Kubelet(api, runtime)
        while True:
            try:
                await scheduler.step()
                await kubelet.step()
            except (aiohttp.ClientConnectionError, TimeoutError):
                pass  # the API may restart; the next step starts afresh
            await asyncio.sleep(interval_s)
