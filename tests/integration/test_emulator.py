"""The Kubernetes API emulator over real HTTP: the semantics a real API server has and kmock
alone lacks, then real clients (lightkube, a kopf operator) and the local scheduler and kubelet."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import pytest_asyncio
import yaml
from lightkube import ApiError, AsyncClient, Client, KubeConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Event, Node, Pod
from lightkube.types import PatchType

from tests import tools
from tidal_kube.apiserver import Emulator
from tidal_kube.clusterapi import ClusterApi
from tidal_kube.kubelet import DURATION_ANNOTATION, Kubelet
from tidal_kube.localcluster import create_nodes, node_manifests, register_nodes, run
from tidal_kube.patches import merge_patch, strategic_merge_patch
from tidal_kube.scheduler import Scheduler
from tidal_kube.selector import label_selector
from tidal_kube.serving import serve, write_kubeconfig
from tidal_kube.tables import human_duration

ROOT = Path(__file__).resolve().parents[2]
ETJ = "/apis/tidal.dev/v1alpha1/namespaces/default/elastictrainingjobs"
ETJ_RESOURCE = "tidal.dev/v1alpha1/elastictrainingjobs"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
PODS = "/api/v1/namespaces/default/pods"
SERVICES = "/api/v1/namespaces/default/services"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"

CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "elastictrainingjobs.tidal.dev"},
    "spec": {
        "group": "tidal.dev", "scope": "Namespaced",
        "names": {"plural": "elastictrainingjobs", "singular": "elastictrainingjob",
                  "kind": "ElasticTrainingJob", "shortNames": ["etj"]},
        "versions": [{
            "name": "v1alpha1", "served": True, "storage": True, "subresources": {"status": {}},
            "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                "spec": {"type": "object", "properties": {
                    "workers": {
                        "type": "object", "default": {},  # so that its fields' defaults apply
                        "properties": {"min": {"type": "integer", "minimum": 1, "default": 2},
                                       "max": {"type": "integer", "default": 8}},
                        "x-kubernetes-validations": [{
                            "rule": "self.min <= self.max", "message": "min must not exceed max",
                            "messageExpression":
                                "'min (' + string(self.min) + ') > max (' + string(self.max) + ')'",
                        }],
                    },
                    "image": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                }},
                "status": {"type": "object", "properties": {
                    "phase": {"type": "string", "enum": ["Pending", "Running"]},
                    "workers": {"type": "integer"},
                    "notes": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                }},
            }}},
        }],
    },
}


def job(name: str = "j1", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob",
            "metadata": {"name": name}, "spec": spec}


def pod(name: str = "p1", gpus: int = 0, spec: dict[str, Any] | None = None,
        **meta: Any) -> dict[str, Any]:
    resources = {"limits": {"nvidia.com/gpu": gpus}} if gpus else {}
    container = {"name": "main", "image": "busybox", "resources": resources}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **meta},
            "spec": {"containers": [container], **(spec or {})}}


class Api:
    """A raw HTTP client: what is on the wire is what is tested."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def call(self, method: str, path: str, body: Any = None,
                   content_type: str = "application/json", expect: int | None = None) -> Any:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type}
        async with self.session.request(method, path, data=data, headers=headers) as rsp:
            payload = await rsp.json()
        if expect is not None:
            assert rsp.status == expect, payload
        return payload

    async def create(self, path: str, body: Any, expect: int = 201) -> Any:
        return await self.call("POST", path, body, expect=expect)

    async def get(self, path: str, expect: int = 200) -> Any:
        return await self.call("GET", path, expect=expect)

    async def patch(self, path: str, body: Any, content_type: str = MERGE,
                    expect: int = 200) -> Any:
        return await self.call("PATCH", path, body, content_type, expect=expect)

    async def delete(self, path: str, body: Any = None, expect: int = 200) -> Any:
        return await self.call("DELETE", path, body, expect=expect)

    async def watch(self, path: str, timeout: str = "0.2", events: int | None = None,
                    **params: str) -> list[dict[str, Any]]:
        """The events of a watch that ends by its server-side timeout, or once ``events``
        have come."""
        query = {"watch": "true", "timeoutSeconds": timeout, **params}
        got: list[dict[str, Any]] = []
        async with self.session.get(path, params=query) as rsp:
            assert rsp.status == 200
            async for line in rsp.content:
                if line.strip():
                    got.append(json.loads(line))
                if len(got) == events:
                    break
        return got


@pytest_asyncio.fixture
async def served():
    async with serve() as running:
        yield running
    assert not running.emulator.failures, running.emulator.failures


@pytest_asyncio.fixture
async def api(served):
    async with aiohttp.ClientSession(served.url) as session:
        yield Api(session)


@pytest_asyncio.fixture
async def crd(api):
    await api.create(CRDS, CRD)


# -- stamping, subresources, patches, conflicts ---------------------------------------------------


