"""The one-machine cluster: an API server, GPU nodes, a scheduler, a kubelet that runs worker
pods as processes, the real operator and a generator of competing GPU jobs.

``LocalCluster(config).start()`` (or ``with LocalCluster(config) as cluster:``):

1. serves the Kubernetes API emulator on ``127.0.0.1:<port>`` from a thread of this process
   and writes a kubeconfig for it (kubectl, helm, lightkube and kopf all read it);
2. creates what ``helm install`` of the chart would create around the operator: the CRD
   (built by :func:`tidal_api.crd.crd`, which ``crds/`` is generated from), the workers'
   ServiceAccount ``tidal-worker`` and the PriorityClasses
   ``tidal-elastic`` (workers yield) and ``tidal-default``, owned by the release that
   ``helm install tidal charts/tidal --namespace tidal`` makes, so that this install adopts
   them instead of refusing to touch them;
3. registers ``nodes`` Ready nodes with ``gpus_per_node`` GPUs each;
4. runs the scheduler and kubelet of :mod:`tidal_kube.localcluster`, the kubelet with
   :class:`~tidal_local.processes.AgentProcesses` as its runtime: worker pods run
   ``tidal agent``, other pods hold their GPUs for their ``tidal.dev/duration-seconds``;
5. starts ``tidal-operator`` as a process (``--interval``, ``--metrics-port``);
6. starts the :class:`~tidal_local.arrivals.ArrivalGenerator`, if configured.

``stop()`` undoes it in reverse: the generator, the operator, every pod's process (SIGTERM,
then SIGKILL), the scheduler and kubelet, the API. Every child process carries
``TIDAL_LOCAL_RUN=<run id>`` in its environment (see :mod:`.processes`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal_api import keys
from tidal_api.crd import crd
from tidal_kube import localcluster
from tidal_operator.builders import WORKER_SERVICE_ACCOUNT
from tidal_kube.serving import EmulatorThread
from tidal_local.arrivals import ArrivalConfig, ArrivalGenerator
from tidal_local.processes import RUN_ENV, AgentProcesses, free_port, spawn, terminate

log = logging.getLogger(__name__)

# As charts/tidal's values.yaml sets them: elastic workers below pods without a class (0),
# never preempting; tidal-default for the non-elastic jobs here.
PRIORITY_CLASSES = (
    {"metadata": {"name": keys.ELASTIC_PRIORITY_CLASS}, "value": -10,
     "preemptionPolicy": "Never",
     "description": "Elastic Tidal workers, scheduled after every other pod and never "
                    "preempting one."},
    {"metadata": {"name": keys.DEFAULT_PRIORITY_CLASS}, "value": 1000,
     "description": "The Tidal operator and non-elastic work that opts in, above elastic "
                    "workers."},
)

# Helm installs over an existing object only when it carries the release's ownership metadata
# ("invalid ownership metadata" otherwise), and the PriorityClasses are cluster-wide: without
# this, the documented `helm install tidal charts/tidal --namespace tidal --create-namespace`
# fails against `tidal local up`. The CRD needs none: Helm skips a chart's crds/ that exist.
HELM_RELEASE = "tidal"
HELM_RELEASE_NAMESPACE = "tidal"


def owned_by_release(metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` with the ownership metadata of the release ``tidal`` in namespace
    ``tidal``, which Helm checks before it adopts an object that exists."""
    return {**metadata, "labels": {"app.kubernetes.io/managed-by": "Helm"},
            "annotations": {"meta.helm.sh/release-name": HELM_RELEASE,
                            "meta.helm.sh/release-namespace": HELM_RELEASE_NAMESPACE}}


