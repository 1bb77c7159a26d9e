"""Issue 39, item 3, end to end: a job that grew into an idle GPU of the one-machine cluster
(``tidal local``: the emulator, scheduler and kubelet, ``tidal-operator``, one ``tidal
agent`` per worker pod) gives it back when a Kueue Workload waits for it, and the Workload's
pod runs on it once admitted.

The cluster runs Kueue's Workload CRD (tidal_kube/crds, created after the operator started);
the test plays Kueue: it admits the Workload and creates its job's pod, as Kueue's job
integration would once it unsuspends the job.
"""

from __future__ import annotations

import urllib.request

import pytest
from lightkube import codecs
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from tests.e2e.test_drain_deadline import NAMESPACE, _running, _tiny, _until
from tidal_api import keys
from tidal_kube.localcluster import queue_crds
from tidal_local.arrivals import batch_pod
from tidal_operator.adapter import rfc3339

pytestmark = pytest.mark.slow

WORKLOAD = create_namespaced_resource("kueue.x-k8s.io", "v1beta2", "Workload", "workloads")


def _metric(cluster, name: str) -> float:
    """A sample of the operator's metrics, by its name and labels as exposed."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(f"{name} "))


def _workload(name: str, gpus: int) -> dict:
    """What Kueue makes of a suspended batch Job of one pod asking for ``gpus`` GPUs."""
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"queueName": "user-queue", "podSets": [{
                "name": "main", "count": 1, "template": {"spec": {"containers": [{
                    "name": "main", "image": "busybox:1.36",
                    "resources": {"limits": {"nvidia.com/gpu": gpus}}}]}}}]}}


def _admitted(gpus: int) -> dict:
    reserved = {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved",
                "message": "Quota reserved in ClusterQueue cluster-queue",
                "lastTransitionTime": rfc3339(0)}
    return {"status": {
        "conditions": [reserved, {**reserved, "type": "Admitted", "reason": "Admitted",
                                  "message": "The workload is admitted"}],
        "admission": {"clusterQueue": "cluster-queue", "podSetAssignments": [{
            "name": "main", "count": 1, "flavors": {"nvidia.com/gpu": "default-flavor"},
            "resourceUsage": {"nvidia.com/gpu": gpus}}]}}}


@pytest.mark.timeout(180)
def test_a_grown_job_gives_a_gpu_back_to_a_waiting_workload_whose_pod_then_runs(tmp_path):
    doc = _tiny(1000, {"min": 2, "max": 3},
                scaling={"probabilityThreshold": 0.5, "cooldownSeconds": 0,
                         "switchOverheadSeconds": 1, "drainTimeoutSeconds": 30})
    w0, w1, w2 = (f"tiny-worker-{i}" for i in range(3))
    with _running(doc, tmp_path, gpus=3) as (cluster, api, status):
        for crd in queue_crds("kueue"):
            api.create(codecs.from_dict(crd))
        _until(lambda: status().get("members") == [w0, w1, w2], 120, "the scale-up", cluster)

        # A batch Job of one 1-GPU pod waits in Kueue: its Workload, and no pod yet.
        api.create(codecs.from_dict(_workload("batch", 1)))
        target = _until(lambda: (t := status().get("target")) and t.get("release") and t,
                        30, "the scale-down", cluster)
        assert (target["release"], target["reason"]) == ([w2], "PendingGPUPods")
        _until(lambda: status().get("members") == [w0, w1]
               and status().get("generation") == target["generation"], 60,
               "the job at 2 workers", cluster)
        _until(lambda: w2 not in {p.metadata.name for p in api.list(Pod, namespace=NAMESPACE)},
               30, "the released pod gone", cluster)
        # Rounds go by with its GPU idle and the Workload waiting: no scale-up.
        rounds = _metric(cluster, "tidal_decision_seconds_count")
        _until(lambda: _metric(cluster, "tidal_decision_seconds_count") >= rounds + 5, 30,
               "five control rounds", cluster)
        assert _metric(cluster, 'tidal_queued_gpu_demand{source="kueue"}') == 1
        assert status()["target"]["generation"] == target["generation"]
        # Kueue admits it and its job's pod is created: it runs on the GPU given back.
        api.patch(WORKLOAD.Status, "batch", _admitted(1), namespace=NAMESPACE,
                  patch_type=PatchType.MERGE)
        api.create(codecs.from_dict(batch_pod("batch-0", NAMESPACE, gpus=1, duration_s=600)))
        _until(lambda: api.get(Pod, "batch-0", namespace=NAMESPACE).status.phase == "Running",
               30, "the admitted Workload's pod to run", cluster)
        # Between the admission and the pod's creation the GPU looks idle, and a control round
        # there may decide a scale-up (docs/queues.md, Limits); its worker then waits, and the
        # job's running workers are its two members.
        workers = api.list(Pod, namespace=NAMESPACE, labels={keys.JOB_LABEL: "tiny"})
        assert {p.metadata.name for p in workers if p.status.phase == "Running"
                and (p.metadata.labels or {}).get(keys.ROLE_LABEL) == "worker"} == {w0, w1}