@pytest.mark.asyncio
async def test_writes_stamp_metadata_and_count_generations(api, crd):
    created = await api.create(ETJ, job(image="a"))
    meta = created["metadata"]
    assert re.fullmatch(r"[0-9a-f-]{36}", meta["uid"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["creationTimestamp"])
    assert (meta["namespace"], meta["generation"]) == ("default", 1)
    assert created["spec"]["workers"] == {"min": 2, "max": 8}  # the schema's defaults

    relabelled = await api.patch(f"{ETJ}/j1", {"metadata": {"labels": {"team": "a"}}})
    assert int(relabelled["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert relabelled["metadata"]["generation"] == 1  # metadata is not the spec
    respecced = await api.patch(f"{ETJ}/j1", {"spec": {"image": "b"}})
    assert respecced["metadata"]["generation"] == 2
    assert (respecced["metadata"]["uid"], respecced["metadata"]["creationTimestamp"]) == (
        meta["uid"], meta["creationTimestamp"])
    again = await api.patch(f"{ETJ}/j1", {"spec": {"image": "b"}})
    assert again["metadata"]["resourceVersion"] == respecced["metadata"]["resourceVersion"]

    generated = await api.create(PODS, pod(name="", generateName="worker-"))
    assert re.fullmatch(r"worker-[a-z0-9]{5}", generated["metadata"]["name"])
    assert generated["status"]["phase"] == "Pending"


@pytest.mark.asyncio
async def test_status_subresource_separates_status_from_the_rest(api, crd):
    created = await api.create(ETJ, {**job(), "status": {"phase": "Running"}})
    assert "status" not in created  # a create does not write status
    await api.patch(f"{ETJ}/j1/status", {"status": {"phase": "Pending", "workers": 2},
                                         "spec": {"image": "x"}})
    await api.patch(f"{ETJ}/j1", {"status": {"phase": "Running"}, "spec": {"image": "y"}})
    stored = await api.get(f"{ETJ}/j1")
    assert stored["status"] == {"phase": "Pending", "workers": 2}
    assert stored["spec"]["image"] == "y"
    assert stored["metadata"]["generation"] == 2  # only the spec patch counted

    stored["status"]["workers"] = 3
    stored["spec"]["image"] = "z"
    replaced = await api.call("PUT", f"{ETJ}/j1/status", stored, expect=200)
    assert (replaced["status"]["workers"], replaced["spec"]["image"]) == (3, "y")


@pytest.mark.asyncio
async def test_merge_patch_deletes_with_null_and_replaces_lists(api, crd):
    await api.create(ETJ, job(image="a", tags=["x", "y"]))
    await api.patch(f"{ETJ}/j1/status", {"status": {"notes": {"a": 1, "b": {"c": 2, "d": 3}}}})
    deletions = {"status": {"notes": {"a": None, "b": {"c": None}}}}
    patched = await api.patch(f"{ETJ}/j1/status", deletions)
    assert patched["status"]["notes"] == {"b": {"d": 3}}
    patched = await api.patch(f"{ETJ}/j1", {"spec": {"tags": ["z"], "image": None}})
    assert patched["spec"] == {"workers": {"min": 2, "max": 8}, "tags": ["z"]}
    patch = {"a": [3], "b": None, "c": {"d": None}}
    assert merge_patch({"a": [1, 2], "b": 1}, patch) == {"a": [3], "c": {}}


@pytest.mark.asyncio
async def test_json_patch_test_op_and_patch_types(api, crd):
    created = await api.create(ETJ, job(image="a"))
    ops = [{"op": "test", "path": "/metadata/resourceVersion",
            "value": created["metadata"]["resourceVersion"]},
           {"op": "add", "path": "/metadata/finalizers", "value": ["tidal.dev/x"]}]
    patched = await api.patch(f"{ETJ}/j1", ops, "application/json-patch+json")
    assert patched["metadata"]["finalizers"] == ["tidal.dev/x"]
    failed = await api.patch(f"{ETJ}/j1", ops, "application/json-patch+json", expect=422)
    assert failed["reason"] == "Invalid"  # kopf retries on 422 when its resourceVersion test fails
    refused = await api.patch(f"{ETJ}/j1", {"spec": {}}, STRATEGIC, expect=415)
    assert refused["reason"] == "UnsupportedMediaType"  # as for any custom resource


def test_strategic_merge_patch_merges_lists_by_key():
    spec = {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}],
            "tolerations": [{"key": "x"}]}
    patch = {"containers": [{"name": "b", "image": "2"}, {"name": "c", "image": "3"}],
             "tolerations": [{"key": "y"}]}
    assert strategic_merge_patch(spec, patch) == {
        "containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "2"},
                       {"name": "c", "image": "3"}],
        "tolerations": [{"key": "y"}]}
    removed = strategic_merge_patch(spec, {"containers": [{"name": "a", "$patch": "delete"}]})
    assert [c["name"] for c in removed["containers"]] == ["b"]
    meta = strategic_merge_patch({"finalizers": ["a"]}, {
        "finalizers": ["b"], "$deleteFromPrimitiveList/finalizers": ["a"]})
    assert meta == {"finalizers": ["b"]}


@pytest.mark.asyncio
async def test_stale_resource_version_is_a_conflict(api, crd):
    created = await api.create(ETJ, job())
    await api.patch(f"{ETJ}/j1", {"spec": {"image": "new"}})
    stale = {**created, "spec": {**created["spec"], "image": "old"}}
    conflict = await api.call("PUT", f"{ETJ}/j1", stale, expect=409)
    assert conflict["reason"] == "Conflict"
    stale_patch = {"metadata": {"resourceVersion": created["metadata"]["resourceVersion"]},
                   "spec": {"image": "old"}}
    await api.patch(f"{ETJ}/j1", stale_patch, expect=409)
    current = await api.get(f"{ETJ}/j1")
    current["spec"]["image"] = "newer"
    assert (await api.call("PUT", f"{ETJ}/j1", current, expect=200))["spec"]["image"] == "newer"
    await api.create(ETJ, job(), expect=409)  # AlreadyExists


# -- selectors and watches ------------------------------------------------------------------------


def test_label_selector_grammar():
    labels = {"app": "w", "tier": "gpu"}
    cases = {"app=w": True, "app==w": True, "app!=w": False, "app": True, "!app": False,
             "!zone": True, "tier in (gpu, cpu)": True, "tier notin (gpu)": False,
             "app=w,tier in (cpu)": False, "": True}
    assert {text: label_selector(text)(labels) for text in cases} == cases
    with pytest.raises(kmock.KubernetesError):
        label_selector("app===w")


@pytest.mark.asyncio
async def test_list_filters_by_labels_and_fields(api):
    await api.create(PODS, pod("a", labels={"role": "worker", "job": "x"}))
    await api.create(PODS, pod("b", labels={"role": "worker", "job": "y"}))
    await api.create(PODS, pod("c"))
    await api.call("POST", f"{PODS}/b/binding", {"target": {"name": "n1"}}, expect=201)

    async def names(query: str) -> list[str]:
        listing = await api.get(f"/api/v1/pods?{query}")
        assert int(listing["metadata"]["resourceVersion"]) > 0
        return [item["metadata"]["name"] for item in listing["items"]]

    assert await names("labelSelector=role%3Dworker,job!%3Dy") == ["a"]
    assert await names("labelSelector=job+in+(x,y)") == ["a", "b"]
    assert await names("labelSelector=!role") == ["c"]
    assert await names("fieldSelector=spec.nodeName%3D") == ["a", "c"]
    assert await names("fieldSelector=spec.nodeName%3Dn1,status.phase%3DPending") == ["b"]
    assert await names("fieldSelector=metadata.name!%3Da,metadata.namespace%3Ddefault") == [
        "b", "c"]
    refused = await api.get("/api/v1/pods?fieldSelector=spec.priority%3D0", expect=400)
    assert "field label not supported" in refused["message"]
    page = await api.get("/api/v1/pods?limit=2")
    assert len(page["items"]) == 2 and page["metadata"]["continue"]
    rest = await api.get(f"/api/v1/pods?limit=2&continue={page['metadata']['continue']}")
    assert [p["metadata"]["name"] for p in rest["items"]] == ["c"]


