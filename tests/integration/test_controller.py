"""The control loop in-process against the Kubernetes API emulator, on an injected clock.

The operator's timers (the drain deadline, the cooldown, the leader's absence, the arrival
window) run on the ``now`` each round is given, so these tests step through minutes in
milliseconds. The indexes are what kopf's index handlers make of the objects the emulator
holds, refreshed before each round; the test plays the scheduler and kubelet (it binds the
job's pods and runs them) and the agent leader (it applies targets and publishes status).

Each timer is also run across a restart of the operator: a new Controller, with nothing in
memory, on the same API state, must decide what the one that did not restart decides.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from lightkube import Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.resources.core_v1 import Event, Node, Pod
from lightkube.types import PatchType

from tests.integration.test_operator import ETJ, NS, PREREQUISITES, table
from tidal_kube.serving import load_manifests
from tidal_operator import handlers
from tidal_operator.adapter import Adapter
from tidal_operator.controller import Config, Controller
from tidal_operator.lifecycle import RENDEZVOUS_GONE_S
from tidal_operator.metrics import Metrics
from tidal_operator.policy import decide

ROOT = Path(__file__).resolve().parents[2]


class Cluster:
    """The API, one GPU node, and the operator: ``round(now)`` runs one control round."""

    def __init__(self, emulator: Any) -> None:
        self.kubeconfig, self.url = emulator.kubeconfig, emulator.url
        self.api = Client(KubeConfig.from_file(self.kubeconfig).get(), field_manager="test")
        self.memo = handlers.memo_for(Config())
        self.controller = self._operator()
        self.restarts = 0

    def _operator(self) -> Controller:
        return Controller(adapter=Adapter(str(self.kubeconfig)), metrics=Metrics())

    async def restart(self) -> None:
        """The operator process ends and a new one starts: nothing kept in memory."""
        await self.controller.adapter.close()
        self.controller = self._operator()
        self.restarts += 1

    def _index(self) -> None:
        """The indexes as kopf's handlers fill them from what the API holds now."""
        nodes: dict[str, Any] = {}
        pods: dict[str, Any] = {}
        jobs: dict[str, Any] = {}
        for node in self.api.list(Node):
            body = node.to_dict()
            nodes.update(handlers.gpu_nodes(name=node.metadata.name, status=body["status"],
                                            spec=body.get("spec") or {}, meta=body["metadata"],
                                            memo=self.memo))
        for pod in self.api.list(Pod, namespace="*"):
            pods.update(handlers.cluster_pods(body=pod.to_dict(), memo=self.memo))
        for job in self.api.list(ETJ, namespace="*"):
            jobs.update(handlers.elastic_jobs(namespace=job.metadata.namespace,
                                              name=job.metadata.name, body=job.to_dict()))
        c = self.controller
        c.nodes, c.pods, c.jobs = ({k: [v] for k, v in index.items()}
                                   for index in (nodes, pods, jobs))

    async def round(self, now: float) -> tuple:
        self._index()
        return await self.controller.round(now)

    def decide(self, now: float) -> tuple:
        """What a round at ``now`` would decide, without acting on it."""
        self._index()
        return decide(self.controller.snapshot(self.controller.views(), now), now)

    # ---- the test's side: objects, the scheduler and kubelet, the agent ----------------------

    def node(self, name: str, gpus: int) -> None:
        self.api.create(Node.from_dict({"apiVersion": "v1", "kind": "Node",
                                        "metadata": {"name": name},
                                        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)},
                                                   "capacity": {"nvidia.com/gpu": str(gpus)}}}))

    def job(self, name: str, **spec: Any) -> None:
        doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
        doc["metadata"] = {"name": name, "namespace": NS}
        doc["spec"]["scaling"] = {"probabilityThreshold": 0.5, "cooldownSeconds": 0,
                                  "switchOverheadSeconds": 1}
        for key, value in spec.items():
            doc["spec"][key] = {**doc["spec"].get(key, {}), **value} if isinstance(
                value, dict) else value
        self.api.create(ETJ(doc))

    def batch_pod(self, name: str, gpus: int) -> None:
        """A non-elastic GPU pod."""
        self.api.create(Pod.from_dict({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
            "spec": {"containers": [{"name": "main", "image": "busybox", "resources": {
                "limits": {"nvidia.com/gpu": gpus}}}]}}))

    def pods_of(self, job: str, role: str = "worker") -> list[str]:
        return sorted(p.metadata.name for p in self.api.list(
            Pod, namespace=NS, labels={"tidal.dev/job": job, "tidal.dev/role": role}))

    def run_pods(self, node: str = "node-0") -> None:
        """The scheduler and kubelet: the job's new pods bound and running, deleted ones gone."""
        for pod in self.api.list(Pod, namespace=NS, labels={"tidal.dev/job": None}):
            name = pod.metadata.name
            if pod.metadata.deletionTimestamp:
                self.api.delete(Pod, name, namespace=NS, grace_period=0)
            elif not pod.spec.nodeName:
                self.bind(name, node)
                self.api.patch(Pod.Status, name, {"status": {"phase": "Running"}},
                               namespace=NS, patch_type=PatchType.MERGE)

    def bind(self, pod: str, node: str) -> None:
        """What a scheduler does: POST pods/binding (lightkube cannot read its answer)."""
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        request = urllib.request.Request(
            f"{self.url}/api/v1/namespaces/{NS}/pods/{pod}/binding", method="POST",
            data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 201

    def status(self, job: str) -> dict[str, Any]:
        return self.api.get(ETJ, job, namespace=NS).get("status") or {}

    def publish(self, job: str, **fields: Any) -> None:
        self.api.patch(ETJ.Status, job, {"status": fields}, namespace=NS,
                       patch_type=PatchType.MERGE)

    def apply(self, job: str) -> dict[str, Any]:
        """The agent leader switches to the target: its joiners run, its releases exit."""
        self.run_pods()
        status = self.status(job)
        target = status["target"]
        for pod in target["release"]:
            self.api.patch(Pod.Status, pod, {"status": {"phase": "Succeeded"}}, namespace=NS,
                           patch_type=PatchType.MERGE)
        members = [m for m in status.get("members") or [] if m not in target["release"]]
        self.publish(job, generation=target["generation"], members=members + target["join"],
                     lastSwitchSeconds=1, step=status.get("step", 0) + 5)
        return target

    def events(self, job: str) -> list[tuple[str, str]]:
        return [(e.reason, e.message) for e in self.api.list(Event, namespace=NS)
                if e.involvedObject.name == job]


@pytest_asyncio.fixture
async def cluster(emulator):
    for obj in [*load_manifests([ROOT / "crds" / "elastictrainingjobs.tidal.dev.yaml"]),
                *PREREQUISITES]:
        emulator.call(emulator.emulator.create, obj)
    cluster = Cluster(emulator)
    cluster.node("node-0", 4)
    try:
        yield cluster
    finally:
        await cluster.controller.adapter.close()
        cluster.api.close()


async def started(cluster: Cluster, job: str, now: float,
                  tokens_per_second: dict[int, float] | None = None) -> None:
    """The job's first pods running, generation 0 applied, its scale table published."""
    await cluster.round(now)
    assert cluster.pods_of(job) == [f"{job}-worker-0", f"{job}-worker-1"]
    cluster.apply(job)
    if tokens_per_second:
        cluster.publish(job, scaleTable=table(job, tokens_per_second))


def T0() -> float:
    """A start for the injected clock: now, as the API stamps creation times."""
    return float(int(time.time()))


RESTART = pytest.mark.parametrize("restart", [False, True], ids=["same operator", "restarted"])


@pytest.mark.asyncio
@RESTART
async def test_released_pods_are_deleted_at_the_drain_deadline_not_before(cluster, restart):
    t0 = T0()
    cluster.job("slow", scaling={"drainTimeoutSeconds": 300})
    await started(cluster, "slow", t0, {2: 100.0, 3: 150.0, 4: 190.0})
    (up,) = await cluster.round(t0 + 1)
    assert (up.kind, up.to_workers) == ("scale_up", 4)
    cluster.apply("slow")
    cluster.batch_pod("big", 1)
    (down,) = await cluster.round(t0 + 2)
    assert down.kind == "scale_down"
    released = cluster.status("slow")["target"]["release"]
    assert len(released) == 1 and cluster.status("slow")["target"]["deadline"]
    if restart:
        await cluster.restart()
    # The agent never answers: the pod runs on until the deadline, 300 s after the target.
    await cluster.round(t0 + 2 + 299)
    assert set(released) <= set(cluster.pods_of("slow"))
    assert not any(r == "DrainDeadline" for r, _ in cluster.events("slow"))
    await cluster.round(t0 + 2 + 301)
    cluster.run_pods()  # the kubelet finishes the deletion
    assert not set(released) & set(cluster.pods_of("slow"))
    assert [m for r, m in cluster.events("slow") if r == "DrainDeadline"] == [
        f"{released[0]} did not leave within 300s of the scale-down to 3 workers; "
        "deleted it anyway"]
    registry = cluster.controller.metrics.registry
    assert registry.get_sample_value("tidal_decisions_total", {"kind": "drain_deadline"}) == 1


@pytest.mark.asyncio
@RESTART
async def test_no_scale_up_within_the_cooldown_after_a_decision(cluster, restart):
    t0 = T0()
    cluster.batch_pod("inference", 1)  # one of node-0's 4 GPUs, bound: the job may take 3
    cluster.bind("inference", "node-0")
    cluster.job("cool", workers={"max": 4}, scaling={"cooldownSeconds": 60})
    await started(cluster, "cool", t0, {2: 100.0, 3: 150.0, 4: 190.0})
    (up,) = await cluster.round(t0 + 1)
    assert up.to_workers == 3  # the GPU inference holds is not idle
    cluster.apply("cool")
    cluster.node("node-1", 1)  # one more GPU idle, 10 s after the scale-up
    if restart:
        await cluster.restart()
    assert await cluster.round(t0 + 11) == ()
    assert await cluster.round(t0 + 60) == ()  # the cooldown counts from lastScaleTime
    (again,) = await cluster.round(t0 + 61)
    assert (again.kind, again.from_workers, again.to_workers) == ("scale_up", 3, 4)


@pytest.mark.asyncio
@RESTART
async def test_a_rendezvous_gone_restarts_the_job_after_rendezvous_gone_s(cluster, restart):
    t0 = T0()
    cluster.job("phoenix", workers={"min": 2, "max": 2}, maxRestarts=0)
    await started(cluster, "phoenix", t0)
    assert await cluster.round(t0 + 1) == ()
    assert cluster.status("phoenix")["phase"] == "Running"
    old = {p.metadata.name: p.metadata.uid for p in cluster.api.list(Pod, namespace=NS)}
    assert cluster.pods_of("phoenix", "rendezvous") == ["phoenix-rendezvous"]
    # The rendezvous pod is deleted (its node drained): once gone for RENDEZVOUS_GONE_S, the
    # job restarts, whatever maxRestarts (0 here): it is no failure.
    cluster.api.delete(Pod, "phoenix-rendezvous", namespace=NS)
    cluster.run_pods()
    await cluster.round(t0 + 2)
    assert cluster.status("phoenix")["rendezvousMissingSince"]
    if restart:
        await cluster.restart()
    await cluster.round(t0 + 2 + RENDEZVOUS_GONE_S - 1)
    assert cluster.status("phoenix").get("restarts", 0) == 0
    await cluster.round(t0 + 2 + RENDEZVOUS_GONE_S)
    status = cluster.status("phoenix")
    assert status["restarts"] == 1 and status.get("failures", 0) == 0
    assert status.get("members", []) == [] and status.get("lost", []) == []
    assert "target" not in status and "rendezvousMissingSince" not in status
    assert [m for r, m in cluster.events("phoenix") if r == "Restarted"] == [
        "the rendezvous phoenix-rendezvous is gone at step 5: restart 1, from step 0 "
        "(spec.checkpoint.path is unset)"]
    # The other pod goes; then the first pods come back, new ones, for generation 0.
    await cluster.round(t0 + 13)
    cluster.run_pods()
    assert cluster.pods_of("phoenix") == []
    await cluster.round(t0 + 14)
    cluster.apply("phoenix")
    new = {p.metadata.name: p.metadata.uid for p in cluster.api.list(Pod, namespace=NS)}
    assert sorted(new) == ["phoenix-rendezvous", "phoenix-worker-0", "phoenix-worker-1"]
    assert all(new[p] != old[p] for p in new)
    assert cluster.status("phoenix")["target"]["generation"] == 0
    assert await cluster.round(t0 + 15) == ()
    assert cluster.status("phoenix")["phase"] == "Running"


@pytest.mark.asyncio
async def test_a_leader_lost_while_the_job_runs_is_no_restart(cluster):
    """The leader's pod fails (SIGKILL, its node gone) once the job runs: a survivor leads the
    agent on, so the job goes on; before its first generation, the first leader's failure is
    the job's (say, its agent refused the spec)."""
    t0 = T0()
    cluster.job("hydra", workers={"min": 2, "max": 2}, maxRestarts=0)
    await started(cluster, "hydra", t0)
    cluster.api.patch(Pod.Status, "hydra-worker-0", {"status": {"phase": "Failed"}},
                      namespace=NS, patch_type=PatchType.MERGE)
    await cluster.round(t0 + 1)
    await cluster.round(t0 + 20)  # past RENDEZVOUS_GONE_S: nothing else is missing
    status = cluster.status("hydra")
    assert status.get("restarts", 0) == 0 and status["phase"] != "Failed"
    cluster.publish("hydra", members=["hydra-worker-1"], lost=["hydra-worker-0"])
    await cluster.round(t0 + 21)
    assert cluster.status("hydra").get("restarts", 0) == 0

    cluster.job("stillborn", workers={"min": 2, "max": 2}, maxRestarts=0)
    await cluster.round(t0 + 22)
    cluster.run_pods()
    cluster.api.patch(Pod.Status, "stillborn-worker-0", {"status": {"phase": "Failed"}},
                      namespace=NS, patch_type=PatchType.MERGE)
    await cluster.round(t0 + 23)
    assert cluster.status("stillborn")["phase"] == "Failed"


@pytest.mark.asyncio
@RESTART
async def test_arrivals_already_gone_still_count_until_their_window_ends(cluster, restart):
    """The Poisson rule counts a non-elastic pod over the arrival window, after the pod is
    gone too. Its gain (+40%) pays for 2 x 600 s of switching with P = 1 when nothing
    arrived, but P = exp(-1200 / 3600 / 0.4) = 0.43 < 0.6 with one arrival in the hour."""
    t0 = T0()
    cluster.job("poisson", scaling={"arrivalWindowSeconds": 3600, "switchOverheadSeconds": 600,
                                    "probabilityThreshold": 0.6})
    cluster.batch_pod("batch", 2)
    created = {p.metadata.name: p.metadata.creationTimestamp for p in
               cluster.api.list(Pod, namespace=NS)}["batch"].timestamp()
    await started(cluster, "poisson", t0)
    cluster.api.delete(Pod, "batch", namespace=NS)  # it ran elsewhere and is gone
    cluster.publish("poisson", scaleTable=table("poisson", {2: 100.0, 3: 120.0, 4: 140.0}),
                    lastSwitchSeconds=600)
    assert [(a["pod"], a["gpus"]) for a in cluster.status("poisson")["arrivals"]] == [
        ("default/batch", 2)]  # its GPUs: the headroom rule's
    if restart:
        await cluster.restart()
    assert cluster.decide(t0 + 60) == ()
    assert await cluster.round(created + 3599) == ()
    (up,) = await cluster.round(created + 3601)
    assert (up.kind, up.to_workers, up.probability) == ("scale_up", 4, 1.0)
    assert cluster.status("poisson")["arrivals"] == []


@pytest.mark.asyncio
async def test_a_restart_with_nothing_written_loses_the_arrival_the_status_keeps(cluster):
    """The state the previous test relies on is the status's: without it, a restarted operator
    would not count the pod that is gone, and would scale up."""
    t0 = T0()
    cluster.job("poisson", scaling={"arrivalWindowSeconds": 3600, "switchOverheadSeconds": 600,
                                    "probabilityThreshold": 0.6})
    cluster.batch_pod("batch", 2)
    await started(cluster, "poisson", t0)
    cluster.api.delete(Pod, "batch", namespace=NS)
    cluster.publish("poisson", scaleTable=table("poisson", {2: 100.0, 3: 120.0, 4: 140.0}),
                    lastSwitchSeconds=600, arrivals=None)  # as if the operator never wrote it
    await cluster.restart()
    (up,) = cluster.decide(t0 + 60)
    assert up.kind == "scale_up"


@pytest.mark.asyncio
async def test_a_job_starts_below_its_preferred_count_on_what_is_free(cluster):
    """workers.preferred 3 with two of node-0's four GPUs held: the job starts with the two
    that are free, and grows into the others by the scaling rules once they are idle."""
    t0 = T0()
    cluster.batch_pod("inference", 2)
    cluster.bind("inference", "node-0")
    cluster.job("eager", workers={"min": 1, "max": 4, "preferred": 3})
    (start,) = await cluster.round(t0)
    assert (start.kind, start.from_workers, start.to_workers) == ("start", 0, 2)
    assert cluster.pods_of("eager") == ["eager-worker-0", "eager-worker-1"]
    assert cluster.status("eager")["target"]["workers"] == 2
    assert [m for r, m in cluster.events("eager") if r == "Created"] == [
        "created 2 worker pods: eager-worker-0, eager-worker-1 (2 workers, 1 below its "
        "preferred 3: 2 fit on free GPUs (node-0 x2))"]
    cluster.apply("eager")
    cluster.publish("eager", scaleTable=table("eager", {1: 100.0, 2: 190.0, 3: 270.0,
                                                        4: 340.0}))
    cluster.api.delete(Pod, "inference", namespace=NS, grace_period=0)  # done: gone
    (up,) = await cluster.round(t0 + 1)
    assert (up.kind, up.from_workers, up.to_workers) == ("scale_up", 2, 4)
