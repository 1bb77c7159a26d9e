"""The real operator process against the Kubernetes API emulator, over HTTP (issue 5, item 7).

The emulator serves the API; a scheduler and kubelet of the local cluster bind pods to GPU
nodes and mark them Running (or Unschedulable); ``tidal-operator`` runs as a subprocess. The
test plays the agent leader's side of the protocol (status.generation, members, scale table)
as the agent would: it applies a target only once the joiners run, and a released pod "exits"
(phase Succeeded) before the leader reports the smaller generation.

Where a test checks that nothing happens, it waits for the operator's rounds to go by (counted
from its metrics), not for a time. The timers (drain deadline, cooldown, the leader's absence,
the arrival window) are tested on an injected clock in test_controller.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import kmock
import pytest
import yaml
from lightkube import Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Event, Node, Pod, Service
from lightkube.types import PatchType
from prometheus_client.parser import text_string_to_metric_families

from tidal_api import Layout, ScaleRow, ScaleTable
from tidal_kube import localcluster
from tidal_kube.serving import EmulatorThread, load_manifests

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ETJ = create_namespaced_resource("tidal.dev", "v1alpha1", "ElasticTrainingJob",
                                 "elastictrainingjobs")
NS = "default"
TIMEOUT_S = 40.0


def wait_for(what: str, check, timeout_s: float = TIMEOUT_S, every_s: float = 0.2, seen=None):
    """Poll ``check`` until it returns something truthy; fail with ``what`` (and what ``seen``
    returns then) on timeout."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}" + (f"; saw {seen()!r}" if seen else ""))


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Operator:
    """``tidal-operator`` as a subprocess, restartable; its log goes to a file."""

    def __init__(self, kubeconfig: Path, log: Path) -> None:
        self.kubeconfig, self.log, self.proc = kubeconfig, log, None
        self.metrics_port = free_port()

    def start(self) -> None:
        exe = Path(sys.executable).with_name("tidal-operator")
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                [str(exe), "--kubeconfig", str(self.kubeconfig), "--interval", "0.3",
                 "--metrics-port", str(self.metrics_port)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def rounds(self) -> int:
        """Control rounds this process has run; 0 until it serves its metrics."""
        try:
            return int(self.metrics()["tidal_decision_seconds_count"])
        except OSError:
            return 0

    def await_rounds(self, count: int = 3, since: int | None = None) -> None:
        """Wait until ``count`` more rounds (after ``since``, by default now) have run."""
        start = self.rounds() if since is None else since
        wait_for(f"{count} control rounds", lambda: self.rounds() >= start + count)

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=5).read().decode()
        return {sample.name + (str(sorted(sample.labels.items())) if sample.labels else ""):
                sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}


def table(job: str, tokens_per_second: dict[int, float]) -> dict:
    base = tokens_per_second[min(tokens_per_second)]
    rows = [ScaleRow(workers=w, gpus=w,
                     layout=Layout(pp=w, partition=(1,) * w, micro_batch_size=2,
                                   num_micro_batches=8), step_seconds=1024 / t,
                     tokens_per_second=t, peak_memory_bytes=1e6, speedup=t / base,
                     predictor="modeled")
            for w, t in sorted(tokens_per_second.items())]
    return ScaleTable(job=job, device="cpu", source="modeled", min_workers=min(tokens_per_second),
                      max_workers=max(tokens_per_second), global_batch_size=16, seq_len=64,
                      min_gain=0.05, rows=tuple(rows)).model_dump(by_alias=True, mode="json")