@pytest.mark.asyncio
async def test_watch_resumes_filters_and_times_out(api, crd):
    first = await api.create(ETJ, job("a"))
    since = first["metadata"]["resourceVersion"]
    await api.create(ETJ, job("b"))
    await api.patch(f"{ETJ}/a", {"metadata": {"labels": {"pick": "yes"}}})
    await api.patch(f"{ETJ}/a", {"metadata": {"labels": {"pick": "no"}}})
    await api.delete(f"{ETJ}/b")

    started = time.monotonic()
    events = await api.watch(ETJ, timeout="1", resourceVersion=since)
    assert 0.9 < time.monotonic() - started < 5  # timeoutSeconds ends the stream
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "b"), ("MODIFIED", "a"), ("MODIFIED", "a"), ("DELETED", "b")]
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions)

    picked = await api.watch(ETJ, resourceVersion=since, labelSelector="pick=yes")
    assert [e["type"] for e in picked] == ["ADDED", "DELETED"]  # in, then out of the selector
    initial = await api.watch(ETJ)  # no resourceVersion: the current state first
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in initial] == [("ADDED", "a")]
    streamed = await api.watch(ETJ, sendInitialEvents="true", resourceVersionMatch="NotOlderThan")
    assert [e["type"] for e in streamed] == ["ADDED", "BOOKMARK"]


@pytest.mark.asyncio
async def test_watch_delivers_live_events_and_410_after_compaction():
    async with serve(emulator=Emulator(history=3)) as running:
        async with aiohttp.ClientSession(running.url) as session:
            api = Api(session)
            start = (await api.get(PODS))["metadata"]["resourceVersion"]
            # Ended by its fourth event, not by its timeout, which a loaded machine can reach
            # before the pods are created.
            live = asyncio.create_task(api.watch(PODS, timeout="60", events=4,
                                                 resourceVersion=start))
            await asyncio.sleep(0.2)
            for name in ("a", "b", "c", "d"):
                await api.create(PODS, pod(name))
            assert [e["object"]["metadata"]["name"] for e in await live] == ["a", "b", "c", "d"]
            gone = await api.watch(PODS, resourceVersion=start)
            assert [(e["type"], e["object"]["code"]) for e in gone] == [("ERROR", 410)]


# -- deletion: finalizers, owners, namespaces -----------------------------------------------------


@pytest.mark.asyncio
async def test_owner_deletion_collects_dependents(api, crd):
    owner = await api.create(ETJ, job())
    ref = {"apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob", "name": "j1",
           "uid": owner["metadata"]["uid"], "controller": True}
    await api.create(PODS, pod("w0", ownerReferences=[ref]))
    await api.create(PODS, pod("w1", ownerReferences=[ref], finalizers=["tidal.dev/drain"]))
    await api.create(SERVICES, {"metadata": {"name": "j1", "ownerReferences": [ref]},
                                "spec": {"clusterIP": "None", "selector": {"job": "j1"}}})
    await api.create(PODS, pod("free"))
    await api.create(PODS, pod("dangling", ownerReferences=[{**ref, "uid": "no-such-uid"}]))
    await api.delete(f"{ETJ}/j1")
    await asyncio.sleep(0.05)  # the collector works in the background

    names = [p["metadata"]["name"] for p in (await api.get(PODS))["items"]]
    assert names == ["free", "w1"]  # w1 waits for its finalizer
    assert (await api.get(f"{PODS}/w1"))["metadata"]["deletionTimestamp"]
    await api.get(f"{SERVICES}/j1", expect=404)
    await api.patch(f"{PODS}/w1", {"metadata": {"finalizers": None}})
    await api.get(f"{PODS}/w1", expect=404)

    orphan_owner = await api.create(ETJ, job("j2"))
    kept = {**ref, "name": "j2", "uid": orphan_owner["metadata"]["uid"]}
    await api.create(PODS, pod("kept", ownerReferences=[kept]))
    await api.delete(f"{ETJ}/j2", {"propagationPolicy": "Orphan"})
    await asyncio.sleep(0.05)
    assert (await api.get(f"{PODS}/kept"))["metadata"].get("ownerReferences") == []


@pytest.mark.asyncio
async def test_namespace_deletion_empties_it(api):
    await api.create("/api/v1/namespaces", {"metadata": {"name": "team"}})
    await api.get("/api/v1/namespaces/team/serviceaccounts/default")  # made for every namespace
    await api.create("/api/v1/namespaces/team/pods", pod("p"))
    await api.delete("/api/v1/namespaces/team")
    await api.get("/api/v1/namespaces/team", expect=404)
    await api.get("/api/v1/namespaces/team/pods/p", expect=404)
    missing = await api.create("/api/v1/namespaces/team/pods", pod("p"), expect=404)
    assert missing["message"] == 'namespaces "team" not found'


# -- custom resources -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_crd_registers_its_resource_with_schema(api):
    await api.get(ETJ, expect=404)
    await api.create(CRDS, CRD)
    crd = await api.get(f"{CRDS}/elastictrainingjobs.tidal.dev")
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"
    discovery = await api.get("/apis/tidal.dev/v1alpha1")
    entries = {r["name"]: r for r in discovery["resources"]}
    assert entries["elastictrainingjobs"]["shortNames"] == ["etj"]
    assert entries["elastictrainingjobs"]["namespaced"] is True
    assert entries["elastictrainingjobs/status"]["kind"] == "ElasticTrainingJob"
    assert any(g["name"] == "tidal.dev" for g in (await api.get("/apis"))["groups"])

    created = await api.create(ETJ, job(image="a", unknown=1, workers={"min": 3}))
    assert created["spec"] == {"image": "a", "workers": {"min": 3, "max": 8}}  # pruned, defaulted
    invalid = await api.create(ETJ, job("bad", workers={"min": 9, "max": 2}), expect=422)
    assert "spec.workers: Invalid value: min (9) > max (2)" in invalid["message"]
    invalid = await api.create(ETJ, job("bad", workers={"min": 0}, image=3), expect=422)
    assert "spec.workers.min" in invalid["message"] and "spec.image" in invalid["message"]
    await api.patch(f"{ETJ}/j1/status", {"status": {"phase": "Lost"}}, expect=422)  # enum
    pruned = await api.patch(f"{ETJ}/j1/status", {"status": {"phase": "Running", "typo": 1}})
    assert pruned["status"] == {"phase": "Running"}  # a field missing from the schema vanishes

    await api.delete(f"{CRDS}/elastictrainingjobs.tidal.dev")
    await api.get(ETJ, expect=404)


@pytest.mark.asyncio
async def test_repository_crd_and_examples(served):
    """The CRD in crds/ registers, both example jobs pass its schema, a bad one does not."""
    emulator = served.emulator
    crd_file = ROOT / "crds" / "elastictrainingjobs.tidal.dev.yaml"
    for manifest in yaml.safe_load_all(crd_file.read_text()):
        emulator.create(manifest)
    for example in ("tiny.yaml", "elastic-small.yaml"):
        created = emulator.create(yaml.safe_load((ROOT / "examples" / example).read_text()))
        assert created["spec"]["workers"]["min"] >= 1
    bad = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    bad["metadata"]["name"] = "bad"
    bad["spec"]["workers"] = {"min": 4, "max": 2}
    with pytest.raises(kmock.KubernetesError,
                       match=re.escape("workers.min (4) must not exceed workers.max (2)")):
        emulator.create(bad)


