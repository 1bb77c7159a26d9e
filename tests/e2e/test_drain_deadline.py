"""DESIGN.md section 3's fault path through the real operator: a worker that does not drain is
deleted at the drain deadline, and the job goes on without a restart; a worker that dies
unasked is replaced, and the job goes back to its minimum without a restart; so is a leader
killed; a leader terminated, or the rendezvous pod lost, costs a restart, from the step
boundary the leader halted at or the one the members' peer snapshots hold.

The one-machine cluster of ``tidal local`` (the API emulator, scheduler and kubelet,
``tidal-operator``, one ``tidal agent`` process per worker pod); the tests only stop or kill a
worker's process and ask for a GPU with a non-elastic pod, as another team would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from lightkube import Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.resources.core_v1 import Event, Pod

from tidal_agent.link import ElasticTrainingJobResource as ETJ
from tidal_agent.runner import run_local
from tidal_api import parse_job
from tidal_local.arrivals import batch_pod
from tidal_local.cluster import ClusterConfig, LocalCluster
from tidal_plan.layout import resolve_layout

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "default"
# Every test's last event comes by step 70 here (a replacement's generation, at 62-67); the
# job trains on after it, and one static run of this length serves every test's bitwise check.
STEPS = 100


def _until(check, timeout_s: float, what: str, cluster: LocalCluster):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cluster.check()
        if value := check():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; operator log:\n"
                         f"{cluster.operator_log.read_text()[-3000:]}")


def _tiny(steps: int, workers: dict, **spec) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["metadata"] = {"name": "tiny", "namespace": NAMESPACE}
    doc["spec"]["workers"] = workers
    doc["spec"]["training"]["steps"] = steps
    doc["spec"].update(spec)
    return doc


@contextlib.contextmanager
def _running(doc: dict, tmp_path: Path, gpus: int):
    """The one-machine cluster with ``gpus`` GPUs on one node, running the job ``doc``:
    (the cluster, an API client, a function that reads the job's status)."""
    config = ClusterConfig(workdir=tmp_path / "local", nodes=1, gpus_per_node=gpus,
                           operator_interval_s=0.3, publish_interval_s=0.2)
    with LocalCluster(config) as cluster:
        api = Client(KubeConfig.from_file(cluster.kubeconfig).get())
        try:
            api.create(ETJ(doc), namespace=NAMESPACE)
            yield cluster, api, lambda: dict(
                api.get(ETJ, "tiny", namespace=NAMESPACE)).get("status") or {}
        finally:
            api.close()


_STATIC: dict[str, dict] = {}  # static runs by what decides their bits


def _static(doc: dict, workers: int) -> dict:
    """The report of a static run of ``doc``'s model and training at ``workers``: run once per
    module for every test that asks (its bits depend on nothing else), with no checkpoints."""
    spec = {k: doc["spec"][k] for k in ("model", "training", "parallelism") if k in doc["spec"]}
    key = json.dumps([spec, workers], sort_keys=True)
    if key not in _STATIC:
        job = parse_job({**doc, "spec": {k: v for k, v in doc["spec"].items()
                                         if k != "checkpoint"}})
        _STATIC[key] = run_local(job, resolve_layout(job, workers=workers),
                                 steps=spec["training"]["steps"], timeout_s=120)
    return _STATIC[key]


def _bitwise_static(report: dict, doc: dict, workers: int, *parts: dict) -> None:
    """The job's losses and parameters are a static run's at ``workers``, bit for bit: the
    report's steps and final parameters, and the steps of the ``parts`` (earlier runs of a
    restarted job, each from where it started) where they ran."""
    steps = doc["spec"]["training"]["steps"]
    first = report["steps"][0]["step"] if parts else 0
    assert [s["step"] for s in report["steps"]] == list(range(first, steps))
    static = _static(doc, workers)
    for part in (*parts, report):
        assert [s["loss_hex"] for s in part["steps"]] == [
            static["steps"][s["step"]]["loss_hex"] for s in part["steps"]]
    assert report["params_sha256"] == static["params_sha256"]


@pytest.mark.timeout(420)
def test_a_worker_that_does_not_drain_is_deleted_and_the_job_goes_on(tmp_path):
    # A grace period of 2 s, not Kubernetes' 30: the kill comes sooner, the path is the same.
    doc = _tiny(STEPS, {"min": 2, "max": 3},
                checkpoint={"path": str(tmp_path / "ckpt"), "everySteps": 10,
                            "snapshotEverySteps": 1},
                scaling={"probabilityThreshold": 0.5, "cooldownSeconds": 0,
                         "switchOverheadSeconds": 1, "drainTimeoutSeconds": 3},
                template={"terminationGracePeriodSeconds": 2})
    w0, w1, w2 = (f"tiny-worker-{i}" for i in range(3))
    with _running(doc, tmp_path, gpus=3) as (cluster, api, status):
        # The third GPU is idle: the operator grows the job into it.
        _until(lambda: status().get("members") == [w0, w1, w2], 120, "the scale-up", cluster)
        hung = cluster.runtime.pids()[f"{NAMESPACE}/{w2}"]
        os.killpg(hung, signal.SIGSTOP)
        api.create(Pod.from_dict(batch_pod("batch", NAMESPACE, gpus=1, duration_s=600)))
        target = _until(lambda: (t := status().get("target")) and t.get("release") and t,
                        30, "the scale-down", cluster)
        assert target["release"] == [w2]
        # Deleted at the deadline (and killed after the pod's grace period, as a kubelet
        # does): the survivors go on in the generation the scale-down asked for.
        shrunk = _until(lambda: (s := status()).get("members") == [w0, w1] and s, 120,
                        "the survivors' generation", cluster)
        assert shrunk["generation"] == target["generation"]
        _until(lambda: api.get(Pod, "batch", namespace=NAMESPACE).status.phase == "Running",
               60, "the non-elastic pod to run", cluster)
        _until(lambda: status().get("phase") == "Succeeded", 240, "the job to finish", cluster)
        reasons = {e.reason for e in api.list(Event, namespace=NAMESPACE)}
        assert {"ScaleUp", "ScaleDown", "DrainDeadline"} <= reasons, reasons
        report = json.loads(cluster.runtime.report_path(NAMESPACE, w0).read_text())

    (recovery,) = report["recoveries"]
    assert recovery["lost"] == [w2] and recovery["members"] == [w0, w1]
    # From the peer snapshots (the default), one at every boundary here: the step in flight is
    # replayed, and the one before where the lost pod's newest copy had not reached its keeper.
    assert recovery["snapshot"] is True and recovery["checkpoint"] is None
    assert 0 <= recovery["failed_at"] - recovery["resumed_at"] <= 2
    _bitwise_static(report, doc, workers=2)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["killed", "terminated"])
