"""Queued demand (issue 39, item 1): Kueue Workloads, Kueue-gated pods and Volcano PodGroups as
the pending pods decide() makes room for, each counted once."""

from __future__ import annotations

from pathlib import Path

import kopf
import pytest
import yaml

from tests.unit.test_policy import NOW, cluster, job
from tidal_api import Target, keys, parse_job
from tidal_operator import builders, handlers
from tidal_operator.adapter import rfc3339
from tidal_operator.controller import Config, Controller
from tidal_operator.metrics import Metrics
from tidal_operator.policy import BELOW_MINIMUM, IDLE_GPUS, STARTED, decide
from tidal_operator.queues import (
    KUEUE_ADMISSION_GATE,
    PODGROUPS,
    WORKLOADS,
    PodGroup,
    podgroup_demand,
    podgroup_of,
    podgroup_view,
    source_of,
    workload_demand,
)
from tidal_operator.snapshot import ANYWHERE, Placement, Pod, parse_time, pod_view

ROOT = Path(__file__).resolve().parents[2]
GPU = "nvidia.com/gpu"
CREATED = "2026-01-02T03:04:05Z"


def container(gpus: int, resource: str = GPU) -> dict:
    return {"name": "main", "image": "busybox", "resources": {"limits": {resource: gpus}}}


def workload(*pod_sets: tuple[str, int, int], conditions=(), **meta) -> dict:
    """A Workload with pod sets of (name, count, GPUs per pod)."""
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": "train", "namespace": "team", "creationTimestamp": CREATED, **meta},
        "spec": {"queueName": "user-queue", "active": True, "podSets": [
            {"name": name, "count": count, "template": {"spec": {
                "containers": [container(gpus)], "nodeSelector": {"gpu": "h100"}}}}
            for name, count, gpus in pod_sets]},
        "status": {"conditions": [{"type": t, "status": s, "reason": "R", "message": ""}
                                  for t, s in conditions]},
    }


def test_a_workload_waiting_for_admission_is_its_pods():
    demand = workload_demand(workload(("main", 2, 4), ("driver", 1, 0), ("aux", 1, 1)), GPU)
    assert [p.key for p in demand] == ["kueue:team/train/main/0", "kueue:team/train/main/1",
                                       "kueue:team/train/aux/0"]
    first = demand[0]
    assert (first.gpus, first.node, first.phase, first.job) == (4, None, "Pending", None)
    assert first.created == parse_time(CREATED)
    assert first.placement == Placement.of({"gpu": "h100"}, None)
    assert [source_of(p) for p in demand] == ["kueue"] * 3
    assert workload_demand(workload(("main", 2, 4)), "amd.com/gpu") == ()


@pytest.mark.parametrize(("conditions", "meta", "waits"), [
    ((), {}, True),  # not yet considered by Kueue
    ((("QuotaReserved", "False"),), {}, True),  # considered, no quota yet
    ((("QuotaReserved", "False"), ("Evicted", "True")), {}, True),  # evicted: queued again
    ((("QuotaReserved", "True"),), {}, False),  # its pods count, as pods
    ((("QuotaReserved", "True"), ("Admitted", "True")), {}, False),
    ((("QuotaReserved", "False"), ("Finished", "True")), {}, False),
    ((), {"deletionTimestamp": CREATED}, False),
    # Kueue's Workload of plain pods (a pod group): the gated pods count instead
    ((), {"ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p-0", "uid": "u"}]},
     False),
    ((), {"ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "j",
                               "uid": "u"}]}, True),
], ids=["new", "no-quota", "evicted", "reserved", "admitted", "finished", "deleting",
        "of-pods", "of-a-job"])
def test_which_workloads_wait(conditions, meta, waits):
    assert bool(workload_demand(workload(("main", 1, 2), conditions=conditions, **meta),
                                GPU)) is waits


def test_a_deactivated_workload_waits_for_nothing():
    body = workload(("main", 1, 2))
    body["spec"]["active"] = False
    assert workload_demand(body, GPU) == ()


