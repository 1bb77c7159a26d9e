"""kopf registrations: indexes, spec validation and the control loop's start and stop.

Handlers stay thin: they turn watch events into index entries or call the Controller. kopf
keeps its own bookkeeping in annotations (not in status, which belongs to Tidal's types).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import kopf

from tidal_api import GROUP, VERSION
from tidal_operator.adapter import Adapter, ApiUnavailable
from tidal_operator.controller import Config, Controller
from tidal_operator.metrics import Metrics
from tidal_operator.snapshot import Node, gpus_of, node_of, pod_view

ETJ = (GROUP, VERSION, "elastictrainingjobs")

# Set by the entry point before kopf starts; the handlers below read it.
CONFIG = Config()
KUBECONFIG: str | None = None
METRICS_PORT: int | None = None
_state: dict[str, Any] = {}


@kopf.index("nodes")
def gpu_nodes(name: str, status: kopf.Status, spec: kopf.Spec, meta: kopf.Meta,
              **_: Any) -> dict[str, Node]:
    if spec.get("unschedulable"):
        return {}
    return {name: node_of(name, gpus_of(status.get("allocatable"), CONFIG.gpu_resource),
                          meta.get("labels"), spec.get("taints"))}


@kopf.index("pods")
def cluster_pods(body: kopf.Body, **_: Any) -> dict[str, Any]:
    pod = pod_view(body, CONFIG.gpu_resource)
    if pod.gpus == 0:
        return {}  # CPU-only pods neither hold GPUs nor wait for them
    return {pod.key: pod}


@kopf.index(*ETJ)
def elastic_jobs(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[str, Any]:
    return {f"{namespace}/{name}": dict(body)}


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod, the service account; elsewhere $KUBECONFIG (no client library needed)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, gpu_nodes: kopf.Index, cluster_pods: kopf.Index,
                elastic_jobs: kopf.Index, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = 30  # WARNING: kopf's own Events only for trouble
    metrics = Metrics()
    if METRICS_PORT is not None:
        metrics.serve(METRICS_PORT)
    controller = Controller(adapter=Adapter(KUBECONFIG), metrics=metrics, config=CONFIG,
                            nodes=gpu_nodes, pods=cluster_pods, jobs=elastic_jobs)
    stop = asyncio.Event()
    _state.update(controller=controller, stop=stop,
                  task=asyncio.create_task(controller.run(stop), name="tidal control loop"))


@kopf.on.cleanup()
async def stop(**_: Any) -> None:
    if not _state:
        return
    _state["stop"].set()
    await _state["task"]
    await _state["controller"].adapter.close()
    _state.clear()


@kopf.on.probe(id="lastRound")
def last_round(**_: Any) -> float:
    """Seconds since the control loop's last round, for the liveness endpoint."""
    controller = _state.get("controller")
    return time.time() - controller.last_round if controller and controller.last_round else -1.0


@kopf.on.resume(*ETJ)
@kopf.on.create(*ETJ)
@kopf.on.update(*ETJ, field="spec")
async def validate(body: kopf.Body, **_: Any) -> None:
    """Refuse a spec that cannot run with a condition and an Event; the loop does the rest."""
    controller: Controller | None = _state.get("controller")
    if controller is None:
        raise kopf.TemporaryError("the control loop is not running yet", delay=1)
    try:
        await controller.validate(dict(body), time.time())
    except ApiUnavailable as err:
        raise kopf.TemporaryError(str(err), delay=5) from err


@kopf.on.delete(*ETJ, optional=True)
def forget(namespace: str, name: str, **_: Any) -> None:
    """Drop the job's gauges and what the loop kept of it; its pods and Service go with it
    (owner references)."""
    controller: Controller | None = _state.get("controller")
    if controller is not None:
        controller.forget(namespace, name)