class Leader:
    """The agent leader's half of the protocol, driven by the test."""

    def __init__(self, api: Client, name: str) -> None:
        self.api, self.name = api, name

    def status(self) -> dict:
        return self.api.get(ETJ, self.name, namespace=NS).get("status") or {}

    def running(self, workers: int) -> dict | None:
        """The status once the operator reports the job Running with ``workers``; else None."""
        status = self.status()
        ready = any(c["type"] == "Ready" and c["status"] == "True"
                    for c in status.get("conditions", ()))
        return status if ready and (status.get("phase"), status.get("workers")) == ("Running", workers) else None

    def publish(self, **fields) -> None:
        self.api.patch(ETJ.Status, self.name, {"status": fields}, namespace=NS,
                       patch_type=PatchType.MERGE)

    def pod_phase(self, pod: str) -> str | None:
        try:
            return self.api.get(Pod, pod, namespace=NS).status.phase
        except Exception:  # noqa: BLE001 - gone
            return None

    def apply(self, *, exit_released: bool = True) -> dict:
        """Wait for a new target, switch to it as the agent would, and report it."""
        status = self.status()
        target = status["target"]
        members = list(status.get("members") or [])
        wait_for(f"joiners {target['join']} running",
                 lambda: all(self.pod_phase(p) == "Running" for p in target["join"]))
        if exit_released:
            for pod in target["release"]:
                self.api.patch(Pod.Status, pod, {"status": {"phase": "Succeeded"}},
                               namespace=NS, patch_type=PatchType.MERGE)
        members = [m for m in members if m not in target["release"]] + list(target["join"])
        self.publish(generation=target["generation"], members=members, lastSwitchSeconds=0.5,
                     step=status.get("step", 0) + 5)
        return target


def pods_of(api: Client, job: str, role: str = "worker") -> list[str]:
    return sorted(p.metadata.name for p in api.list(
        Pod, namespace=NS, labels={"tidal.dev/job": job, "tidal.dev/role": role}))


def events_of(api: Client, job: str) -> list[tuple[str, str]]:
    return [(e.reason, e.message) for e in api.list(Event, namespace=NS)
            if e.involvedObject.name == job]


def job_manifest(name: str, **spec) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"]["scaling"] = {"probabilityThreshold": 0.5, "cooldownSeconds": 0,
                              "switchOverheadSeconds": 1, "drainTimeoutSeconds": 3}
    doc["spec"].update(spec)
    return doc


# What the chart installs besides the operator: the workers' ServiceAccount, PriorityClasses.
PREREQUISITES = [
    {"apiVersion": "v1", "kind": "ServiceAccount",
     "metadata": {"name": "tidal-worker", "namespace": NS}},
    *({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
       "value": value} for name, value in (("tidal-elastic", 100), ("tidal-default", 1000))),
]


@pytest.fixture
def cluster(tmp_path):
    with EmulatorThread(kubeconfig=tmp_path / "kubeconfig") as emu:
        api = Client(KubeConfig.from_file(emu.kubeconfig).get())
        for obj in [*load_manifests([ROOT / "crds" / "elastictrainingjobs.tidal.dev.yaml"]),
                    *PREREQUISITES]:
            emu.call(emu.emulator.create, obj)
        localcluster.register_nodes(emu.url, count=1, gpus_per_node=4)
        scheduler = emu.submit(localcluster.run(emu.url, interval_s=0.1))
        operator = Operator(emu.kubeconfig, tmp_path / "operator.log")
        operator.start()
        try:
            yield api, operator, emu
        finally:
            operator.stop()
            scheduler.cancel()
            api.close()
            if os.environ.get("TIDAL_TEST_SHOW_LOGS"):
                print((tmp_path / "operator.log").read_text())


