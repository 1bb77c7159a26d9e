"""The operator's pure parts: pod and Service manifests, index entries, the policy's view."""

from pathlib import Path

import kopf
import pytest
import yaml

from tidal_api import JobStatus, keys, parse_job
from tidal_kube.clusterapi import gpu_request
from tidal_operator import builders, handlers
from tidal_operator.adapter import CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S
from tidal_operator.controller import Config, Controller
from tidal_operator.handlers import gpu_nodes, memo_for
from tidal_operator.snapshot import Placement, Taint, Toleration, node_of, pod_gpus, pod_view
from tidal_operator.view import JobView

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def job():
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["metadata"]["namespace"] = "team-a"
    return parse_job(doc)


def test_worker_pod_is_owned_labelled_and_finds_its_rendezvous(job):
    pod = builders.worker_pod(job, uid="u-1", index=3, generation=2)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "tiny-worker-3" and meta["namespace"] == "team-a"
    assert meta["ownerReferences"] == [{
        "apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob", "name": "tiny",
        "uid": "u-1", "controller": True, "blockOwnerDeletion": True}]
    labels = meta["labels"]
    assert labels[keys.JOB_LABEL] == "tiny" and labels[keys.WORKER_LABEL] == "3"
    assert labels[keys.GENERATION_LABEL] == "2" and labels[keys.ELASTIC_LABEL] == "true"
    assert spec["priorityClassName"] == keys.ELASTIC_PRIORITY_CLASS
    assert spec["restartPolicy"] == "Never"
    assert (spec["hostname"], spec["subdomain"]) == ("tiny-worker-3", "tiny")
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env[keys.ENV_RENDEZVOUS_HOST] == "tiny-rendezvous.tiny.team-a.svc"
    assert env[keys.ENV_RENDEZVOUS_PORT] == str(keys.RENDEZVOUS_PORT)
    assert env[keys.ENV_JOB] == "tiny" and env[keys.ENV_NAMESPACE] == "team-a"
    assert env[keys.ENV_METRICS_PORT] == str(keys.METRICS_PORT)
    assert {p["name"]: p["containerPort"] for p in spec["containers"][0]["ports"]} == {
        "metrics": keys.METRICS_PORT}
    assert pod_gpus(spec, "nvidia.com/gpu") == job.spec.gpus_per_worker
    assert "terminationGracePeriodSeconds" not in spec  # Kubernetes' default
    assert spec["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    template = job.spec.template.model_copy(update={"termination_grace_period_seconds": 300})
    patient = job.model_copy(update={"spec": job.spec.model_copy(update={"template": template})})
    pod = builders.worker_pod(patient, uid="u-1", index=0, generation=0)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 300
    assert env[keys.ENV_LOST_AFTER] == "5"  # tidal agent's own default


def test_the_operators_worker_settings_reach_every_worker_pod(job):
    """--gpu-resource and --worker-lost-after (the chart's operator.gpuResource and
    workers.lostAfterSeconds), as Controller and Lifecycle pass them (Config.worker)."""
    settings = Config(gpu_resource="amd.com/gpu", worker_lost_after_s=2.5).worker
    spec = builders.worker_pod(job, uid="u-1", index=1, generation=0, settings=settings)["spec"]
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env[keys.ENV_LOST_AFTER] == "2.5"
    assert pod_gpus(spec, "amd.com/gpu") == job.spec.gpus_per_worker
    assert pod_gpus(spec, "nvidia.com/gpu") == 0


def test_the_rendezvous_pod_hosts_the_store_on_a_cpu_where_the_workers_run(job):
    """``tidal rendezvous`` in the agent's image, at the address every worker is given, asking
    for no GPU, on the nodes the template lets the workers use."""
    template = job.spec.template.model_copy(update={
        "node_selector": {"pool": "gpu"},
        "tolerations": ({"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},)})
    job = job.model_copy(update={"spec": job.spec.model_copy(update={"template": template})})
    pod = builders.rendezvous_pod(job, uid="u-1")
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "tiny-rendezvous" and meta["namespace"] == "team-a"
    assert meta["ownerReferences"][0]["uid"] == "u-1"
    assert meta["labels"][keys.JOB_LABEL] == "tiny"
    assert meta["labels"][keys.ROLE_LABEL] == "rendezvous"
    assert keys.ELASTIC_LABEL not in meta["labels"] and "priorityClassName" not in spec
    (container,) = spec["containers"]
    assert container["command"] == ["tidal", "rendezvous"]
    assert container["image"] == job.spec.template.image
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[keys.ENV_JOB] == "tiny"
    assert env[keys.ENV_RENDEZVOUS_PORT] == str(keys.RENDEZVOUS_PORT)
    host = builders.rendezvous_host("tiny", "team-a")
    assert f"{spec['hostname']}.{spec['subdomain']}.team-a.svc" == host
    assert pod_gpus(spec, "nvidia.com/gpu") == 0
    assert spec["nodeSelector"] == {"pool": "gpu"} and spec["tolerations"] == [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_headless_service_selects_the_jobs_pods(job):
    svc = builders.headless_service(job, uid="u-1")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {keys.JOB_LABEL: "tiny"}  # the rendezvous pod too
    assert svc["metadata"]["name"] == "tiny"  # the pods' subdomain


def test_pod_view_reads_gpus_node_job_and_unschedulable():
    body = {
        "metadata": {"name": "p", "namespace": "ns", "creationTimestamp": "2026-01-01T00:00:10Z",
                     "labels": {keys.JOB_LABEL: "tiny"}},
        "spec": {"containers": [
            {"resources": {"limits": {"nvidia.com/gpu": "2"}}},
            {"resources": {"requests": {"nvidia.com/gpu": 1}}},
        ]},
        "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
    }
    pod = pod_view(body, "nvidia.com/gpu")
    assert (pod.key, pod.gpus, pod.node, pod.job, pod.unschedulable) == ("ns/p", 3, None, "ns/tiny", True)
    assert pod.created == pytest.approx(1767225610.0)
    assert pod_view(body, "amd.com/gpu").gpus == 0
    assert not pod.deleting and pod.exit_code is None and pod.last_words == ""
    body["status"]["containerStatuses"] = [{"name": "agent", "state": {"terminated": {
        "exitCode": 1, "message": "Traceback (most recent call last):\n  ...\nValueError: x\n"}}}]
    ended = pod_view(body, "nvidia.com/gpu")
    assert (ended.exit_code, ended.last_words) == (1, "ValueError: x")
    body["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    assert pod_view(body, "nvidia.com/gpu").deleting  # asked to go; it may still run


def test_placement_reaches_the_policy_from_nodes_pods_and_the_jobs_template(job):
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["spec"]["template"] = {
        "nodeSelector": {"gpu": "a100"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "train",
                         "effect": "NoSchedule"}, {"operator": "Exists"}],
    }
    placed = parse_job(doc)
    expected = Placement(frozenset({("gpu", "a100")}), (
        Toleration("dedicated", "Equal", "train", "NoSchedule"), Toleration("", "Exists")))
    # the worker pods the operator builds, read back through the pod index
    pod = builders.worker_pod(placed, uid="u-1", index=1, generation=0)
    assert pod_view(pod, "nvidia.com/gpu").placement == expected
    # the job as the policy sees it
    view = JobView("default/tiny", doc, placed, JobStatus())
    assert Controller(adapter=None, metrics=None)._elastic_job(view).placement == expected
    assert pod_view({"metadata": {"name": "p"}, "spec": {}}, "nvidia.com/gpu").placement == (
        Placement())
    # nodes: labels and taints (one without an effect, which the API refuses, as NoSchedule)
    node = node_of("n", 8, {"gpu": "a100"}, [{"key": "dedicated", "value": "train",
                                               "effect": "NoExecute"}, {"key": "x"}])
    assert node.labels == frozenset({("gpu", "a100")})
    assert node.taints == (Taint("dedicated", "train", "NoExecute"), Taint("x", "", "NoSchedule"))
    assert not node.open_to_all and expected.allows(node) and not Placement().allows(node)
    assert node_of("m", 8, None, None) == type(node)("m", 8)
    memo = memo_for(Config())  # as the entry point gives it to kopf.run
    indexed = gpu_nodes(name="n", status={"allocatable": {"nvidia.com/gpu": "8"}},
                        spec={"taints": [{"key": "dedicated", "value": "train",
                                          "effect": "NoExecute"}, {"key": "x"}]},
                        meta={"labels": {"gpu": "a100"}}, memo=memo)
    assert indexed == {"n": node}
    assert gpu_nodes(name="n", status={}, spec={"unschedulable": True}, meta={},
                     memo=memo) == {}
    amd = memo_for(Config(gpu_resource="amd.com/gpu"))
    assert gpu_nodes(name="n", status={"allocatable": {"nvidia.com/gpu": "8"}}, spec={},
                     meta={}, memo=amd)["n"].gpus == 0


@pytest.mark.parametrize(("containers", "init", "gpus"), [
    ([{"limits": {"nvidia.com/gpu": "2"}}], [], 2),  # a limit stands for the request
    ([{"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}, {}], [], 1),
    ([{"requests": {"nvidia.com/gpu": 1}}, {"limits": {"nvidia.com/gpu": 2}}], [], 3),
    ([{"requests": {"nvidia.com/gpu": 1}}], [{"limits": {"nvidia.com/gpu": 4}}], 4),
    ([{"requests": {"nvidia.com/gpu": 3}}], [{"limits": {"nvidia.com/gpu": 2}}], 3),
    ([{"requests": {"cpu": "2"}}], [], 0),
])
def test_a_pod_holds_the_gpus_the_scheduler_counts(containers, init, gpus):
    """One count for the operator's index and the local scheduler: the containers' sum, or the
    largest init container's where that is more."""
    spec = {"containers": [{"resources": r} for r in containers],
            "initContainers": [{"resources": r} for r in init]}
    assert pod_gpus(spec, "nvidia.com/gpu") == gpus
    assert gpu_request({"spec": spec}) == gpus


def test_startup_sets_every_watch_and_request_timeout():
    """kopf leaves watches and connections without a timeout by default: silent hangs."""
    settings = kopf.OperatorSettings()
    assert settings.watching.server_timeout is None and settings.networking.connect_timeout is None
    handlers.configure(settings)
    watching, networking = settings.watching, settings.networking
    assert watching.server_timeout == handlers.WATCH_SERVER_TIMEOUT_S
    assert watching.client_timeout > watching.server_timeout  # the server ends a watch first
    assert watching.connect_timeout == networking.connect_timeout == CONNECT_TIMEOUT_S
    assert networking.request_timeout == REQUEST_TIMEOUT_S


def test_the_handlers_read_their_operators_config_from_its_memo():
    pod = builders.worker_pod(parse_job(yaml.safe_load((ROOT / "examples" / "tiny.yaml")
                                                       .read_text())),
                              uid="u", index=0, generation=0)
    nvidia, amd = memo_for(Config()), memo_for(Config(gpu_resource="amd.com/gpu"))
    assert handlers.cluster_pods(body=pod, memo=nvidia) == {
        "default/tiny-worker-0": pod_view(pod, "nvidia.com/gpu")}
    # A Tidal pod is indexed whatever it asks for (a job's rendezvous pod asks for no GPU);
    # another pod only for the GPUs it asks for.
    assert handlers.cluster_pods(body=pod, memo=amd) == {
        "default/tiny-worker-0": pod_view(pod, "amd.com/gpu")}
    other = {**pod, "metadata": {**pod["metadata"], "labels": {}}}
    assert handlers.cluster_pods(body=other, memo=nvidia) == {
        "default/tiny-worker-0": pod_view(other, "nvidia.com/gpu")}
    assert handlers.cluster_pods(body=other, memo=amd) == {}  # no AMD GPUs: not indexed
    assert (nvidia.config, nvidia.kubeconfig, nvidia.metrics_port) == (Config(), None, None)