def test_a_worker_that_dies_unasked_is_replaced_and_the_job_goes_on(tmp_path, sig):
    """SIGKILL: the worker dies mid-step and is lost once silent. SIGTERM (a pod deleted,
    preempted or drained): it leaves at its next step boundary and says so, so it is lost at
    once."""
    doc = _tiny(STEPS, {"min": 2, "max": 2}, checkpoint={"snapshotEverySteps": 1})
    w0, w1, w2 = (f"tiny-worker-{i}" for i in range(3))
    with _running(doc, tmp_path, gpus=2) as (cluster, api, status):
        _until(lambda: (s := status()).get("members") == [w0, w1] and s.get("step", 0) >= 20,
               120, "the job at step 20", cluster)
        os.killpg(cluster.runtime.pids()[f"{NAMESPACE}/{w1}"], sig)
        # The survivor goes on alone, then the operator brings the job back to its minimum
        # with a new pod, under a new name.
        restored = _until(lambda: (s := status()).get("members") == [w0, w2] and s, 120,
                          "the replacement's generation", cluster)
        assert restored["lost"] == [w1]
        assert restored["target"]["reason"] == "BelowMinimum"
        _until(lambda: status().get("phase") == "Succeeded", 240, "the job to finish", cluster)
        pods = {p.metadata.name: p.status.phase for p in api.list(Pod, namespace=NAMESPACE)}
        # Killed, its pod stays Failed (for its logs); terminated, it ends Succeeded; either
        # way unless the operator saw it lost while the kubelet still had it Running, and
        # deleted it (the agent publishes a loss in well under a second, about as soon as
        # the kubelet sees the process end).
        assert pods.get(w1, "gone") in (("Succeeded", "gone") if sig == signal.SIGTERM
                                        else ("Failed", "gone"))
        report = json.loads(cluster.runtime.report_path(NAMESPACE, w0).read_text())

    (recovery,) = report["recoveries"]
    assert recovery["lost"] == [w1] and recovery["members"] == [w0]
    assert recovery["left"] == ([w1] if sig == signal.SIGTERM else [])
    assert recovery["snapshot"] is True
    # Killed, it may die mid-step, its newest copy on the way to its keeper (up to two steps
    # replayed at a snapshot every step); terminated, it leaves at a boundary once its copy
    # of it is whole at its keeper.
    assert recovery["failed_at"] - recovery["resumed_at"] in ((0,) if sig == signal.SIGTERM
                                                              else (0, 1, 2))
    assert [g["members"] for g in report["generations"]][-2:] == [[w0], [w0, w2]]
    _bitwise_static(report, doc, workers=2)  # 2 workers, then 1, then 2 again