def test_the_operator_scales_a_job_up_into_idle_gpus_and_down_for_a_pending_pod(cluster, tmp_path):
    api, operator, _ = cluster
    leader = Leader(api, "tiny")
    api.create(ETJ(job_manifest("tiny")))

    # Created: two worker pods, the headless Service, generation 0's target.
    assert wait_for("two worker pods", lambda: pods_of(api, "tiny") == ["tiny-worker-0", "tiny-worker-1"])
    assert api.get(Service, "tiny", namespace=NS).spec.clusterIP == "None"
    assert leader.status()["target"]["generation"] == 0
    leader.apply()
    leader.publish(scaleTable=table("tiny", {2: 100.0, 3: 140.0, 4: 175.0}))

    # Two GPUs idle, nothing pending: up to 4 workers, a target of generation 1, an Event.
    wait_for("a scale-up target", lambda: leader.status()["target"]["generation"] == 1)
    target = leader.status()["target"]
    assert (target["workers"], target["join"]) == (4, ["tiny-worker-2", "tiny-worker-3"])
    assert wait_for("four pods", lambda: len(pods_of(api, "tiny")) == 4)
    assert any(reason == "ScaleUp" for reason, _ in events_of(api, "tiny"))

    # The operator restarts before the agent applies the target: no duplicate pod, same target.
    operator.stop()
    operator.start()
    operator.await_rounds(since=0)
    assert pods_of(api, "tiny") == [f"tiny-worker-{i}" for i in range(4)]
    assert leader.status()["target"]["generation"] == 1
    leader.apply()
    running = wait_for("phase Running at 4 workers", lambda: leader.running(4),
                       seen=leader.status)
    conditions = {c["type"]: c["status"] for c in running["conditions"]}
    assert conditions == {"Valid": "True", "Ready": "True", "Scaling": "False"}, running["conditions"]

    # A non-elastic pod wants 2 GPUs: the job shrinks to 2 workers, drain then delete.
    api.create(Pod.from_dict({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "batch", "namespace": NS},
                              "spec": {"containers": [{"name": "main", "image": "busybox",
                                                       "resources": {"limits": {"nvidia.com/gpu": 2}}}]}}))
    wait_for("a scale-down target", lambda: leader.status()["target"]["generation"] == 2)
    target = leader.status()["target"]
    assert target["workers"] == 2 and len(target["release"]) == 2
    assert "tiny-worker-0" not in target["release"] and target["deadline"]
    released = target["release"]
    assert set(released) <= set(pods_of(api, "tiny"))  # drained first, not deleted yet
    leader.apply()
    wait_for("released pods deleted", lambda: not set(released) & set(pods_of(api, "tiny")))
    wait_for("the pending pod bound", lambda: api.get(Pod, "batch", namespace=NS).spec.nodeName)
    reasons = [r for r, _ in events_of(api, "tiny")]
    assert reasons.count("ScaleUp") == 1 and reasons.count("ScaleDown") == 1

    leader.publish(step=12)  # the agent's report; the next round sees the pod bound too
    # A round sees the pods and the job as their watches have delivered them: the released pods
    # (Succeeded before the agent's report, as apply() does it) may be gone and the batch pod
    # bound a round before the report of 2 members arrives. Wait for a round that has both.
    workers = "tidal_job_workers[('job', 'tiny'), ('namespace', 'default')]"
    metrics = wait_for("metrics of the round after", lambda: (m := operator.metrics())[
        "tidal_idle_gpus"] == 0 and m[workers] == 2 and m, seen=operator.metrics)
    assert metrics["tidal_decisions_total[('kind', 'scale_down')]"] == 1  # since the restart
    assert metrics["tidal_decisions_total[('kind', 'scale_up')]"] == 0
    assert metrics["tidal_gpus"] == 4 and metrics["tidal_pending_gpu_pods"] == 0
    assert metrics["tidal_decision_seconds_count"] > 0
    assert metrics["tidal_arrival_rate_per_hour"] == pytest.approx(3600 / 28800)  # one arrival in 8 h


def grown(api: Client, name: str, tokens_per_second: dict[int, float]) -> Leader:
    """A job of the table's fewest to 4 workers, applied at 2, then grown as far as its scale
    table says."""
    leader = Leader(api, name)
    api.create(ETJ(job_manifest(name, workers={"min": min(tokens_per_second), "max": 4,
                                               "preferred": 2})))
    wait_for("two worker pods", lambda: len(pods_of(api, name)) == 2)
    leader.apply()
    leader.publish(scaleTable=table(name, tokens_per_second))
    wait_for("a scale-up target", lambda: leader.status()["target"]["generation"] == 1)
    leader.apply()
    return leader