def test_a_pod_held_by_kueues_gate_is_pending_demand():
    """As the API server stores it: Pending, no node, PodScheduled False SchedulingGated."""
    gated = {"metadata": {"name": "p-0", "namespace": "team",
                          "labels": {"kueue.x-k8s.io/pod-group-name": "p"}},
             "spec": {"containers": [container(2)],
                      "schedulingGates": [{"name": KUEUE_ADMISSION_GATE}]},
             "status": {"phase": "Pending", "conditions": [
                 {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}]}}
    pod = pod_view(gated, GPU)
    assert (pod.node, pod.phase, pod.job, pod.gpus) == (None, "Pending", None, 2)
    grown, pods = job("j", on="aaaa", min_workers=2)
    [decision] = decide(cluster({"a": 4}, (grown, pods), others=[pod]), NOW)
    assert (decision.kind, decision.to_workers, decision.room_for) == (
        "scale_down", 2, (("team/p-0", "a"),))


def test_a_queued_workload_gets_room_as_a_pending_pod_of_its_gpus_does():
    grown, pods = job("j", on="aaaabbbb", min_workers=2)
    queued = workload_demand(workload(("main", 2, 1)), GPU)
    queued = [Pod(p.key, p.gpus, created=p.created) for p in queued]  # anywhere
    [decision] = decide(cluster({"a": 4, "b": 4}, (grown, pods), others=queued), NOW)
    assert decision.to_workers == 6 and len(decision.release) == 2
    assert {pod for pod, _ in decision.room_for} == {"kueue:team/train/main/0",
                                                     "kueue:team/train/main/1"}
    as_pods = [Pod(f"team/p-{i}", 1, created=p.created) for i, p in enumerate(queued)]
    [same] = decide(cluster({"a": 4, "b": 4}, (grown, pods), others=as_pods), NOW)
    assert same.release == decision.release


def podgroup(phase: str | None, min_member: int = 2, min_resources: dict | None = None) -> dict:
    spec: dict = {"minMember": min_member, "queue": "default"}
    if min_resources is not None:
        spec["minResources"] = min_resources
    return {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup",
            "metadata": {"name": "pg", "namespace": "team", "creationTimestamp": CREATED},
            "spec": spec, "status": {"phase": phase} if phase else {}}


@pytest.mark.parametrize(("phase", "waits"), [
    (None, True), ("Pending", True), ("Inqueue", True), ("Running", False), ("Unknown", False),
    ("Completed", False)])
def test_a_podgroup_waits_while_pending_or_inqueue(phase, waits):
    assert (podgroup_view(podgroup(phase), GPU) is not None) is waits


def member(name: str, gpus: int, phase: str = "Pending", node: str | None = None) -> Pod:
    return Pod(f"team/{name}", gpus, node, phase, placement=Placement.of({"gpu": "a100"}, None))


def test_a_podgroup_asks_for_its_min_resources_less_what_its_members_cover():
    group = podgroup_view(podgroup("Inqueue", 2, {GPU: "8", "cpu": "4"}), GPU)
    assert group == PodGroup("team/pg", 2, 8, parse_time(CREATED))
    # no pods yet: minResources in pods of minResources / minMember GPUs, placed anywhere
    demand = podgroup_demand(group, [])
    assert [(p.key, p.gpus, p.placement) for p in demand] == [
        ("volcano:team/pg/0", 4, ANYWHERE), ("volcano:team/pg/1", 4, ANYWHERE)]
    assert demand[0].created == parse_time(CREATED) and source_of(demand[0]) == "volcano"
    # one member of 4 GPUs exists (pending: it counts as a pod): 4 GPUs more, placed as it is
    [rest] = podgroup_demand(group, [member("pg-0", 4)])
    assert (rest.gpus, rest.placement) == (4, Placement.of({"gpu": "a100"}, None))
    # a finished member holds nothing; both running or pending: nothing more
    assert sum(p.gpus for p in podgroup_demand(group, [member("pg-0", 4, "Failed")])) == 8
    assert podgroup_demand(group, [member("pg-0", 4), member("pg-1", 4, "Running", "a")]) == ()