@pytest.mark.timeout(480)
def test_a_lost_leader_costs_no_restart_and_a_lost_rendezvous_one(tmp_path):
    """A leader terminated (its pod deleted, preempted or its node drained) halts the job at
    a step boundary that every member saves, and the operator restarts it from there. The
    rendezvous pod killed takes the store with it: the members save the boundary their peer
    snapshots hold, and the operator restarts the job from there. A leader killed is lost
    like any member: a survivor leads the job on from the peer snapshots, no restart, and the
    operator replaces it."""
    root = tmp_path / "ckpt"
    doc = _tiny(STEPS, {"min": 2, "max": 2}, checkpoint={"path": str(root), "everySteps": 1000,
                                                         "snapshotEverySteps": 1})
    w0, w1, w2 = (f"tiny-worker-{i}" for i in range(3))
    rendezvous = "tiny-rendezvous"
    with _running(doc, tmp_path, gpus=2) as (cluster, api, status):
        _until(lambda: (s := status()).get("members") == [w0, w1] and s.get("step", 0) >= 15,
               120, "the job at step 15", cluster)
        os.killpg(cluster.runtime.pids()[f"{NAMESPACE}/{w0}"], signal.SIGTERM)
        _until(lambda: status().get("restarts") == 1, 120, "the first restart", cluster)
        # The first leader's report, written before it exited; the last one writes it at the end.
        halted = json.loads(cluster.runtime.report_path(NAMESPACE, w0).read_text())
        at = halted["halted"]["step"]
        seen = _until(lambda: (s := status()).get("members") == [w0, w1]
                      and s.get("step", 0) >= at + 15 and s, 120, "15 steps more", cluster)
        os.killpg(cluster.runtime.pids()[f"{NAMESPACE}/{rendezvous}"], signal.SIGKILL)
        _until(lambda: status().get("restarts") == 2, 120, "the second restart", cluster)
        again = _until(lambda: (s := status()).get("members") == [w0, w1]
                       and s.get("step", 0) >= seen["step"] + 10 and s, 120,
                       "10 steps after the second restart", cluster)
        os.killpg(cluster.runtime.pids()[f"{NAMESPACE}/{w0}"], signal.SIGKILL)
        _until(lambda: status().get("members") == [w1, w2], 120,
               "the survivor's generation and the replacement's", cluster)
        _until(lambda: status().get("phase") == "Succeeded", 240, "the job to finish", cluster)
        final = status()
        restarts = sorted((e.message for e in api.list(Event, namespace=NAMESPACE)
                           if e.reason == "Restarted"), key=lambda m: "restart 2" in m)
        report = json.loads(cluster.runtime.report_path(NAMESPACE, w1).read_text())
        survivor = (cluster.workdir / "logs" / NAMESPACE / f"{w1}.log").read_text()

    # Terminated: the halt's boundary, saved by every member; nothing lost.
    assert at >= 15 and [s["step"] for s in halted["steps"]] == list(range(at))
    assert halted["halted"]["checkpoint"] == str(root / f"step-{at:08d}")
    assert restarts[0] == (f"the leader {w0} stopped when asked at step {at}: restart 1, from "
                           "the newest checkpoint under spec.checkpoint.path")  # no failure
    # The rendezvous killed: the members saved the newest boundary the peer snapshots (one
    # every step) held whole, at most the step in flight and the one before behind what the
    # job had published.
    rescued = report["generations"][0]["at_step"]
    assert rescued >= seen["step"] - 2 and rescued > at
    assert report["resumed_from"] == str(root / f"step-{rescued:08d}")
    assert f"the peer snapshots of step {rescued} are saved" in survivor
    assert restarts[1].startswith(f"the rendezvous {rendezvous} failed (exit code 137) at step ")
    assert restarts[1].endswith(": restart 2, failure 1 of 3, from the newest checkpoint under "
                                "spec.checkpoint.path")
    # The leader killed: no restart; the survivor led on from the peer snapshots, with the
    # history the first leader kept (the steps from the second restart on), and the
    # replacement joined it.
    assert len(restarts) == 2 and final["restarts"] == 2
    (recovery,) = report["recoveries"]
    assert recovery["lost"] == [w0] and recovery["snapshot"]
    assert recovery["resumed_at"] >= again["step"] - 2
    assert report["members"] == [w1, w2] and w0 in final["lost"]
    assert f"{w1} takes the lead: the leader {w0} is lost" in survivor
    # The runs' steps, where each ran, and the final parameters are a static run's, bit for bit.
    _bitwise_static(report, doc, 2, halted)
