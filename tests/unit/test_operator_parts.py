"""The operator's pure parts: pod and Service manifests, index entries, conditions, checks."""

from pathlib import Path

import pytest
import yaml

from tidal_api import keys, parse_job
from tidal_kube import localcluster
from tidal_operator import builders
from tidal_operator.controller import _set_condition, contradiction
from tidal_operator.snapshot import pod_gpus, pod_view

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def job():
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["metadata"]["namespace"] = "team-a"
    return parse_job(doc)


def test_worker_pod_is_owned_labelled_and_finds_its_leader(job):
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
    assert env[keys.ENV_RENDEZVOUS_HOST] == "tiny-worker-0.tiny.team-a.svc"
    assert env[keys.ENV_RENDEZVOUS_PORT] == str(keys.RENDEZVOUS_PORT)
    assert env[keys.ENV_JOB] == "tiny" and env[keys.ENV_NAMESPACE] == "team-a"
    assert env[keys.ENV_METRICS_PORT] == str(keys.METRICS_PORT)
    assert {p["name"]: p["containerPort"] for p in spec["containers"][0]["ports"]} == {
        "rendezvous": keys.RENDEZVOUS_PORT, "metrics": keys.METRICS_PORT}
    assert pod_gpus(spec, "nvidia.com/gpu") == job.spec.gpus_per_worker
    assert "terminationGracePeriodSeconds" not in spec  # Kubernetes' default
    assert spec["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    template = job.spec.template.model_copy(update={"termination_grace_period_seconds": 300})
    patient = job.model_copy(update={"spec": job.spec.model_copy(update={"template": template})})
    pod = builders.worker_pod(patient, uid="u-1", index=0, generation=0)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 300


def test_headless_service_selects_the_jobs_workers(job):
    svc = builders.headless_service(job, uid="u-1")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {keys.JOB_LABEL: "tiny", keys.ROLE_LABEL: "worker"}
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


def test_condition_transition_time_moves_only_with_its_status():
    first = _set_condition([], "Ready", "False", "Starting", "m1", now=100.0, generation=1)
    same = _set_condition(first, "Ready", "False", "Starting", "m2", now=200.0, generation=1)
    flipped = _set_condition(same, "Ready", "True", "Running", "m3", now=300.0, generation=1)
    assert first[0]["lastTransitionTime"] == same[0]["lastTransitionTime"] == "1970-01-01T00:01:40Z"
    assert same[0]["message"] == "m2"
    assert flipped[0]["lastTransitionTime"] == "1970-01-01T00:05:00Z"
    assert len(flipped) == 1


def test_contradictions_are_reported_in_one_line(job):
    assert contradiction(job) is None
    wide = job.model_copy(update={"spec": job.spec.model_copy(update={"gpus_per_worker": 2})})
    assert "gpusPerWorker is 2" in contradiction(wide)
    too_many = parse_job({**job.model_dump(by_alias=True, exclude_none=True),
                          "spec": {**job.spec.model_dump(by_alias=True, exclude_none=True),
                                   "workers": {"min": 9, "max": 12}}})
    assert "exceeds the model's 8 placement units" in contradiction(too_many)


def test_placement_reaches_the_policy_from_nodes_pods_and_the_jobs_template(job):
    from tidal_api import JobStatus
    from tidal_operator.controller import Controller, _JobState
    from tidal_operator.snapshot import Placement, Taint, Toleration, node_of

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
    state = _JobState("default/tiny", doc, placed, JobStatus())
    assert Controller(adapter=None, metrics=None)._elastic_job(state).placement == expected
    assert pod_view({"metadata": {"name": "p"}, "spec": {}}, "nvidia.com/gpu").placement == (
        Placement())
    # nodes: labels and taints (one without an effect, which the API refuses, as NoSchedule)
    node = node_of("n", 8, {"gpu": "a100"}, [{"key": "dedicated", "value": "train",
                                               "effect": "NoExecute"}, {"key": "x"}])
    assert node.labels == frozenset({("gpu", "a100")})
    assert node.taints == (Taint("dedicated", "train", "NoExecute"), Taint("x", "", "NoSchedule"))
    assert not node.open_to_all and expected.allows(node) and not Placement().allows(node)
    assert node_of("m", 8, None, None) == type(node)("m", 8)
    from tidal_operator.handlers import gpu_nodes

    indexed = gpu_nodes(name="n", status={"allocatable": {"nvidia.com/gpu": "8"}},
                        spec={"taints": [{"key": "dedicated", "value": "train",
                                          "effect": "NoExecute"}, {"key": "x"}]},
                        meta={"labels": {"gpu": "a100"}})
    assert indexed == {"n": node}
    assert gpu_nodes(name="n", status={}, spec={"unschedulable": True}, meta={}) == {}


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
    assert localcluster.gpu_request({"spec": spec}) == gpus
