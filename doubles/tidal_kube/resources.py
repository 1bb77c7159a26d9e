"""What the emulator serves: a resource's descriptor, the catalog of built-in and custom resources
(with kmock's discovery data and the CRDs' schemas), and the errors and timestamps of the API."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import gzip
import importlib.resources
from collections.abc import Iterator
from typing import Any

import kmock

Obj = dict[str, Any]
Key = tuple[str, str, str | None, str]  # group, plural, namespace, name

KUBE_VERSION = "v1.33.0"  # the API version emulated, as /version reports it

# The built-in resources served, with their discovery information from kmock's bundled copy of
# a real cluster's discovery (kind, short names, verbs, subresources).
BUILTIN_RESOURCES: dict[str, tuple[str, ...]] = {
    "v1": ("namespaces", "nodes", "pods", "services", "events", "configmaps",
           "serviceaccounts", "secrets", "endpoints", "persistentvolumeclaims"),
    "apps/v1": ("deployments", "statefulsets", "replicasets", "daemonsets"),
    "batch/v1": ("jobs",),
    "events.k8s.io/v1": ("events",),
    "coordination.k8s.io/v1": ("leases",),
    "scheduling.k8s.io/v1": ("priorityclasses",),
    "apiextensions.k8s.io/v1": ("customresourcedefinitions",),
    "rbac.authorization.k8s.io/v1": ("roles", "rolebindings", "clusterroles",
                                     "clusterrolebindings"),
    "policy/v1": ("poddisruptionbudgets",),
}
CRD_KEY = ("apiextensions.k8s.io", "customresourcedefinitions")
_CR_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@functools.cache
def _builtin_resources() -> dict[kmock.resource, kmock.ResourceInfo]:
    """BUILTIN_RESOURCES' discovery information, served subresources only."""
    bundle = importlib.resources.files("kmock._internal").joinpath("resources.json.gz").read_bytes()
    bundled = kmock.ResourcesArray()
    bundled.load_data(gzip.decompress(bundle))
    found = {}
    for group_version, plurals in BUILTIN_RESOURCES.items():
        for plural in plurals:
            key = kmock.resource(group_version, plural)
            info = bundled[key]
            info.subresources &= {"status", "binding"} if plural == "pods" else {"status"}
            found[key] = info
    return found


def now_rfc3339() -> str:
    """The API server's timestamp format: UTC, whole seconds."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def api_error(code: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    """An error the client sees as a ``Status`` object, as a real API server sends it."""
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details or {})


@dataclasses.dataclass(frozen=True, slots=True)
class Resource:
    """A served resource (group, version, plural) with its discovery information."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: frozenset[str]
    custom: bool  # registered by a CustomResourceDefinition

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """``pods`` or ``elastictrainingjobs.tidal.dev``, as error messages name resources."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def key(self, namespace: str | None, name: str) -> Key:
        return (self.group, self.plural, namespace if self.namespaced else None, name)

    def is_(self, group: str, plural: str) -> bool:
        return (self.group, self.plural) == (group, plural)

    def output(self, obj: Obj, with_kind: bool = True) -> Obj:
        """A copy of a stored object as a client gets it."""
        body = {k: copy.deepcopy(v) for k, v in obj.items() if k not in ("apiVersion", "kind")}
        if not with_kind:  # lists of built-in kinds leave both to the list, as a real server does
            return body
        return {"apiVersion": self.api_version, "kind": self.kind, **body}

    def invalid(self, name: str, errors: list[str]) -> kmock.KubernetesError:
        """The 422 of a write that admission or validation refuses."""
        group = self.group or "core"
        return api_error(422, "Invalid", f'{self.kind}.{group} "{name}" is invalid: '
                         + "; ".join(errors), name=name, group=self.group, kind=self.kind,
                         causes=[{"message": error} for error in errors])


class Catalog:
    """The resources served: the built-in ones, and those CustomResourceDefinitions register,
    with their structural schemas. ``discovery`` is kmock's array, which it serves as the API
    discovery; the catalog keeps it current."""

    def __init__(self, discovery: kmock.ResourcesArray) -> None:
        self.discovery = discovery
        self._schemas: dict[tuple[str, str, str], Obj] = {}
        for key, info in _builtin_resources().items():
            discovery[key] = copy.deepcopy(info)

    def resource(self, key: kmock.resource) -> Resource:
        """The served resource at ``key``; a 404 if none."""
        if key not in self.discovery:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        info = self.discovery[key]
        return Resource(
            group=key.group or "", version=key.version or "", plural=key.plural or "",
            kind=info.kind or "", namespaced=bool(info.namespaced),
            subresources=frozenset(info.subresources),
            custom=(key.group or "", key.version or "", key.plural or "") in self._schemas,
        )

    def resource_for(self, api_version: str, kind: str) -> Resource:
        """The resource that serves ``kind`` in ``api_version``."""
        group, _, version = api_version.rpartition("/")
        for key, info in self.discovery.items():
            if (key.group, key.version, info.kind) == (group, version, kind):
                return self.resource(key)
        raise api_error(404, "NotFound", f"no matches for kind {kind!r} in version {api_version!r}")

    def resource_of(self, key: Key, obj: Obj) -> Resource:
        """The resource of a stored object, in the version it was stored with."""
        group, plural, _, _ = key
        return self.resource(kmock.resource(group, obj["apiVersion"].rpartition("/")[2], plural))

    def schema(self, resource: Resource) -> Obj:
        """A custom resource's structural schema."""
        return self._schemas[(resource.group, resource.version, resource.plural)]

    def custom(self) -> Iterator[tuple[Resource, Obj]]:
        """The custom resources served, with their schemas."""
        for group, version, plural in list(self._schemas):
            resource = self.resource(kmock.resource(group, version, plural))
            yield resource, self._schemas[(group, version, plural)]

    def register(self, crd: Obj) -> None:
        """Serve the versions a CRD serves."""
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            key = kmock.resource(spec["group"], version["name"], names["plural"])
            self.discovery[key] = kmock.ResourceInfo(
                kind=names["kind"], singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced", verbs=_CR_VERBS,
                shortnames=names.get("shortNames", ()), categories=names.get("categories", ()),
                subresources=set(version.get("subresources") or {}),
            )
            schema = (version.get("schema") or {}).get("openAPIV3Schema") or {
                "type": "object", "x-kubernetes-preserve-unknown-fields": True}
            self._schemas[(spec["group"], version["name"], names["plural"])] = schema

    def unregister(self, crd: Obj) -> None:
        """Forget a CRD's resources (its objects are the caller's to drop or keep)."""
        spec = crd["spec"]
        plural = spec["names"]["plural"]
        for key in [k for k in self.discovery if (k.group, k.plural) == (spec["group"], plural)]:
            self._schemas.pop((spec["group"], key.version or "", plural), None)
            del self.discovery[key]


def orphaned_resource(obj: Obj, crd_spec: Obj) -> Resource:
    """A custom resource's descriptor after its CRD is gone, to record its deletion."""
    group, _, version = obj["apiVersion"].rpartition("/")
    return Resource(group=group, version=version, plural=crd_spec["names"]["plural"],
                    kind=obj["kind"], namespaced=crd_spec.get("scope") == "Namespaced",
                    subresources=frozenset(), custom=True)