def test_lost_workers_are_replaced_up_to_the_minimum_under_new_names(cluster):
    api, operator, _ = cluster
    leader = Leader(api, "lossy")
    w = [f"lossy-worker-{i}" for i in range(4)]
    # Scaling off: replacing a lost worker is not elasticity, and still happens.
    api.create(ETJ(job_manifest("lossy", workers={"min": 2, "max": 4},
                                scaling={"enabled": False})))
    wait_for("two worker pods", lambda: pods_of(api, "lossy") == w[:2])
    leader.apply()
    wait_for("Running at 2 workers", lambda: leader.running(2), seen=leader.status)

    # worker-1 crashes; the agent goes on without it, so the job has not failed.
    api.patch(Pod.Status, w[1], {"status": {"phase": "Failed"}}, namespace=NS,
              patch_type=PatchType.MERGE)
    operator.await_rounds()
    assert leader.status()["phase"] == "Running"
    leader.publish(members=w[:1], lost=w[1:2])  # the agent's fault path: the same generation
    wait_for("a replacement", lambda: leader.status()["target"]["generation"] == 1,
             seen=leader.status)
    target = leader.status()["target"]
    assert (target["workers"], target["join"], target["reason"]) == (2, [w[2]], "BelowMinimum")
    assert any(r == "ScaleUp" and "below its minimum (1 of 2 workers)" in m
               for r, m in events_of(api, "lossy"))
    assert leader.pod_phase(w[1]) == "Failed"  # kept, for its logs; it holds no GPU
    leader.apply()
    wait_for("Running at 2 workers again", lambda: leader.running(2), seen=leader.status)

    # worker-2 hangs: the agent declares it lost while its pod still runs. The operator deletes
    # the pod (it holds a GPU) and replaces it under a name never given before.
    leader.publish(members=w[:1], lost=[w[1], w[2]])
    wait_for("the hung pod deleted", lambda: w[2] not in pods_of(api, "lossy"))
    wait_for("a second replacement", lambda: leader.status()["target"]["generation"] == 2)
    assert leader.status()["target"]["join"] == [w[3]]
    leader.apply()
    wait_for("Running at 2 workers", lambda: leader.running(2), seen=leader.status)
    assert pods_of(api, "lossy") == [w[0], w[1], w[3]]


def test_a_target_a_fault_overtakes_is_superseded(cluster):
    api, _, _ = cluster
    leader = Leader(api, "grow")
    w = [f"grow-worker-{i}" for i in range(4)]
    api.create(ETJ(job_manifest("grow", workers={"min": 2, "max": 3})))
    wait_for("two worker pods", lambda: len(pods_of(api, "grow")) == 2)
    leader.apply()
    leader.publish(scaleTable=table("grow", {2: 100.0, 3: 150.0}))
    wait_for("a scale-up target", lambda: leader.status()["target"]["generation"] == 1)
    assert leader.status()["target"]["join"] == [w[2]]
    wait_for("the joiner running", lambda: leader.pod_phase(w[2]) == "Running")

    # worker-1 is lost before the switch: 1 member + 1 joiner is not the target's 3 workers,
    # so the agent cannot apply it. The operator asks again with the joiner, for 2.
    leader.publish(members=w[:1], lost=w[1:2])
    wait_for("a superseding target", lambda: leader.status()["target"]["generation"] == 2,
             seen=leader.status)
    target = leader.status()["target"]
    assert (target["workers"], target["join"], target["release"]) == (2, [w[2]], [])
    assert any(r == "TargetSuperseded" for r, _ in events_of(api, "grow"))
    wait_for("the lost pod deleted", lambda: w[1] not in pods_of(api, "grow"))
    leader.apply()
    # Its GPU is idle again: the job grows back (cooldown 0), under a new name.
    wait_for("a scale-up target", lambda: leader.status()["target"]["generation"] == 3)
    assert leader.status()["target"]["join"] == [w[3]]


def test_a_tainted_node_takes_workers_only_once_the_job_tolerates_it(cluster):
    api, _, _ = cluster
    leader = Leader(api, "fenced")
    api.create(ETJ(job_manifest("fenced", workers={"min": 2, "max": 8})))
    wait_for("two worker pods", lambda: len(pods_of(api, "fenced")) == 2)
    leader.apply()  # generation 0 runs on node-0 (4 GPUs)
    (reserved,) = localcluster.node_manifests(1, 4, prefix="reserved")
    reserved["spec"] = {"taints": [{"key": "dedicated", "value": "inference",
                                    "effect": "NoSchedule"}]}
    api.create(Node.from_dict(reserved))
    leader.publish(scaleTable=table("fenced", {w: 100.0 * w for w in range(2, 9)}))
    # node-0's two idle GPUs only: reserved-0's four are not the job's to take
    wait_for("a scale-up target", lambda: leader.status()["target"]["generation"] == 1)
    assert leader.status()["target"]["workers"] == 4
    leader.apply()
    api.patch(ETJ, "fenced", {"spec": {"template": {"tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "inference",
         "effect": "NoSchedule"}]}}}, namespace=NS, patch_type=PatchType.MERGE)
    wait_for("a scale-up onto the tainted node",
             lambda: leader.status()["target"]["generation"] == 2, seen=leader.status)
    target = leader.status()["target"]
    assert target["workers"] == 8 and len(target["join"]) == 4
    joiner = api.get(Pod, target["join"][0], namespace=NS)
    assert [t.key for t in joiner.spec.tolerations] == ["dedicated"]