def test_without_min_resources_a_podgroup_asks_for_min_member_times_its_pods():
    group = podgroup_view(podgroup("Pending", 3), GPU)
    assert group.gpus is None
    assert podgroup_demand(group, []) == ()  # nothing to go by
    demand = podgroup_demand(group, [member("pg-0", 2)])
    assert [p.gpus for p in demand] == [2, 2]
    # min resources that do not divide into pods: the last pod asks for the rest
    odd = podgroup_view(podgroup("Pending", 2, {GPU: 5}), GPU)
    assert [p.gpus for p in podgroup_demand(odd, [])] == [3, 2]
    assert podgroup_view(podgroup("Pending", 2, {"cpu": "4"}), GPU).gpus is None


def test_a_pod_belongs_to_the_podgroup_its_annotation_names():
    meta = {"name": "pg-0", "namespace": "team",
            "annotations": {"scheduling.k8s.io/group-name": "pg"}}
    assert podgroup_of({"metadata": meta}) == "team/pg"
    assert podgroup_of({"metadata": {"name": "x", "namespace": "team"}}) is None


def test_the_snapshot_holds_the_queued_pods_but_not_as_arrivals():
    memo = handlers.memo_for(Config())
    controller = Controller(adapter=None, metrics=Metrics())
    controller.workloads = {"team/train": [next(iter(handlers.kueue_workloads(
        body=workload(("main", 2, 1)), memo=memo).values()))]}
    controller.podgroups = {"team/pg": [handlers.volcano_podgroups(
        body=podgroup("Pending", 2, {GPU: 2}), memo=memo)["team/pg"]]}
    body = {"metadata": {"name": "pg-0", "namespace": "team", "creationTimestamp": rfc3339(
                NOW - 60), "annotations": {"scheduling.k8s.io/group-name": "pg"}},
            "spec": {"containers": [container(1)]}, "status": {"phase": "Pending"}}
    controller.members = {key: [pod] for key, pod in handlers.volcano_members(
        body=body, memo=memo).items()}
    controller.pods = {k: [v] for k, v in handlers.cluster_pods(body=body, memo=memo).items()}
    snapshot = controller.snapshot({}, NOW)
    assert sorted(p.key for p in snapshot.pods) == [
        "kueue:team/train/main/0", "kueue:team/train/main/1", "team/pg-0", "volcano:team/pg/0"]
    assert snapshot.arrivals == (NOW - 60,)  # the pod only
    controller._observe_cluster(snapshot, NOW)
    metrics = {(s.name, tuple(s.labels.values())): s.value
               for family in controller.metrics.registry.collect() for s in family.samples}
    assert metrics[("tidal_pending_gpu_demand", ())] == 4
    assert metrics[("tidal_pending_gpu_pods", ())] == 1
    assert metrics[("tidal_queued_gpu_demand", ("kueue",))] == 2
    assert metrics[("tidal_queued_gpu_demand", ("volcano",))] == 1


@pytest.mark.parametrize(("kueue", "volcano", "watched"), [
    (True, True, {WORKLOADS, PODGROUPS, "pods"}),
    (True, False, {WORKLOADS}),
    (False, True, {PODGROUPS, "pods"}),
    (False, False, set()),
])
def test_only_the_sources_that_are_on_are_watched(kueue, volcano, watched):
    registry = kopf.OperatorRegistry()
    handlers.watch_queues(Config(kueue=kueue, volcano=volcano), registry)
    found = {(h.selector.group, h.selector.any_name) for h in
             registry._indexing.get_all_handlers()}
    expected = {("kueue.x-k8s.io", "workloads") if r == WORKLOADS else
                ("scheduling.volcano.sh", "podgroups") if r == PODGROUPS else (None, "pods")
                for r in watched}
    assert found == expected


# ---- an elastic job that queues through Kueue (item 2) -------------------------------------------


@pytest.fixture
def queued_job():
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["metadata"]["namespace"] = "team-a"
    doc["spec"]["workers"] = {"min": 2, "max": 6, "preferred": 3}
    doc["spec"].update(queueName="team-a-queue", priorityClassName="research")
    return parse_job(doc)