# -- admission ------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_pod_admission(api):
    elastic = {"priorityClassName": "tidal-elastic"}
    refused = await api.create(PODS, pod(spec=elastic), expect=403)
    assert "no PriorityClass with name tidal-elastic" in refused["message"]
    await api.create("/apis/scheduling.k8s.io/v1/priorityclasses",
                     {"metadata": {"name": "tidal-elastic"}, "value": -10})
    created = await api.create(PODS, pod(gpus=2, spec=elastic))
    assert created["spec"]["priority"] == -10
    assert created["spec"]["containers"][0]["resources"]["requests"] == {"nvidia.com/gpu": 2}

    unequal = pod("p2")
    unequal["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 1},
                                                     "requests": {"nvidia.com/gpu": 2}}
    refused = await api.create(PODS, unequal, expect=422)
    assert "must be equal to nvidia.com/gpu limit" in refused["message"]
    refused = await api.create(PODS, pod("p3", spec={"serviceAccountName": "tidal-worker"}),
                               expect=403)
    assert 'serviceaccount "tidal-worker" not found' in refused["message"]
    await api.create(PODS, pod("p4", labels={"job": "x" * 64}), expect=422)  # 63 at most
    await api.create(PODS, pod("Upper"), expect=422)

    await api.patch(f"{PODS}/p1", {"spec": {"nodeName": "n1"}}, expect=422)  # binding binds
    images = {"spec": {"containers": [{"name": "main", "image": "other"}]}}
    await api.patch(f"{PODS}/p1", images, STRATEGIC)  # images may change
    await api.call("POST", f"{PODS}/p1/binding", {"target": {"name": "n1"}}, expect=201)
    bound = await api.get(f"{PODS}/p1")
    assert (bound["spec"]["nodeName"], bound["spec"]["containers"][0]["image"]) == ("n1", "other")
    scheduled = bound["status"]["conditions"][0]
    assert (scheduled["type"], scheduled["status"]) == ("PodScheduled", "True")
    await api.call("POST", f"{PODS}/p1/binding", {"target": {"name": "n2"}}, expect=409)


@pytest.mark.asyncio
async def test_service_admission(api):
    port = {"ports": [{"port": 80}]}
    await api.create(SERVICES, {"metadata": {"name": "1job"}, "spec": port}, expect=422)
    await api.create(SERVICES, {"metadata": {"name": "job"}, "spec": {}}, expect=422)  # ports
    created = await api.create(SERVICES, {"metadata": {"name": "job"}, "spec": port})
    assert created["spec"]["clusterIP"].startswith("10.")
    headless = await api.create(SERVICES, {"metadata": {"name": "peers"},
                                           "spec": {"clusterIP": "None"}})
    assert headless["spec"]["clusterIP"] == "None"


@pytest.mark.asyncio
async def test_faults_can_be_injected_with_the_kmock_dsl(served, api):
    served.emulator["patch", kmock.resource("v1/pods")] << 503
    await api.create(PODS, pod())
    async with api.session.patch(f"{PODS}/p1", data="{}", headers={"Content-Type": MERGE}) as rsp:
        assert rsp.status == 503
    await api.get(f"{PODS}/p1")


@pytest.mark.asyncio
async def test_a_fault_is_injected_after_many_requests_and_every_request_is_recorded(served, api):
    """kmock's DSL sees only the latest requests (it scans them for each one), while the
    emulator's ``requests`` keep them all, with their tokens, for tests that audit them."""
    emulator = served.emulator
    await api.create(PODS, pod())
    before = len(emulator.requests)
    for _ in range(5 * emulator.dsl_requests):
        await api.get(f"{PODS}/p1")
    emulator["get", kmock.resource("v1/pods")][lambda request: "p1" in request.url.path] << 503
    async with api.session.get(f"{PODS}/p1") as rsp:
        assert rsp.status == 503
    assert len(emulator.requests) == before + 5 * emulator.dsl_requests + 1
    assert {r.method.value for r in list(emulator.requests)[before:]} == {"GET"}


# -- running it, and real clients -----------------------------------------------------------------


def test_lightkube_round_trips(emulator):
    emulator.call(emulator.emulator.create, CRD)
    Job = create_namespaced_resource("tidal.dev", "v1alpha1", "ElasticTrainingJob",
                                     "elastictrainingjobs")
    client = Client(config=KubeConfig.from_file(emulator.kubeconfig), field_manager="tests")
    try:
        node = client.create(Node.from_dict({"metadata": {"name": "n1"},
                                             "status": {"allocatable": {"nvidia.com/gpu": "8"}}}))
        assert node.status.allocatable == {"nvidia.com/gpu": "8"}
        created = client.create(Pod.from_dict(pod("w0", labels={"job": "j1"})))
        assert created.status.phase == "Pending"
        with pytest.raises(ApiError) as conflict:  # a Status, as lightkube reads it from a server
            client.create(Pod.from_dict(pod("w0")))
        assert (conflict.value.status.code, conflict.value.status.reason) == (409, "AlreadyExists")
        client.patch(Pod.Status, "w0", {"status": {"phase": "Running"}}, patch_type=PatchType.MERGE)
        assert [p.status.phase for p in client.list(Pod, labels={"job": "j1"})] == ["Running"]
        client.create(Event.from_dict({"metadata": {"generateName": "j1-"}, "reason": "ScaledUp",
                                       "message": "2 -> 4",
                                       "involvedObject": {"kind": "Pod", "name": "w0"}}))
        assert [e.reason for e in client.list(Event)] == ["ScaledUp"]

        client.create(Job(job(workers={"min": 1, "max": 2})))
        client.patch(Job, "j1", {"spec": {"image": "x"}}, patch_type=PatchType.MERGE)
        client.patch(Job.Status, "j1", {"status": {"phase": "Running"}}, patch_type=PatchType.MERGE)
        fetched = client.get(Job, "j1")
        assert (fetched["spec"]["image"], fetched.status["phase"]) == ("x", "Running")
        client.delete(Job, "j1")
        since = fetched.metadata.resourceVersion
        kind, obj = next(iter(client.watch(Job, resource_version=since, server_timeout=5)))
        assert (kind, obj.metadata.name) == ("DELETED", "j1")
        client.delete(Node, "n1")
        assert [n.metadata.name for n in client.list(Node)] == []
    finally:
        client.close()


@pytest.mark.asyncio
async def test_lightkube_async_client(served, tmp_path):
    config = KubeConfig.from_file(write_kubeconfig(tmp_path / "kubeconfig", served.url))
    client = AsyncClient(config=config)
    try:
        await client.create(Pod.from_dict(pod("w0")))
        got = await client.get(Pod, "w0")
        assert got.spec.containers[0].image == "busybox"
        await client.delete(Pod, "w0")
        assert [p async for p in client.list(Pod)] == []
    finally:
        await client.close()


