"""The OpenAPI v3 documents kubectl and helm read: ``/openapi/v3`` indexes one document per
group-version, and each lists the PATCH of every resource there with ``fieldValidation`` (so
clients leave validation to the server, as with a real one) and, for custom resources, the
CRD's ``openAPIV3Schema`` as a component schema (what ``kubectl explain`` prints).

No schemas of built-in kinds (``kubectl explain pods`` fails): kubectl builds strategic merge
patches from its own types. Patch operations list no request bodies, so kubectl does not
compute strategic merge patches of custom resources from them either (a real server refuses
those with 415)."""

from __future__ import annotations

import copy
import hashlib
import json

from tidal_kube.resources import KUBE_VERSION, Catalog, Obj, Resource, api_error

OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
_METADATA_DESCRIPTION = ("Standard object's metadata. More info: https://git.k8s.io/community/"
                         "contributors/devel/sig-architecture/api-conventions.md#metadata")
# ObjectMeta, as far as clients set it (what ``kubectl explain <kind>.metadata`` lists).
_OBJECT_META: Obj = {
    "type": "object",
    "description": "ObjectMeta is metadata that all persisted resources must have, which "
                   "includes all objects users must create.",
    "properties": {
        "name": {"type": "string", "description": "Name must be unique within a namespace."},
        "generateName": {"type": "string", "description": "A prefix the server completes "
                         "to a unique name, used when name is not provided."},
        "namespace": {"type": "string", "description": "The namespace the object is in; "
                      "empty for cluster-scoped objects."},
        "labels": {"type": "object", "additionalProperties": {"type": "string"},
                   "description": "Keys and values to organize and select objects by."},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"},
                        "description": "Keys and values for tools and libraries to store "
                                       "non-identifying data in."},
        "finalizers": {"type": "array", "items": {"type": "string"},
                       "description": "What must be done before the object is removed."},
        "ownerReferences": {"type": "array", "items": {"type": "object"},
                            "description": "The objects this one depends on: it is garbage "
                                           "collected once all of them are gone."},
        "uid": {"type": "string", "description": "Unique in time and space; set by the server."},
        "resourceVersion": {"type": "string", "description": "The version of the object, for "
                            "optimistic concurrency and watches; set by the server."},
        "generation": {"type": "integer", "format": "int64",
                       "description": "A sequence number of changes to the desired state."},
        "creationTimestamp": {"type": "string", "format": "date-time",
                              "description": "When the object was created; set by the server."},
        "deletionTimestamp": {"type": "string", "format": "date-time",
                              "description": "When the object will be deleted; set by the "
                                             "server when a deletion is requested."},
    },
}


def answer(path: str, catalog: Catalog) -> Obj:
    """What ``GET /openapi/v3/{path}`` answers: the index, or one group-version's document."""
    documents = _documents(catalog)
    path = path.strip("/")
    if not path:
        return {"paths": {gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash="
                               + hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]}
                          for gv, doc in documents.items()}}
    if path not in documents:
        raise api_error(404, "NotFound", "the server could not find the requested resource")
    return documents[path]


def _documents(catalog: Catalog) -> dict[str, Obj]:
    paths: dict[str, Obj] = {}
    query = [{"name": name, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
             for name in ("dryRun", "fieldManager", "fieldValidation", "force")]
    for key, info in sorted(catalog.discovery.items(), key=lambda item: str(item[0])):
        group, version, plural = key.group or "", key.version or "", key.plural or ""
        scope = "namespaces/{namespace}/" if info.namespaced else ""
        gv = _group_version(group, version)
        paths.setdefault(gv, {})[f"/{gv}/{scope}{plural}/{{name}}"] = {"patch": {
            "operationId": f"patch{info.kind}", "parameters": query,
            "responses": {"200": {"description": "OK"}},
            "x-kubernetes-action": "patch",
            "x-kubernetes-group-version-kind": {"group": group, "version": version,
                                                "kind": info.kind},
        }}
    schemas: dict[str, Obj] = {}
    for resource, schema in catalog.custom():
        gv = _group_version(resource.group, resource.version)
        schemas.setdefault(gv, {OBJECT_META: _OBJECT_META})[_schema_name(resource)] = (
            _published(resource, schema))
    return {gv: {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": KUBE_VERSION},
                 "paths": gv_paths, "components": {"schemas": schemas.get(gv, {})}}
            for gv, gv_paths in paths.items()}


def _group_version(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def _schema_name(resource: Resource) -> str:
    """``dev.tidal.v1alpha1.ElasticTrainingJob``: the group reversed, as a real server names it."""
    return ".".join([*reversed(resource.group.split(".")), resource.version, resource.kind])


def _published(resource: Resource, schema: Obj) -> Obj:
    """A CRD's schema as a real server publishes it: tagged with its group, version and kind,
    ``metadata`` referring to ObjectMeta."""
    published = copy.deepcopy(schema)
    published["x-kubernetes-group-version-kind"] = [
        {"group": resource.group, "version": resource.version, "kind": resource.kind}]
    if published.get("type") == "object":
        published.setdefault("properties", {})["metadata"] = {
            "allOf": [{"$ref": f"#/components/schemas/{OBJECT_META}"}],
            "description": _METADATA_DESCRIPTION}
    return published