def test_an_invalid_job_gets_a_condition_and_an_event_and_others_are_served(cluster):
    api, _, _ = cluster
    api.create(ETJ(job_manifest("wrong", workers={"min": 9, "max": 12})))
    api.create(ETJ(job_manifest("right")))

    def refused():
        status = api.get(ETJ, "wrong", namespace=NS).get("status") or {}
        valid = [c for c in status.get("conditions", []) if c["type"] == "Valid"]
        return status.get("phase") == "Invalid" and valid and valid[0]

    valid = wait_for("the Valid=False condition", refused)
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    assert "workers.min (9) exceeds the model's 8 placement units" in valid["message"]
    assert any(r == "InvalidSpec" and "workers.min (9)" in m for r, m in events_of(api, "wrong"))
    assert pods_of(api, "wrong") == []
    wait_for("the valid job's pods", lambda: len(pods_of(api, "right")) == 2)


def test_api_errors_are_retried_and_the_operator_keeps_running(cluster):
    api, operator, emu = cluster
    failing = {"on": True}
    emu.call(lambda: emu.emulator["post", kmock.resource("v1/pods")][
        lambda request: failing["on"]] << 503)
    api.create(ETJ(job_manifest("flaky")))
    wait_for("the initial target", lambda: (Leader(api, "flaky").status().get("target") or {})
             .get("generation") == 0)
    operator.await_rounds()  # each refused
    assert pods_of(api, "flaky") == [] and operator.proc.poll() is None
    failing["on"] = False
    assert wait_for("the pods, once the API answers",
                    lambda: pods_of(api, "flaky") == ["flaky-worker-0", "flaky-worker-1"])
    assert "retrying next round" in operator.log.read_text()


def test_a_job_in_its_last_steps_is_not_scaled_and_ends_succeeded(cluster):
    api, operator, _ = cluster
    leader = Leader(api, "late")
    api.create(ETJ(job_manifest("late")))
    wait_for("two worker pods", lambda: len(pods_of(api, "late")) == 2)
    leader.apply()
    steps = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())["spec"]["training"]["steps"]
    leader.publish(step=steps - 1, scaleTable=table("late", {2: 100.0, 3: 140.0, 4: 175.0}))
    operator.await_rounds()  # 2 GPUs idle and a table that pays: no target in the last step
    assert leader.status()["target"]["generation"] == 0
    leader.publish(step=steps)
    wait_for("phase Succeeded", lambda: leader.status().get("phase") == "Succeeded",
             seen=leader.status)