def test_the_minimum_is_a_kueue_pod_group_and_the_rest_run_as_tidal_elastic(queued_job):
    group = builders.pod_group("tiny", "0123456789", 1)
    member = builders.worker_pod(queued_job, uid="0123456789", index=0, generation=0,
                                 group=group)
    meta, spec = member["metadata"], member["spec"]
    assert group == "tiny-r1-01234"
    assert {k: v for k, v in meta["labels"].items() if k.startswith("kueue")} == {
        "kueue.x-k8s.io/queue-name": "team-a-queue", "kueue.x-k8s.io/pod-group-name": group}
    assert meta["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"
    assert spec["schedulingGates"] == [{"name": KUEUE_ADMISSION_GATE}]
    assert spec["priorityClassName"] == "research"
    default = queued_job.model_copy(update={"spec": queued_job.spec.model_copy(
        update={"priority_class_name": None})})
    assert "priorityClassName" not in builders.worker_pod(default, uid="u", index=0,
                                                          generation=0, group=group)["spec"]
    extra = builders.worker_pod(queued_job, uid="u", index=2, generation=0)
    assert not any(k.startswith("kueue") for k in extra["metadata"]["labels"])
    assert not any(k.startswith("kueue") for k in extra["metadata"]["annotations"])
    assert "schedulingGates" not in extra["spec"]
    assert extra["spec"]["priorityClassName"] == keys.ELASTIC_PRIORITY_CLASS
    long = builders.pod_group("x" * 60, "0123456789", 12)
    assert len(long) == 63 and long.endswith("-r12-01234")


def test_the_queue_admits_the_first_minimum_and_every_replacement_only(queued_job):
    join = ("tiny-worker-0", "tiny-worker-1", "tiny-worker-2")
    start = Target(workers=3, generation=0, reason=STARTED, join=join)
    assert [builders.queued_joiner(queued_job, start, n) for n in join] == [True, True, False]
    grow = Target(workers=5, generation=1, reason=IDLE_GPUS, join=("tiny-worker-3",))
    assert not builders.queued_joiner(queued_job, grow, "tiny-worker-3")
    restore = Target(workers=2, generation=2, reason=BELOW_MINIMUM, join=("tiny-worker-4",))
    assert builders.queued_joiner(queued_job, restore, "tiny-worker-4")
    assert not builders.queued_joiner(queued_job, restore, "tiny-worker-1")  # not a joiner
    unqueued = parse_job(yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text()))
    assert not any(builders.queued_joiner(unqueued, start, n) for n in join)


def test_the_kueue_example_is_a_queue_that_admits_its_jobs_minimum():
    """examples/kueue.yaml, as Kueue would read it: the job's LocalQueue leads to a
    ClusterQueue whose flavors exist and which covers every resource a worker asks for, with
    GPUs for the minimum; the job's PriorityClass is there too."""
    docs = list(yaml.safe_load_all((ROOT / "examples" / "kueue.yaml").read_text()))
    by_kind: dict[str, dict[str, dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    assert {d["apiVersion"] for d in docs if d["kind"] not in ("PriorityClass",
                                                                "ElasticTrainingJob")} == {
        "kueue.x-k8s.io/v1beta2"}
    [etj] = by_kind["ElasticTrainingJob"].values()
    job = parse_job(etj)
    queue = by_kind["LocalQueue"][job.spec.queue_name]
    assert queue["metadata"]["namespace"] == job.metadata.namespace
    cluster_queue = by_kind["ClusterQueue"][queue["spec"]["clusterQueue"]]
    assert cluster_queue["spec"]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": job.metadata.namespace}
    assert job.spec.priority_class_name in by_kind["PriorityClass"]
    member = builders.worker_pod(job, uid="u", index=0, generation=0, group="g")
    asked = {name for c in member["spec"]["containers"] for kind in ("requests", "limits")
             for name in c["resources"].get(kind, {})}
    [group] = cluster_queue["spec"]["resourceGroups"]
    assert asked <= set(group["coveredResources"]), "Kueue refuses a resource not covered"
    for flavor in group["flavors"]:
        assert flavor["name"] in by_kind["ResourceFlavor"]
        quota = {r["name"]: r["nominalQuota"] for r in flavor["resources"]}
        assert quota[GPU] >= job.spec.workers.min * job.spec.gpus_per_worker