class ClusterError(RuntimeError):
    """A part of the local cluster failed; the message says which and where its log is."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterConfig:
    """How the one-machine cluster is laid out (see the module's docstring)."""

    workdir: Path
    nodes: int = 2
    gpus_per_node: int = 4
    port: int = 0
    kubeconfig: Path | None = None  # default: workdir/kubeconfig
    namespace: str = "default"
    operator_interval_s: float = 1.0
    metrics_port: int | None = None  # default: a free port
    kubelet_interval_s: float = 0.2
    publish_interval_s: float = 1.0
    arrivals: ArrivalConfig | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("the cluster needs at least one node with at least one GPU")


def prerequisites(namespace: str) -> list[dict[str, Any]]:
    """What the chart installs besides the operator: the CRD, the workers' ServiceAccount and
    the two PriorityClasses."""
    objects = [crd()]
    objects.append({"apiVersion": "v1", "kind": "ServiceAccount",
                    "metadata": owned_by_release({"name": WORKER_SERVICE_ACCOUNT,
                                                  "namespace": namespace})})
    for priority_class in PRIORITY_CLASSES:
        objects.append({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                        "globalDefault": False, **priority_class,
                        "metadata": owned_by_release(priority_class["metadata"])})
    return objects


class LocalCluster:
    """The running cluster: ``url``, ``kubeconfig``, ``run_id``, ``runtime`` (the worker
    processes), ``generator`` (its ``arrivals``), ``metrics_port``."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        # Inherited where set, so that a caller can find every process of a run it started.
        self.run_id = os.environ.get(RUN_ENV) or uuid.uuid4().hex[:12]
        self.workdir = config.workdir
        self.kubeconfig = config.kubeconfig or config.workdir / "kubeconfig"
        self.metrics_port = config.metrics_port or free_port()
        self.generator = ArrivalGenerator(config.arrivals) if config.arrivals else None
        self.runtime: AgentProcesses | None = None
        self._emulator: EmulatorThread | None = None
        self._operator = None
        self._tasks: dict[str, concurrent.futures.Future] = {}
        self.started_at = 0.0

    @property
    def url(self) -> str:
        assert self._emulator is not None, "start the cluster first"
        return self._emulator.url

    @property
    def operator_log(self) -> Path:
        return self.workdir / "logs" / "operator.log"

    def start(self) -> LocalCluster:
        c = self.config
        for stale in ("logs", "reports"):  # an earlier run's: its leader report would mislead
            shutil.rmtree(self.workdir / stale, ignore_errors=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        try:
            self._emulator = EmulatorThread(port=c.port, kubeconfig=self.kubeconfig).start()
            for obj in prerequisites(c.namespace):
                self._emulator.call(self._emulator.emulator.create, obj)
            localcluster.register_nodes(self.url, c.nodes, c.gpus_per_node)
            self.runtime = AgentProcesses(kubeconfig=self.kubeconfig.resolve(),
                                          workdir=self.workdir.resolve(), run_id=self.run_id,
                                          publish_interval_s=c.publish_interval_s)
            self._tasks["scheduler and kubelet"] = self._emulator.submit(
                localcluster.run(self.url, c.kubelet_interval_s, runtime=self.runtime))
            self._start_operator()
            if self.generator is not None:
                self._tasks["arrival generator"] = self._emulator.submit(
                    self.generator.run(self.url))
        except BaseException:
            self.stop()
            raise
        return self

    def _start_operator(self) -> None:
        exe = Path(sys.executable).with_name("tidal-operator")
        env = {**os.environ, RUN_ENV: self.run_id, "PYTHONUNBUFFERED": "1"}
        self._operator = spawn(
            [str(exe), "--kubeconfig", str(self.kubeconfig), "--interval",
             str(self.config.operator_interval_s), "--metrics-port", str(self.metrics_port)],
            env=env, log_path=self.operator_log)

    def restart_operator(self, sig: int = signal.SIGKILL) -> None:
        """Kill the operator (``sig`` to its process group, as a node's loss or an OOM kill
        would end it) and start it again: a restarted operator carries on from what the API
        holds, without duplicates (tests/e2e/test_operator_loss.py)."""
        if self._operator is not None:
            os.killpg(self._operator.pid, sig)
            self._operator.wait()
        self._start_operator()

    def check(self) -> None:
        """Raise :class:`ClusterError` if a part has stopped on its own."""
        if self._operator is not None and self._operator.poll() is not None:
            raise ClusterError(f"tidal-operator exited with code {self._operator.returncode}; "
                               f"see {self.operator_log}")
        for name, task in self._tasks.items():
            if task.done():
                error = None if task.cancelled() else task.exception()
                raise ClusterError(f"the {name} stopped: {error!r}")
        if self._emulator is not None and self._emulator.emulator.failures:
            raise ClusterError(f"the API emulator failed: {self._emulator.emulator.failures!r}")

    def stop(self) -> None:
        """Stop everything this cluster started, children first; safe to call twice."""
        generator = self._tasks.pop("arrival generator", None)
        self._cancel(generator)
        if self._operator is not None:
            terminate(self._operator, grace_s=10.0)
            self._operator = None
        for task in list(self._tasks.values()):  # no pod starts or changes phase from now on
            self._cancel(task)
        self._tasks.clear()
        if self.runtime is not None:
            self.runtime.close(grace_s=10.0)
        if self._emulator is not None:
            self._emulator.stop()
            self._emulator = None

    @staticmethod
    def _cancel(task: concurrent.futures.Future | None) -> None:
        if task is None:
            return
        task.cancel()
        try:
            task.result(timeout=5)
        except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):
            pass
        except Exception as err:  # noqa: BLE001 - check() reports these while running
            log.warning("stopping: %r", err)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