def test_a_job_whose_rendezvous_fails_restarts_then_fails_past_max_restarts(cluster):
    """A rendezvous gone (not failed) restarts the job whatever maxRestarts, and a leader
    lost while the job runs restarts nothing: test_controller.py."""
    api, operator, _ = cluster
    leader = Leader(api, "phoenix")
    w = [f"phoenix-worker-{i}" for i in range(2)]
    rendezvous = "phoenix-rendezvous"
    api.create(ETJ(job_manifest("phoenix", workers={"min": 2, "max": 2}, maxRestarts=1)))

    def started_again(old: dict[str, str]) -> dict[str, str]:
        """The first pods, new ones, once the restart's old ones are gone; their uids."""
        def new_pods() -> dict[str, str] | None:
            # One list: a pod listed, then read again, may be gone by then (the restart).
            uids = {p.metadata.name: p.metadata.uid for p in api.list(
                Pod, namespace=NS, labels={"tidal.dev/job": "phoenix"})}
            pods = sorted([*w, rendezvous])
            fresh = sorted(uids) == pods and all(uids[p] != old.get(p) for p in pods)
            return uids if fresh else None

        pods = wait_for("new first pods", new_pods)
        assert leader.status()["target"]["join"] == w
        leader.apply()
        wait_for("Running at 2 workers", lambda: leader.running(2), seen=leader.status)
        return pods

    def restarted(count: int) -> tuple[dict, str]:
        status = wait_for(f"restart {count}",
                          lambda: (s := leader.status()).get("restarts") == count and s,
                          timeout_s=30, seen=leader.status)
        lines = [m for r, m in events_of(api, "phoenix") if r == "Restarted"]
        assert len(lines) == count
        return status, next(m for m in lines if f"restart {count}," in m)

    uids = started_again({})
    # The rendezvous fails: a failure, the one maxRestarts allows. Its pod goes with the
    # restart; the Event keeps what its logs ended with (the kubelet's FallbackToLogsOnError).
    api.patch(Pod.Status, rendezvous, {"status": {"phase": "Failed", "containerStatuses": [
        {"name": "rendezvous", "image": "tidal", "imageID": "", "ready": False,
         "restartCount": 0, "state": {"terminated": {
            "exitCode": 1, "message": "Traceback (most recent call last):\n  ...\n"
                                      "MemoryError\n"}}}]}},
              namespace=NS, patch_type=PatchType.MERGE)
    status, line = restarted(1)
    assert status["failures"] == 1
    assert status.get("members", []) == [] and status.get("lost", []) == []
    assert (status.get("target") or {}).get("generation", 0) == 0
    assert line == ("the rendezvous phoenix-rendezvous failed (exit code 1, MemoryError) at "
                    "step 5: restart 1, failure 1 of 1, from step 0 (spec.checkpoint.path is "
                    "unset)")
    started_again(uids)

    # It fails again, with no restart left: the job fails, and its workers, which hold GPUs
    # for nothing, go. The failed pod stays, for its logs.
    api.patch(Pod.Status, rendezvous, {"status": {"phase": "Failed"}}, namespace=NS,
              patch_type=PatchType.MERGE)
    wait_for("phase Failed", lambda: leader.status().get("phase") == "Failed",
             seen=leader.status)
    wait_for("the running pods deleted", lambda: pods_of(api, "phoenix") == [])
    assert pods_of(api, "phoenix", "rendezvous") == [rendezvous]
    assert any(r == "Failed" and m == ("the rendezvous phoenix-rendezvous failed at step 10, "
                                       "after 1 failures (spec.maxRestarts): the job fails")
               for r, m in events_of(api, "phoenix"))
    operator.await_rounds()  # rounds go by: it stays failed, and nothing restarts
    assert leader.status()["phase"] == "Failed" and leader.status()["restarts"] == 1
    metrics = operator.metrics()
    assert metrics["tidal_decisions_total[('kind', 'restart')]"] == 1
    assert metrics["tidal_job_decisions_total[('job', 'phoenix'), ('kind', 'restart'), "
                   "('namespace', 'default')]"] == 1


def test_a_new_elastic_job_gets_back_the_gpus_another_one_grew_into(cluster):
    api, _, _ = cluster
    first = grown(api, "early", {2: 100.0, 3: 140.0, 4: 175.0})
    wait_for("Running at 4 workers: every GPU", lambda: first.running(4), seen=first.status)

    # A second elastic job: its first pods wait, and the minimum they make is owed to them,
    # like a non-elastic pod's GPUs; the first job's two extra workers were on lent GPUs.
    api.create(ETJ(job_manifest("late", workers={"min": 2, "max": 4})))
    wait_for("a scale-down target", lambda: first.status()["target"]["generation"] == 2,
             seen=first.status)
    target = first.status()["target"]
    assert (target["workers"], target["reason"]) == (2, "PendingGPUPods")
    assert any(r == "ScaleDown" and "to make room for default/late-worker-0" in m
               for r, m in events_of(api, "early"))
    first.apply()
    second = Leader(api, "late")
    wait_for("the new job's pods running", lambda: all(
        second.pod_phase(p) == "Running" for p in ("late-worker-0", "late-worker-1")))