KOPF_OPERATOR = '''
import kopf

@kopf.on.startup()
def configure(settings, **_):
    settings.watching.server_timeout = 10
    settings.networking.request_timeout = 10

@kopf.on.create("tidal.dev", "v1alpha1", "elastictrainingjobs")
def created(body, spec, patch, **_):
    kopf.info(body, reason="Seen", message=f"workers {spec['workers']['min']}")
    patch.status["phase"] = "Running"
    patch.status["workers"] = spec["workers"]["min"]
'''


def _wait(check, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (found := check()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_kopf_operator_sees_a_job_and_patches_its_status(emulator, tmp_path):
    emulator.call(emulator.emulator.create, CRD)
    (tmp_path / "op.py").write_text(KOPF_OPERATOR)
    log = tmp_path / "kopf.log"
    command = [sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces",
               "--verbose", str(tmp_path / "op.py")]
    env = {**os.environ, "KUBECONFIG": str(emulator.kubeconfig)}
    with log.open("w") as out:
        operator = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        emulator.call(emulator.emulator.create, job(workers={"min": 3, "max": 4}))

        def status() -> dict[str, Any]:
            stored = emulator.call(emulator.emulator.get, ETJ_RESOURCE, "default", "j1")
            return stored.get("status", {})

        assert _wait(status, 30) == {"phase": "Running", "workers": 3}, log.read_text()
        events = _wait(lambda: emulator.call(emulator.emulator.list, "v1/events"), 10)
        assert [(e["reason"], e["message"], e["involvedObject"]["name"]) for e in events] == [
            ("Seen", "workers 3", "j1")]
    finally:
        operator.send_signal(signal.SIGTERM)
        operator.wait(timeout=15)
    text = log.read_text()
    assert "Handler 'created' succeeded" in text
    assert not re.search(r"\[(ERROR|WARNING) ", text), text


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_command_line_serves_until_sigterm(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    crd = tmp_path / "crd.yaml"
    crd.write_text(yaml.safe_dump(CRD))
    path = os.pathsep.join([*(str(ROOT / root) for root in ("api", "operator", "doubles")),
                       os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "tidal_kube.emulator", "--port", "0",
               "--kubeconfig", str(kubeconfig), "--apply", str(crd)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": path}) as server:
        try:
            line = server.stdout.readline()
            assert line.startswith("ready http://127.0.0.1:"), line
            url = line.split()[1]
            config = yaml.safe_load(kubeconfig.read_text())
            assert config["clusters"][0]["cluster"]["server"] == url
            assert config["users"][0]["user"]["token"]
            with urllib.request.urlopen(f"{url}{ETJ}") as rsp:
                assert json.load(rsp)["kind"] == "ElasticTrainingJobList"
        finally:
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=10) == 0


# -- the local scheduler and kubelet --------------------------------------------------------------


def gpu_pod(name: str, gpus: int, duration: float | None = None, **spec: Any) -> dict[str, Any]:
    manifest = pod(name, gpus, spec)
    if duration is not None:
        manifest["metadata"]["annotations"] = {DURATION_ANNOTATION: str(duration)}
    return manifest


@pytest.mark.asyncio
async def test_scheduler_binds_by_gpus_and_kubelet_runs_for_the_duration(served, api):
    async with ClusterApi(served.url) as cluster:
        assert await create_nodes(cluster, 2, 4) == ["node-0", "node-1"]
        assert await create_nodes(cluster, 2, 4) == ["node-0", "node-1"]  # idempotent
        for name, gpus in (("a", 3), ("b", 2), ("c", 2), ("d", 4)):
            await api.create(PODS, gpu_pod(name, gpus, duration=1 if name == "a" else None))
        await api.create(PODS, gpu_pod("e", 1, nodeSelector={"zone": "x"}))

        assert await Scheduler(cluster).step() == ["default/a", "default/b", "default/c"]
        placed = {p["metadata"]["name"]: p for p in (await api.get(PODS))["items"]}
        assert [placed[n]["spec"].get("nodeName") for n in "abcde"] == [
            "node-0", "node-1", "node-1", None, None]
        waiting = {c["type"]: c for c in placed["d"]["status"]["conditions"]}["PodScheduled"]
        assert (waiting["status"], waiting["reason"]) == ("False", "Unschedulable")
        assert waiting["message"] == (
            "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 nodes are "
            "available: 2 No preemption victims found for incoming pod.")
        waiting = {c["type"]: c for c in placed["e"]["status"]["conditions"]}["PodScheduled"]
        assert waiting["message"] == (
            "0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector. "
            "preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling.")
        assert sorted((e["involvedObject"]["name"], e["message"])
                      for e in await failed_scheduling(api)) == [
            ("d", placed["d"]["status"]["conditions"][-1]["message"]),
            ("e", placed["e"]["status"]["conditions"][-1]["message"])]

        version = served.emulator.resource_version
        assert await Scheduler(cluster).step() == []  # restarted: nothing new, nothing written
        assert served.emulator.resource_version == version

        started = datetime.datetime.now(datetime.UTC)
        await Kubelet(cluster).step(started)
        running = {p["metadata"]["name"]: p["status"] for p in (await api.get(PODS))["items"]}
        assert [running[n]["phase"] for n in "abcd"] == ["Running", "Running", "Running", "Pending"]
        assert running["a"]["containerStatuses"][0]["state"]["running"]
        await Kubelet(cluster).step(started)  # idempotent
        assert served.emulator.resource_version == version + 3

        await Kubelet(cluster).step(started + datetime.timedelta(seconds=2))
        done = (await api.get(f"{PODS}/a"))["status"]
        assert done["phase"] == "Succeeded"
        assert done["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
        assert (await api.get(f"{PODS}/b"))["status"]["phase"] == "Running"  # no duration
        assert await Scheduler(cluster).step() == ["default/d"]  # a's GPUs are free again
        assert (await api.get(f"{PODS}/d"))["spec"]["nodeName"] == "node-0"


@pytest.mark.asyncio
async def test_scheduler_takes_higher_priority_first(served, api):
    await api.create("/apis/scheduling.k8s.io/v1/priorityclasses",
                     {"metadata": {"name": "high"}, "value": 100})
    async with ClusterApi(served.url) as cluster:
        await create_nodes(cluster, 1, 4)
        await api.create(PODS, gpu_pod("early", 4))
        await api.create(PODS, gpu_pod("urgent", 4, priorityClassName="high"))
        assert await Scheduler(cluster).step() == ["default/urgent"]


@pytest.mark.asyncio
async def test_scheduler_keeps_pods_off_nodes_whose_taints_they_do_not_tolerate(served, api):
    (node,) = node_manifests(1, 4, prefix="reserved")
    node["spec"] = {"taints": [{"key": "dedicated", "value": "inference", "effect": "NoSchedule"},
                               {"key": "spot", "effect": "PreferNoSchedule"}]}  # a preference
    async with ClusterApi(served.url) as cluster:
        await cluster.request("POST", "/api/v1/nodes", node)
        await api.create(PODS, gpu_pod("plain", 1))
        await api.create(PODS, gpu_pod("tolerant", 1, tolerations=[
            {"key": "dedicated", "operator": "Equal", "value": "inference",
             "effect": "NoSchedule"}]))
        assert await Scheduler(cluster).step() == ["default/tolerant"]
        plain = {c["type"]: c for c in (await api.get(f"{PODS}/plain"))["status"]["conditions"]}
        assert plain["PodScheduled"]["message"] == (
            "0/1 nodes are available: 1 node(s) had untolerated taint {dedicated: inference}. "
            "preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling.")


async def failed_scheduling(api: Api) -> list[dict[str, Any]]:
    return [e for e in (await api.get("/api/v1/namespaces/default/events"))["items"]
            if e["reason"] == "FailedScheduling"]


@pytest.mark.asyncio
async def test_an_unschedulable_pod_gets_a_failed_scheduling_event_once_per_reason(served, api):
    """As kube-scheduler: a Warning Event on the pod saying why each node refused it (the first
    filter that did, in kube-scheduler's order), not repeated while the reason holds, counted
    up when it comes back."""
    gpus = node_manifests(3, 2)
    gpus[0]["spec"] = {"taints": [{"key": "dedicated", "value": "inference",
                                   "effect": "NoSchedule"}]}
    for node, zone in zip(gpus, "aab", strict=True):  # node-1 in zone a, but with 2 GPUs
        node["metadata"]["labels"]["zone"] = zone
    async with ClusterApi(served.url) as cluster:
        assert await Scheduler(cluster).step() == []
        for node in gpus:
            await cluster.request("POST", "/api/v1/nodes", node)
        await api.create(PODS, gpu_pod("big", 4, nodeSelector={"zone": "a"}))
        created = await api.get(f"{PODS}/big")
        assert await Scheduler(cluster).step() == []
        [event] = await failed_scheduling(api)
        message = ("0/3 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) didn't "
                   "match Pod's node affinity/selector, 1 node(s) had untolerated taint "
                   "{dedicated: inference}. preemption: 0/3 nodes are available: 1 No preemption "
                   "victims found for incoming pod, 2 Preemption is not helpful for scheduling.")
        assert event["message"] == message
        assert (event["type"], event["reason"], event["action"], event["count"]) == (
            "Warning", "FailedScheduling", "Scheduling", 1)
        assert event["involvedObject"] == {
            "apiVersion": "v1", "kind": "Pod", "name": "big", "namespace": "default",
            "uid": created["metadata"]["uid"],
            "resourceVersion": created["metadata"]["resourceVersion"]}
        assert event["source"] == {"component": "default-scheduler"}
        assert event["reportingComponent"] == "default-scheduler"
        assert event["firstTimestamp"] == event["lastTimestamp"]
        condition = (await api.get(f"{PODS}/big"))["status"]["conditions"][-1]
        assert (condition["reason"], condition["message"]) == ("Unschedulable", message)

        for _ in range(3):  # the same reason: said once, nothing written
            version = served.emulator.resource_version
            assert await Scheduler(cluster).step() == []
            assert served.emulator.resource_version == version
        assert [e["count"] for e in await failed_scheduling(api)] == [1]

        # Another reason (a fourth node), another Event; back to the first, the first counts up.
        (extra,) = node_manifests(1, 2, prefix="extra")
        extra["metadata"]["labels"]["zone"] = "a"
        await cluster.request("POST", "/api/v1/nodes", extra)
        assert await Scheduler(cluster).step() == []
        later = {e["message"]: e for e in await failed_scheduling(api)}
        assert later.keys() == {message, (
            "0/4 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
            "1 node(s) had untolerated taint {dedicated: inference}, 2 Insufficient "
            "nvidia.com/gpu. preemption: 0/4 nodes are available: 2 No preemption victims found "
            "for incoming pod, 2 Preemption is not helpful for scheduling.")}
        assert later[message]["count"] == 1
        await api.delete("/api/v1/nodes/extra-0")
        assert await Scheduler(cluster).step() == []
        again = {e["message"]: e for e in await failed_scheduling(api)}
        assert len(again) == 2 and again[message]["count"] == 2

        for node in ("node-0", "node-1", "node-2"):
            await api.delete(f"/api/v1/nodes/{node}")
        assert await Scheduler(cluster).step() == []
        condition = (await api.get(f"{PODS}/big"))["status"]["conditions"][-1]
        assert condition["message"] == "no nodes available to schedule pods"
        assert len(await failed_scheduling(api)) == 3


def test_local_cluster_runs_beside_a_threaded_emulator(emulator):
    """The synchronous way: nodes over HTTP, the loop on the emulator's thread, cancel to stop."""
    assert register_nodes(emulator.url, 1, 2) == ["node-0"]
    assert register_nodes(emulator.url, 1, 2) == ["node-0"]
    loop = emulator.submit(run(emulator.url, interval_s=0.05))
    client = Client(config=KubeConfig.from_file(emulator.kubeconfig))
    try:
        assert client.get(Node, "node-0").status.allocatable["nvidia.com/gpu"] == "2"
        client.create(Pod.from_dict(gpu_pod("w", 2)))
        assert _wait(lambda: client.get(Pod, "w").status.phase == "Running", 10)
        assert client.get(Pod, "w").spec.nodeName == "node-0"
    finally:
        client.close()
        loop.cancel()
    assert loop.cancelled()


@pytest.mark.asyncio
async def test_a_running_pod_terminates_gracefully_through_the_kubelet(served, api):
    async with ClusterApi(served.url) as cluster:
        await create_nodes(cluster, 1, 4)
        await api.create(PODS, gpu_pod("old", 4))
        await Scheduler(cluster).step()
        await Kubelet(cluster).step()
        deleted = await api.delete(f"{PODS}/old")
        assert deleted["metadata"]["deletionGracePeriodSeconds"] == 30
        await api.create(PODS, gpu_pod("old", 4), expect=409)  # the name is not free yet
        await api.create(PODS, gpu_pod("new", 4))
        assert await Scheduler(cluster).step() == []  # a terminating pod holds its GPUs
        await Kubelet(cluster).step()
        await api.get(f"{PODS}/old", expect=404)
        assert await Scheduler(cluster).step() == ["default/new"]
        await api.create(PODS, gpu_pod("unbound", 4))
        await api.delete(f"{PODS}/unbound")  # never scheduled: gone at once
        await api.get(f"{PODS}/unbound", expect=404)


# -- what kubectl and helm need: tables, OpenAPI v3, protobuf bodies ------------------------------

TABLE = ("application/json;as=Table;v=v1;g=meta.k8s.io,"  # what kubectl get sends
         "application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json")


@pytest.mark.parametrize(("seconds", "printed"), [
    (-5, "<invalid>"), (-1, "0s"), (0, "0s"), (70, "70s"), (119, "119s"), (120, "2m"),
    (190, "3m10s"), (600, "10m"), (70 * 60, "70m"), (3 * 3600, "3h"), (3 * 3600 + 60, "3h1m"),
    (47 * 3600, "47h"), (49 * 3600, "2d1h"), (8 * 86400, "8d"), (367 * 86400, "367d"),
    (731 * 86400, "2y1d"), (9 * 365 * 86400, "9y")])
def test_ages_read_as_kubectl_prints_them(seconds, printed):
    assert human_duration(seconds) == printed


@pytest.mark.asyncio
async def test_tables_carry_printer_columns_for_kubectl_get(api, crd, served):
    crd_columns = [{"name": "Workers", "type": "integer", "jsonPath": ".status.workers"},
                   {"name": "Image", "type": "string", "jsonPath": ".spec.image", "priority": 1},
                   {"name": "First", "type": "string", "jsonPath": ".spec.tags[0]"},
                   {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    versions = [{**CRD["spec"]["versions"][0], "additionalPrinterColumns": crd_columns}]
    await api.patch(f"{CRDS}/elastictrainingjobs.tidal.dev", {"spec": {"versions": versions}})
    await api.create(ETJ, job("j1", image="agent:1", tags=["a", "b"]))
    await api.patch(f"{ETJ}/j1/status", {"status": {"workers": 3}})
    await api.create(PODS, pod("p1"))

    async def table(path: str, **params: str) -> dict[str, Any]:
        async with api.session.get(path, params=params, headers={"Accept": TABLE}) as rsp:
            assert rsp.status == 200
            return await rsp.json()

    listed = await table(ETJ)
    assert listed["kind"] == "Table" and listed["apiVersion"] == "meta.k8s.io/v1"
    assert [(c["name"], c["type"], c["priority"]) for c in listed["columnDefinitions"]] == [
        ("Name", "string", 0), ("Workers", "integer", 0), ("Image", "string", 1),
        ("First", "string", 0), ("Age", "date", 0)]
    [row] = listed["rows"]
    assert row["cells"][:4] == ["j1", 3, "agent:1", "a"] and re.fullmatch(r"\d+s", row["cells"][4])
    assert row["object"]["kind"] == "PartialObjectMetadata"
    assert row["object"]["metadata"]["name"] == "j1"
    assert listed["metadata"]["resourceVersion"]

    one = await table(f"{ETJ}/j1", includeObject="Object")
    assert one["rows"][0]["object"]["spec"]["image"] == "agent:1"
    assert "object" not in (await table(ETJ, includeObject="None"))["rows"][0]

    pods = await table(PODS)
    assert [c["name"] for c in pods["columnDefinitions"]] == [
        "Name", "Ready", "Status", "Restarts", "Age", "IP", "Node"]
    assert pods["rows"][0]["cells"][:4] == ["p1", "0/1", "Pending", 0]
    namespaces = await table("/api/v1/namespaces")
    assert ["default", "Active"] == namespaces["rows"][0]["cells"][:2]

    async with api.session.get(ETJ, params={"watch": "true", "timeoutSeconds": "0.3"},
                               headers={"Accept": TABLE}) as rsp:
        assert rsp.headers["Content-Type"] == "application/json"
        events = [json.loads(line) async for line in rsp.content if line.strip()]
    assert [(e["type"], e["object"]["kind"], e["object"]["rows"][0]["cells"][1])
            for e in events] == [("ADDED", "Table", 3)]

    # A client that asks for JSON gets the objects, as before.
    assert (await api.get(ETJ))["items"][0]["spec"]["image"] == "agent:1"


@pytest.mark.asyncio
async def test_openapi_v3_leaves_field_validation_to_the_server(api, crd):
    index = await api.get("/openapi/v3")
    assert {"api/v1", "apis/apps/v1", "apis/tidal.dev/v1alpha1"} <= index["paths"].keys()
    url = index["paths"]["apis/tidal.dev/v1alpha1"]["serverRelativeURL"]
    assert url.startswith("/openapi/v3/apis/tidal.dev/v1alpha1?hash=")
    document = await api.get(url)
    patch = document["paths"][
        "/apis/tidal.dev/v1alpha1/namespaces/{namespace}/elastictrainingjobs/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {
        "group": "tidal.dev", "version": "v1alpha1", "kind": "ElasticTrainingJob"}
    assert "fieldValidation" in {p["name"] for p in patch["parameters"]}
    assert "requestBody" not in patch  # so kubectl sends merge patches, not strategic ones
    schema = document["components"]["schemas"]["dev.tidal.v1alpha1.ElasticTrainingJob"]
    assert schema["x-kubernetes-group-version-kind"] == [
        {"group": "tidal.dev", "version": "v1alpha1", "kind": "ElasticTrainingJob"}]
    assert schema["properties"]["spec"] == CRD["spec"]["versions"][0]["schema"][
        "openAPIV3Schema"]["properties"]["spec"]
    meta = schema["properties"]["metadata"]["allOf"][0]["$ref"].rpartition("/")[2]
    assert "name" in document["components"]["schemas"][meta]["properties"]
    nodes = (await api.get("/openapi/v3/api/v1"))["paths"]["/api/v1/nodes/{name}"]["patch"]
    assert nodes["x-kubernetes-group-version-kind"]["kind"] == "Node"
    await api.call("GET", "/openapi/v3/apis/nothing.example/v1", expect=404)
    version = await api.get("/version")
    assert version["gitVersion"].startswith("v1.33.") and version["minor"] == "33"


def _kubectl(cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(tools.kubectl()), "--kubeconfig", str(cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 or not check, f"kubectl {' '.join(args)}: {done.stderr}"
    return done


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_kubectl_applies_gets_describes_and_watches(emulator):
    """The real kubectl v1.33: apply (OpenAPI v3, server-side field validation), get with the
    CRD's printer columns, describe with the job's Events (field selectors on involvedObject),
    get -w, and the protobuf bodies of ``kubectl create``."""
    crd_file = str(ROOT / "crds" / "elastictrainingjobs.tidal.dev.yaml")
    assert "created" in _kubectl(emulator, "apply", "-f", crd_file).stdout
    assert "created" in _kubectl(emulator, "apply", "-f", str(ROOT / "examples/tiny.yaml")).stdout
    assert "unchanged" in _kubectl(emulator, "apply", "-f", str(ROOT / "examples/tiny.yaml")).stdout
    status = {"workers": 2, "phase": "Running", "step": 5, "layout": {
        "dp": 1, "pp": 2, "partition": [4, 4], "schedule": "1f1b", "microBatchSize": 2,
        "numMicroBatches": 8}}
    _kubectl(emulator, "patch", "etj", "tiny", "--subresource=status", "--type=merge",
             "-p", json.dumps({"status": status}))
    uid = emulator.call(emulator.emulator.get, ETJ_RESOURCE, "default", "tiny")["metadata"]["uid"]
    for name, (reason, message, kind, target) in {
        "tiny.1": ("ScaleUp", "2 -> 4 workers: 2 GPUs idle", "ElasticTrainingJob", "tiny"),
        "tiny.2": ("ScaleDown", "4 -> 2 workers: a pod waits", "ElasticTrainingJob", "tiny"),
        "other.1": ("Elsewhere", "not about tiny", "Pod", "tiny"),
    }.items():
        emulator.call(emulator.emulator.create, {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": "default"},
            "involvedObject": {"apiVersion": "tidal.dev/v1alpha1" if kind != "Pod" else "v1",
                               "kind": kind, "name": target, "namespace": "default",
                               "uid": uid if kind != "Pod" else "0"},
            "reason": reason, "message": message, "type": "Normal", "count": 1,
            "source": {"component": "tidal-operator"},
            "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:00:00Z"})

    header, row = _kubectl(emulator, "get", "etj").stdout.splitlines()
    assert header.split() == ["NAME", "WORKERS", "PP", "DP", "STEP", "PHASE", "AGE"]
    assert row.split()[:6] == ["tiny", "2", "2", "1", "5", "Running"]
    header, row = _kubectl(emulator, "get", "etj", "-o", "wide").stdout.splitlines()
    assert header.split()[-2:] == ["RESTARTS", "AGE"], header
    assert row.split()[:7] == ["tiny", "2", "2", "1", "5", "Running", "0"], row
    described = _kubectl(emulator, "describe", "etj", "tiny").stdout
    events = described[described.index("Events:"):]
    assert "ScaleUp" in events and "2 -> 4 workers: 2 GPUs idle" in events
    assert "ScaleDown" in events and "Elsewhere" not in events
    listed = _kubectl(emulator, "get", "events", "--field-selector",
                      "involvedObject.kind=ElasticTrainingJob,involvedObject.name=tiny").stdout
    assert listed.split("\n")[0].split()[:4] == ["LAST", "SEEN", "TYPE", "REASON"]
    assert "elastictrainingjob/tiny" in listed and "Elsewhere" not in listed

    with subprocess.Popen([str(tools.kubectl()), "--kubeconfig", str(emulator.kubeconfig),
                           "get", "etj", "-w"], stdout=subprocess.PIPE, text=True) as watch:
        try:
            assert watch.stdout.readline().split()[0] == "NAME"
            assert watch.stdout.readline().split()[:5] == ["tiny", "2", "2", "1", "5"]
            _kubectl(emulator, "patch", "etj", "tiny", "--subresource=status", "--type=merge",
                     "-p", '{"status": {"step": 6}}')
            assert watch.stdout.readline().split()[:5] == ["tiny", "2", "2", "1", "6"]
        finally:
            watch.kill()

    # kubectl create sends these kinds as protobuf; the emulator decodes them.
    _kubectl(emulator, "create", "namespace", "team-a")
    _kubectl(emulator, "create", "serviceaccount", "bob", "-n", "team-a")
    _kubectl(emulator, "create", "secret", "generic", "s1", "--from-literal=token=abc",
             "-n", "team-a")
    _kubectl(emulator, "create", "configmap", "c1", "--from-literal=mode=fast", "-n", "team-a")
    get = emulator.emulator.get
    assert emulator.call(get, "v1/namespaces", None, "team-a")["status"]["phase"] == "Active"
    assert emulator.call(get, "v1/serviceaccounts", "team-a", "bob") is not None
    secret = emulator.call(get, "v1/secrets", "team-a", "s1")
    assert secret["data"] == {"token": "YWJj"} and secret["type"] == "Opaque"
    assert emulator.call(get, "v1/configmaps", "team-a", "c1")["data"] == {"mode": "fast"}
    refused = _kubectl(emulator, "create", "deployment", "d", "--image=x", check=False)
    assert refused.returncode != 0 and "not protobuf" in refused.stderr
    assert "No resources found" in _kubectl(emulator, "get", "pods", "-A").stderr


def _words(text: str) -> str:
    """Text with its line breaks and indents as single spaces: kubectl wraps descriptions."""
    return " ".join(text.split())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_kubectl_explains_a_custom_resource_from_its_crd(emulator):
    """``kubectl explain`` reads the CRD's openAPIV3Schema from the OpenAPI v3 document of its
    group-version: each field with its type and description, ObjectMeta behind metadata, and an
    error for a field the schema lacks."""
    crd_file = ROOT / "crds" / "elastictrainingjobs.tidal.dev.yaml"
    _kubectl(emulator, "apply", "-f", str(crd_file))
    schema = yaml.safe_load(crd_file.read_text())["spec"]["versions"][0]["schema"]
    spec = schema["openAPIV3Schema"]["properties"]["spec"]
    for path, node in (("elastictrainingjob.spec", spec),
                       ("etj.spec.workers", spec["properties"]["workers"])):
        explained = _kubectl(emulator, "explain", path).stdout
        assert explained.startswith(
            "GROUP:      tidal.dev\nKIND:       ElasticTrainingJob\nVERSION:    v1alpha1\n")
        assert f"FIELD: {path.rsplit('.', 1)[1]} <Object>" in explained
        assert _words(node["description"]) in _words(explained)
        for name, field in node["properties"].items():
            shown = {"object": "Object"}.get(field["type"], field["type"])
            assert re.search(rf"^  {name}\t<{shown}>", explained, re.MULTILINE), (name, explained)
            assert _words(field["description"]) in _words(explained), name
    whole = _kubectl(emulator, "explain", "etj").stdout
    assert re.search(r"^  metadata\t<ObjectMeta>", whole, re.MULTILINE)
    assert "Name must be unique" in _kubectl(emulator, "explain", "etj.metadata").stdout
    missing = _kubectl(emulator, "explain", "etj.spec.nothing", check=False)
    assert missing.returncode != 0 and 'field "nothing" does not exist' in missing.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_kubectl_describe_shows_why_a_pod_waits(emulator):
    """The scheduler's FailedScheduling Event, where ``kubectl describe pod`` lists it."""
    register_nodes(emulator.url, 2, 1)
    emulator.call(emulator.emulator.create, gpu_pod("big", 2))

    async def one_pass() -> list[str]:
        async with ClusterApi(emulator.url) as cluster:
            return await Scheduler(cluster).step()

    assert emulator.call(one_pass) == []
    described = _kubectl(emulator, "describe", "pod", "big").stdout
    events = described[described.index("Events:"):]
    assert re.search(r"Warning\s+FailedScheduling\s+\S+\s+default-scheduler\s+0/2 nodes are "
                     r"available: 2 Insufficient nvidia\.com/gpu\. preemption: 0/2 nodes are "
                     r"available: 2 No preemption victims found for incoming pod\.$",
                     events, re.MULTILINE), events
