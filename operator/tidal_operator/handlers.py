"""kopf registrations: indexes, spec validation and the control loop's start and stop.

Handlers stay thin: they turn watch events into index entries or call the Controller. What
they share lives in kopf's ``memo`` (the entry point sets ``config``, ``kubeconfig`` and
``metrics_port``; the startup handler adds the ``controller`` and its task), never in module
globals, so that two operators in one process do not share state. kopf keeps its own
bookkeeping in annotations (not in status, which belongs to Tidal's types).
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from tidal_api import GROUP, VERSION
from tidal_operator.adapter import CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S, Adapter, ApiUnavailable
from tidal_operator.controller import Config, Controller
from tidal_operator.metrics import Metrics
from tidal_operator.queues import (
    PODGROUPS,
    WORKLOADS,
    PodGroup,
    podgroup_of,
    podgroup_view,
    workload_demand,
)
from tidal_operator.snapshot import Node, Pod, gpus_of, node_of, pod_view

ETJ = (GROUP, VERSION, "elastictrainingjobs")
# The API server ends each watch after this (kopf then watches again from where it stopped);
# the client gives up on a watch silent for a little longer, so that a dead connection is
# noticed rather than waited on forever.
WATCH_SERVER_TIMEOUT_S = 300.0
WATCH_CLIENT_TIMEOUT_S = WATCH_SERVER_TIMEOUT_S + 30.0


def memo_for(config: Config, *, kubeconfig: str | None = None,
             metrics_port: int | None = None) -> kopf.Memo:
    """The operator's memo, as the entry point gives it to ``kopf.run``."""
    return kopf.Memo(config=config, kubeconfig=kubeconfig, metrics_port=metrics_port)


@kopf.index("nodes")
def gpu_nodes(name: str, status: kopf.Status, spec: kopf.Spec, meta: kopf.Meta,
              memo: kopf.Memo, **_: Any) -> dict[str, Node]:
    if spec.get("unschedulable"):
        return {}
    return {name: node_of(name, gpus_of(status.get("allocatable"), memo.config.gpu_resource),
                          meta.get("labels"), spec.get("taints"))}


@kopf.index("pods")
def cluster_pods(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    pod = pod_view(body, memo.config.gpu_resource)
    if pod.gpus == 0 and pod.job is None:
        return {}  # other CPU-only pods neither hold GPUs nor wait for them (a job's
        # rendezvous pod is one of its own: the job restarts without it)
    return {pod.key: pod}


@kopf.index(*ETJ)
def elastic_jobs(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[str, Any]:
    return {f"{namespace}/{name}": dict(body)}


# ---- queued demand: registered by watch_queues, for the sources that are on --------------------


def kueue_workloads(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, tuple[Pod, ...]]:
    """Kueue Workloads that wait for admission, as their pending pods."""
    demand = workload_demand(body, memo.config.gpu_resource)
    meta = body["metadata"]
    return {f"{meta.get('namespace', 'default')}/{meta['name']}": demand} if demand else {}


def volcano_podgroups(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, PodGroup]:
    """Volcano PodGroups Pending or Inqueue."""
    group = podgroup_view(body, memo.config.gpu_resource)
    return {group.key: group} if group is not None else {}


def volcano_members(body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, Pod]:
    """The pods of each PodGroup, by the group's "ns/name" (many pods under one key)."""
    group = podgroup_of(body)
    return {group: pod_view(body, memo.config.gpu_resource)} if group is not None else {}


QUEUE_INDEXES = {
    "kueue": ((WORKLOADS, kueue_workloads),),
    "volcano": ((PODGROUPS, volcano_podgroups), ("pods", volcano_members)),
}
# Controller fields <- the indexes of queued demand that feed them.
QUEUED = {"workloads": kueue_workloads.__name__, "podgroups": volcano_podgroups.__name__,
          "members": volcano_members.__name__}


def watch_queues(config: Config, registry: kopf.OperatorRegistry | None = None) -> None:
    """Index the queue sources that ``config`` turns on. kopf serves an index only where its
    resource exists; it watches the CRDs and starts one when its CRD appears later. A source
    that is off is not watched at all, so that the operator needs no access to it."""
    for source, indexes in QUEUE_INDEXES.items():
        if getattr(config, source):
            for resource, index in indexes:
                kopf.index(resource, registry=registry)(index)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod, the service account; elsewhere $KUBECONFIG (no client library needed)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def configure(settings: kopf.OperatorSettings) -> None:
    """kopf's settings: its bookkeeping in annotations, its own Events only for trouble, and
    every timeout explicit (kopf's defaults leave watches and connections without one)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = 30  # WARNING
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_S
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT_S
    settings.watching.connect_timeout = CONNECT_TIMEOUT_S
    settings.networking.request_timeout = REQUEST_TIMEOUT_S
    settings.networking.connect_timeout = CONNECT_TIMEOUT_S


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, gpu_nodes: kopf.Index,
                cluster_pods: kopf.Index, elastic_jobs: kopf.Index, **kwargs: Any) -> None:
    configure(settings)
    metrics = Metrics()
    if memo.get("metrics_port") is not None:
        metrics.serve(memo.metrics_port)
    controller = Controller(adapter=Adapter(memo.get("kubeconfig")), metrics=metrics,
                            config=memo.config, nodes=gpu_nodes, pods=cluster_pods,
                            jobs=elastic_jobs,
                            # the queue indexes that watch_queues registered
                            **{name: kwargs[index] for name, index in QUEUED.items()
                               if index in kwargs})
    # Set before kopf starts watching: each object's memo is a shallow copy of this one.
    memo.controller = controller
    memo.stop = asyncio.Event()
    memo.task = asyncio.create_task(controller.run(memo.stop), name="tidal control loop")


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    controller: Controller | None = memo.pop("controller", None)
    if controller is None:
        return
    memo.stop.set()
    await memo.task
    await controller.adapter.close()


@kopf.on.probe(id="lastRound")
def last_round(memo: kopf.Memo, **_: Any) -> float:
    """Seconds since the control loop's last round, for the liveness endpoint."""
    controller: Controller | None = memo.get("controller")
    if controller is None or not controller.last_round:
        return -1.0
    return controller.clock() - controller.last_round


@kopf.on.resume(*ETJ)
@kopf.on.create(*ETJ)
@kopf.on.update(*ETJ, field="spec")
async def validate(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Refuse a spec that cannot run with a condition and an Event; the loop does the rest."""
    controller: Controller | None = memo.get("controller")
    if controller is None:
        raise kopf.TemporaryError("the control loop is not running yet", delay=1)
    try:
        await controller.validate(dict(body), controller.clock())
    except ApiUnavailable as err:
        raise kopf.TemporaryError(str(err), delay=5) from err


@kopf.on.delete(*ETJ, optional=True)
def forget(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Drop the job's gauges and what the loop kept of it; its pods and Service go with it
    (owner references)."""
    controller: Controller | None = memo.get("controller")
    if controller is not None:
        controller.forget(namespace, name)
