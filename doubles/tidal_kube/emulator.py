"""A Kubernetes API server in one process: for the operator's tests and the one-machine cluster.

kmock's ``KubernetesScaffold`` gives the HTTP plumbing, API discovery, ``Status`` errors and its
request DSL, so a test can still inject faults (``emulator["patch", kmock.resource("v1/pods")]
<< 500``). The state and its semantics are ours, because that is where a mock hides the bugs a
real API server catches:

- every write stamps ``uid``, ``resourceVersion`` (one cluster-wide counter), ``creationTimestamp``
  and ``generation`` (bumped when anything but metadata and status changes); a no-op write
  changes nothing, not even the resourceVersion; a stale ``resourceVersion`` is a 409;
- the status subresource: writes to ``/status`` change only ``status``, writes to the object
  leave its ``status`` alone, and a create drops it;
- patches: JSON merge patch (RFC 7386), JSON patch (RFC 6902, its ``test`` op fails with 422 as
  kopf expects), strategic merge patch for built-in kinds (lists merged by their usual keys; a
  custom resource answers 415, as a real server does) and server-side apply as create-or-merge;
- label and field selectors on list, watch and delete-collection; lists carry a
  resourceVersion; a watch resumes after a resourceVersion (410 once it left the history), ends
  after ``timeoutSeconds``, turns an object leaving its selector into DELETED, and honours
  ``sendInitialEvents``;
- deletion: finalizers; a pod bound to a node terminates gracefully (a deletionTimestamp
  and a grace period, until the kubelet removes it); a namespace takes its contents along;
  background garbage collection of ``ownerReferences`` (an object whose owners are all gone,
  or never existed in its namespace, is deleted);
- CustomResourceDefinitions register their resources, and custom resources are pruned,
  defaulted and validated with the CRD's schema and CEL rules (:mod:`tidal_kube.structural`);
- admission as in a default cluster: names and labels are validated; namespaces must exist and
  get a ``default`` ServiceAccount; a pod needs its ServiceAccount and PriorityClass (and gets
  ``spec.priority`` from it), requests default to limits, extended resources (GPUs) need
  requests equal to limits, its spec is immutable, and it is bound to a node only through the
  ``pods/binding`` subresource; a Service gets a cluster IP;
- what kubectl and helm need: ``meta.k8s.io`` Tables (a CRD's printer columns, the usual
  columns of a few built-in kinds) for lists, objects and watches, an OpenAPI v3 index whose
  PATCH operations take ``fieldValidation`` (so clients leave validation to the server), and
  protobuf bodies for the kinds typed clients send so (Secrets, ConfigMaps, Namespaces,
  ServiceAccounts).

Not emulated: authentication and RBAC (every request is allowed; a kubeconfig's token shows in
the recorded requests), OpenAPI schemas and strict field validation (unknown fields of a custom
resource are pruned, not refused), protobuf for other kinds (415), the core and events.k8s.io
views of one Event (they are two separate stores), field management of server-side apply,
conversion between versions of a custom resource (objects are shared, apiVersion rewritten),
and the controllers of a cluster (see :mod:`tidal_kube.localcluster` for a scheduler and a
kubelet).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import concurrent.futures
import copy
import dataclasses
import datetime
import functools
import gzip
import hashlib
import importlib.resources
import ipaddress
import itertools
import json
import random
import re
import signal
import sys
import threading
import traceback
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import parsing, rendering

from tidal_kube import structural

Obj = dict[str, Any]
_Key = tuple[str, str, str | None, str]  # group, plural, namespace, name

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
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
SYSTEM_PRIORITY_CLASSES = {"system-cluster-critical": 2_000_000_000,
                           "system-node-critical": 2_000_001_000}
SERVICE_CIDR = ipaddress.ip_network("10.96.0.0/12")
KUBE_VERSION = "v1.33.0"  # the API version emulated, as /version reports it
_CR_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"
PROTOBUF = "application/vnd.kubernetes.protobuf"


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

    def key(self, namespace: str | None, name: str) -> _Key:
        return (self.group, self.plural, namespace if self.namespaced else None, name)

    def is_(self, group: str, plural: str) -> bool:
        return (self.group, self.plural) == (group, plural)


@dataclasses.dataclass(frozen=True, slots=True)
class _Change:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj  # the state after the change (the last state for DELETED)
    old: Obj | None  # the state before (None for ADDED)


# ------------------------------------------------------------------------------------------------
# Selectors


def label_selector(text: str | None) -> Callable[[Mapping[str, str]], bool]:
    """Parse a label selector: ``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``, ``a in (x,y)``,
    ``a notin (x,y)``, comma-separated; raises a 400 for anything else."""
    checks: list[Callable[[Mapping[str, str]], bool]] = []
    for part in re.findall(r"(?:[^,(]|\([^)]*\))+", text or ""):
        part = part.strip()
        if match := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", part):
            key, op, values = match[1], match[2], {v.strip() for v in match[3].split(",")}
            if op == "in":
                checks.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                checks.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif match := re.fullmatch(r"([\w./-]+)\s*(==|=|!=)\s*([\w.-]*)", part):
            key, op, value = match[1], match[2], match[3]
            if op == "!=":
                checks.append(lambda labels, k=key, v=value: labels.get(k) != v)
            else:
                checks.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif match := re.fullmatch(r"(!?)\s*([\w./-]+)", part):
            negate, key = match[1] == "!", match[2]
            checks.append(lambda labels, k=key, n=negate: (k in labels) != n)
        else:
            raise api_error(400, "BadRequest", f"unable to parse requirement: {part!r}")
    return lambda labels: all(check(labels) for check in checks)


# The fields each kind can be selected by (as in a real API server); others are a 400.
_SELECTABLE_FIELDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("", "pods"): ("spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
                   "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP",
                   "status.nominatedNodeName"),
    ("", "events"): ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                     "involvedObject.uid", "involvedObject.apiVersion",
                     "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
                     "reportingComponent", "source", "type"),
    ("", "nodes"): ("spec.unschedulable",),
    ("", "namespaces"): ("status.phase",),
    ("", "secrets"): ("type",),
}


def _field_equals(path: list[str], value: str, equal: bool, obj: Obj) -> bool:
    current: Any = obj
    for step in path:
        current = current.get(step) if isinstance(current, dict) else None
    if isinstance(current, bool):
        current = json.dumps(current)  # "true", as a real server writes booleans
    text = "" if current is None else str(current)
    return (text == value) == equal


def field_selector(resource: Resource, text: str | None) -> Callable[[Obj], bool]:
    """Parse a field selector (``f=v``, ``f==v``, ``f!=v``, comma-separated) over the fields the
    kind supports; an absent field reads as the empty string (``spec.nodeName=`` finds pods
    that are not bound)."""
    allowed = ("metadata.name", "metadata.namespace",
               *_SELECTABLE_FIELDS.get((resource.group, resource.plural), ()))
    checks: list[Callable[[Obj], bool]] = []
    for part in filter(None, (text or "").split(",")):
        match = re.fullmatch(r"\s*([\w.]+)\s*(==|=|!=)\s*(.*?)\s*", part)
        if match is None:
            raise api_error(400, "BadRequest", f"invalid field selector: {part!r}")
        field, op, value = match[1], match[2], match[3]
        if field not in allowed:
            raise api_error(400, "BadRequest", f'field label not supported: {field}')

        checks.append(functools.partial(_field_equals, field.split("."), value, op != "!="))
    return lambda obj: all(check(obj) for check in checks)


# ------------------------------------------------------------------------------------------------
# Patches


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, null deletes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# Lists of built-in kinds that a strategic merge patch merges by a key instead of replacing.
_MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "containerStatuses": "name", "env": "name", "volumes": "name", "volumeMounts": "mountPath",
    "conditions": "type", "imagePullSecrets": "name", "ownerReferences": "uid",
    "hostAliases": "ip", "addresses": "type", "topologySpreadConstraints": "topologyKey",
}
_MERGED_PRIMITIVE_LISTS = {"finalizers"}


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A strategic merge patch for built-in kinds, approximately: the lists above merge by key
    (``$patch: delete`` removes an element), ``finalizers`` merges as a set, other lists replace."""
    if not isinstance(patch, dict) or not isinstance(target, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(target)
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [v for v in result.get(field, []) if v not in value]
        elif key.startswith("$"):
            continue  # $setElementOrder/... and other directives: order is not emulated
        elif value is None:
            result.pop(key, None)
        elif isinstance(value, list) and key in _MERGED_PRIMITIVE_LISTS:
            result[key] = list(dict.fromkeys([*result.get(key, []), *value]))
        elif isinstance(value, list) and isinstance(result.get(key), list) and (
            merge_key := _list_merge_key(key, value)
        ):
            result[key] = _merge_list(result[key], value, merge_key)
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    return result


def _list_merge_key(field: str, items: list[Any]) -> str | None:
    if field == "ports":  # containers' ports merge by containerPort, a Service's by port
        container = any(isinstance(item, dict) and "containerPort" in item for item in items)
        return "containerPort" if container else "port"
    return _MERGE_KEYS.get(field)


def _merge_list(current: list[Any], patch: list[Any], key: str) -> list[Any]:
    result = list(current)
    for item in patch:
        if not isinstance(item, dict):
            return copy.deepcopy(patch)
        index = next((i for i, old in enumerate(result)
                      if isinstance(old, dict) and old.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append({k: v for k, v in item.items() if k != "$patch"})
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result


# ------------------------------------------------------------------------------------------------
# Protobuf bodies: client-go's typed clients send built-in kinds in Kubernetes' protobuf
# encoding (helm stores its releases as Secrets so; ``kubectl create secret|configmap|namespace|
# serviceaccount`` too). Those kinds are decoded; others are refused with 415.

# Per kind: the fields of its protobuf message after metadata (1), as (number, name, decoder);
# a field not listed here, if not empty, is refused rather than dropped.
_b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
_PROTOBUF_FIELDS: dict[str, tuple[tuple[int, str, Callable[[Any], Any]], ...]] = {
    "secrets": ((2, "data", lambda v: _proto_map(v, _b64)),
                (3, "type", lambda v: v[0].decode()),
                (4, "stringData", lambda v: _proto_map(v, bytes.decode)),
                (5, "immutable", lambda v: bool(v[0]))),
    "configmaps": ((2, "data", lambda v: _proto_map(v, bytes.decode)),
                   (3, "binaryData", lambda v: _proto_map(v, _b64)),
                   (4, "immutable", lambda v: bool(v[0]))),
    "namespaces": ((2, "spec", lambda v: {"finalizers": [
                        f.decode() for f in _proto_message(v[0])[1]]}),
                   (3, "status", lambda v: {})),  # the server's to set
    "serviceaccounts": ((3, "imagePullSecrets", lambda v: [
                             {"name": _proto_message(ref)[1][0].decode()} for ref in v]),
                        (4, "automountServiceAccountToken", lambda v: bool(v[0]))),
}


def _proto_message(data: bytes) -> dict[int, list[Any]]:
    """A protobuf message's fields by number: varints as ints, length-delimited as bytes."""
    fields: dict[int, list[Any]] = collections.defaultdict(list)
    pos = 0

    def varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return result

    while pos < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields[number].append(varint())
        elif wire in (1, 2, 5):
            size = {1: 8, 5: 4}.get(wire) or varint()
            fields[number].append(data[pos:pos + size])
            pos += size
        else:
            raise ValueError(f"protobuf wire type {wire} is not supported")
    return fields


def _proto_map(entries: list[bytes], value: Callable[[bytes], Any]) -> dict[str, Any]:
    """A protobuf map<string, ...>: entries with the key in field 1 and the value in 2."""
    out = {}
    for entry in entries:
        fields = _proto_message(entry)
        out[(fields[1] or [b""])[0].decode()] = value((fields[2] or [b""])[0])
    return out


def _proto_metadata(data: bytes) -> Obj:
    """ObjectMeta: what a client sets (the server owns the rest)."""
    fields = _proto_message(data)
    meta: Obj = {name: fields[number][0].decode() for number, name in (
        (1, "name"), (2, "generateName"), (3, "namespace"), (5, "uid"), (6, "resourceVersion"))
        if fields[number] and fields[number][0]}  # protobuf writes empty strings too
    for number, name in ((11, "labels"), (12, "annotations")):
        if fields[number]:
            meta[name] = _proto_map(fields[number], bytes.decode)
    if fields[14]:
        meta["finalizers"] = [f.decode() for f in fields[14]]
    owners = []
    for ref in map(_proto_message, fields[13]):
        owner = {name: ref[number][0].decode() for number, name in (
            (1, "kind"), (3, "name"), (4, "uid"), (5, "apiVersion")) if ref[number]}
        owner |= {name: bool(ref[number][0]) for number, name in (
            (6, "controller"), (7, "blockOwnerDeletion")) if ref[number]}
        owners.append(owner)
    if owners:
        meta["ownerReferences"] = owners
    return meta


def _from_protobuf(resource: Resource, body: bytes) -> Obj:
    """An object of the kinds above from its protobuf encoding: the magic ``k8s`` and a zero
    byte, then a runtime.Unknown whose field 2 is the object's message."""
    known = _PROTOBUF_FIELDS.get(resource.plural) if not resource.group else None
    if known is None:
        raise api_error(415, "UnsupportedMediaType", f"the emulator reads {resource.qualified} "
                        "as JSON only, not protobuf")
    try:
        if not body.startswith(b"k8s\x00"):
            raise ValueError("no k8s protobuf envelope")
        obj = _proto_message((_proto_message(body[4:])[2] or [b""])[0])
        out: Obj = {"apiVersion": "v1", "kind": resource.kind,
                    "metadata": _proto_metadata((obj.pop(1, None) or [b""])[0])}
        for number, name, decode in known:
            if values := obj.pop(number, None):
                out[name] = decode(values)
    except (ValueError, IndexError) as exc:
        raise api_error(400, "BadRequest", f"the protobuf body could not be decoded: {exc}") \
            from None
    if any(value not in (b"", 0) for values in obj.values() for value in values):
        raise api_error(415, "UnsupportedMediaType", f"the emulator decodes only some fields of "
                        f"{resource.qualified} from protobuf: send JSON")
    return out

# ------------------------------------------------------------------------------------------------
# Validation of names, labels and metadata (the messages follow the API server's)

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*"
_DNS_1035 = r"[a-z]([-a-z0-9]*[a-z0-9])?"
_LABEL_VALUE = r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
_GENERATED = "bcdfghjklmnpqrstvwxz2456789"


def _name_errors(resource: Resource, name: str) -> list[str]:
    if resource.plural == "services":
        ok = len(name) <= 63 and re.fullmatch(_DNS_1035, name)
        rule = "a DNS-1035 label (lowercase letters, digits and '-', from a letter, at most 63)"
    elif resource.plural == "namespaces":
        ok = len(name) <= 63 and re.fullmatch(_DNS_LABEL, name)
        rule = "a DNS-1123 label (lowercase letters, digits and '-', at most 63)"
    elif resource.group == "rbac.authorization.k8s.io":
        ok = name not in (".", "..") and not re.search(r"[/%]", name)
        rule = "a path segment name (no '/' or '%')"
    else:
        ok = len(name) <= 253 and re.fullmatch(_DNS_SUBDOMAIN, name)
        rule = "a DNS-1123 subdomain (lowercase letters, digits, '-' and '.', at most 253)"
    return [] if ok else [f"metadata.name: Invalid value: {name!r}: must be {rule}"]


def _key_errors(where: str, key: Any) -> list[str]:
    if not isinstance(key, str):
        return [f"{where}: Invalid value: {key!r}: keys must be strings"]
    prefix, _, name = key.rpartition("/")
    ok = (not prefix or (len(prefix) <= 253 and re.fullmatch(_DNS_SUBDOMAIN, prefix))) and (
        0 < len(name) <= 63 and re.fullmatch(_LABEL_VALUE, name)
    )
    if ok:
        return []
    return [f"{where}: Invalid value: {key!r}: name part must consist of alphanumeric characters, "
            "'-', '_' or '.', at most 63, with an optional DNS subdomain prefix"]


def _metadata_errors(resource: Resource, meta: Obj) -> list[str]:
    errors = _name_errors(resource, meta["name"])
    for key, value in (meta.get("labels") or {}).items():
        errors += _key_errors("metadata.labels", key)
        if not isinstance(value, str) or len(value) > 63 or not re.fullmatch(_LABEL_VALUE, value):
            errors.append(f"metadata.labels: Invalid value: {value!r}: a label value must be a "
                          "string of at most 63 alphanumeric characters, '-', '_' or '.', "
                          "starting and ending with an alphanumeric character")
    for key, value in (meta.get("annotations") or {}).items():
        errors += _key_errors("metadata.annotations", key)
        if not isinstance(value, str):
            errors.append(f"metadata.annotations: Invalid value: {value!r}: must be a string")
    refs = meta.get("ownerReferences") or []
    for index, ref in enumerate(refs):
        for field in ("apiVersion", "kind", "name", "uid"):
            if not (isinstance(ref, dict) and ref.get(field)):
                errors.append(f"metadata.ownerReferences[{index}].{field}: Required value")
    if sum(bool(isinstance(ref, dict) and ref.get("controller")) for ref in refs) > 1:
        errors.append("metadata.ownerReferences: Invalid value: "
                      "only one reference can have Controller set to true")
    return errors


def _quantity(value: Any) -> float:
    """A resource quantity as a number: ``2``, ``"500m"``, ``"1Gi"``."""
    text = str(value)
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20,
                "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", text)
    if match is None or (match[2] and match[2] not in suffixes):
        raise ValueError(f"quantities must match the regular expression: {text!r}")
    return float(match[1]) * suffixes.get(match[2], 1)


def _is_extended_resource(name: str) -> bool:
    native = name.startswith(("kubernetes.io/", "requests.")) or "hugepages" in name
    return "/" in name and not native


# ------------------------------------------------------------------------------------------------
# The emulator


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesScaffold):
    """The API server: state, semantics and admission; serve it with :func:`serve` or
    :class:`EmulatorThread`.

    Its methods ``create``, ``get`` and ``list`` are for code on the emulator's event loop
    (tests, the local cluster); clients elsewhere use HTTP. ``gc_delay`` is how long the
    background garbage collector waits after an owner is deleted; ``history`` is how many
    changes per resource a watch can resume from.
    """

    gc_delay: float = 0.0
    history: int = 10_000
    failures: list[BaseException] = attrs.field(factory=list, init=False)

    _objects: dict[_Key, Obj] = attrs.field(factory=dict, init=False)
    _uids: dict[str, _Key] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _changes: dict[tuple[str, str], collections.deque[_Change]] = attrs.field(
        factory=dict, init=False)
    _compacted: dict[tuple[str, str], int] = attrs.field(factory=dict, init=False)
    _changed: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    _schemas: dict[tuple[str, str, str], Obj] = attrs.field(factory=dict, init=False)
    _gc_handle: asyncio.TimerHandle | asyncio.Handle | None = attrs.field(default=None, init=False)
    _ips: Iterator[ipaddress.IPv4Address | ipaddress.IPv6Address] = attrs.field(
        factory=lambda: itertools.islice(SERVICE_CIDR.hosts(), 10, None), init=False
    )

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, info in _builtin_resources().items():
            self.resources[key] = copy.deepcopy(info)
        self.fallback[self._is_object_request] << self._serve
        self.fallback["get", re.compile(r"/openapi/v3(/.+)?")] << self._serve_openapi
        for name in INITIAL_NAMESPACES:
            self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        for name, value in SYSTEM_PRIORITY_CLASSES.items():
            self.create({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                         "metadata": {"name": name}, "value": value})

    # -- in-process access (on the emulator's loop) ---------------------------------------------

    def create(self, obj: Obj) -> Obj:
        """Create an object given as a manifest (apiVersion and kind pick the resource)."""
        resource = self.resource_for(obj.get("apiVersion", ""), obj.get("kind", ""))
        return self._create(resource, obj.get("metadata", {}).get("namespace"), obj)

    def get(self, resource: str, namespace: str | None, name: str) -> Obj | None:
        """The stored object, e.g. ``get("v1/pods", "default", "w-0")``, or None."""
        found = self._resource(kmock.resource(resource))
        obj = self._objects.get(found.key(namespace, name))
        return self._output(found, obj) if obj is not None else None

    def list(self, resource: str, namespace: str | None = None,
             labels: str | None = None) -> list[Obj]:
        """The stored objects of a resource, sorted by namespace and name."""
        found = self._resource(kmock.resource(resource))
        match = self._matcher(found, namespace, None, {"labelSelector": labels or ""})
        return [self._output(found, obj, with_kind=True) for obj in self._select(found, match)]

    def resource_for(self, api_version: str, kind: str) -> Resource:
        """The resource that serves ``kind`` in ``api_version``."""
        group, _, version = api_version.rpartition("/")
        for key, info in self.resources.items():
            if (key.group, key.version, info.kind) == (group, version, kind):
                return self._resource(key)
        raise api_error(404, "NotFound", f"no matches for kind {kind!r} in version {api_version!r}")

    @property
    def resource_version(self) -> int:
        return self._rv

    # -- HTTP -----------------------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """The API server's answer, with the bare ``application/json`` content type it sends:
        clients (lightkube) parse a Status only from that exact type."""
        response = await self._answer(raw_request)
        if not response.prepared and response.content_type == "application/json":
            response.charset = None
        return response

    async def _answer(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """kmock's entry point with a path parser that knows ``/api/v1/namespaces/{name}``; an
        API error (404, 409, 422...) is an answer, not an error of the emulator."""
        await raw_request.read()
        try:
            request = await _parse_request(raw_request, len(self._requests))
            self._requests.append(request)
            if len(self._requests) > 2 * self.history:  # a long-lived server keeps the recent
                del self._requests[: self.history]
            return await self._handle(request)
        except rendering.StreamingError as exc:  # a watch has started: end it with an ERROR
            raw_response = exc.args[0]
            self._record(exc.__cause__ or exc)
            await self._stream_error(exc.__cause__ or exc, raw_response)
            await raw_response.write_eof()
            return raw_response
        except kmock.KubernetesError as exc:
            return await self._render_error(exc)
        except Exception as exc:
            self._record(exc)
            return await self._render_error(exc)

    def _record(self, exc: BaseException) -> None:
        """A failure of the emulator itself (not an API error): kept for tests in ``failures``."""
        traceback.print_exception(exc)
        self.failures.append(exc)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if not isinstance(exc, kmock.KubernetesError):
            exc = api_error(500, "InternalError", f"emulator failure: {exc!r}")
        return aiohttp.web.json_response({
            "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
            "code": exc.status, "reason": exc.reason, "message": exc.message,
            "details": exc.details,
        }, status=exc.status)

    @staticmethod
    def _is_object_request(request: kmock.Request) -> bool:
        return request.resource is not None and request.resource.plural is not None

    async def _serve(self, request: kmock.Request) -> kmock.Response:
        """Every request to an object or a collection: dispatch by method and path."""
        assert request.resource is not None
        resource = self._resource(request.resource)
        ns, name, sub, params = request.namespace, request.name, request.subresource, request.params
        method = request.method.value
        if ns is not None and not resource.namespaced:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        table = _wants_table(request)
        if method == "GET" and params.get("watch") in ("true", "1"):
            events = self._watch(resource, ns, name, params)
            if table:
                events = self._table_events(resource, events, params)
            # kubectl reads a watch only with the content type a real server sends
            return kmock.Response(status=200, payload=events,
                                  headers={"Content-Type": "application/json"})
        if sub not in (None, "status") and not (resource.is_("", "pods") and sub == "binding"):
            raise api_error(404, "NotFound", f"the server could not find the requested resource "
                            f"({sub})")
        if sub == "status" and "status" not in resource.subresources:
            raise api_error(404, "NotFound", f"{resource.qualified} have no status subresource")
        dry = params.get("dryRun") == "All"
        protobuf = request.headers.get("Content-Type", "").startswith(PROTOBUF)
        body = _from_protobuf(resource, request.body) if protobuf else _body(request)
        status, payload = 200, None
        if method == "GET":
            payload = (self._list(resource, ns, params) if name is None
                       else self._output(resource, self._current(resource, ns, name)))
            if table:
                payload = self._table(resource, payload, params)
        elif method == "POST" and name is None:
            if resource.namespaced and ns is None:
                raise api_error(405, "MethodNotAllowed", "create namespaced objects in a namespace")
            status, payload = 201, self._create(resource, ns, _object(body), dry=dry)
        elif method == "POST" and sub == "binding":
            status, payload = 201, self._bind(resource, ns, name, _object(body))
        elif method == "PUT" and name is not None:
            payload = self._replace(resource, ns, name, _object(body), sub, dry)
        elif method == "PATCH" and name is not None:
            content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
            status, payload = self._patch(resource, ns, name, body, content_type, sub, params, dry)
        elif method == "DELETE":
            options = {**(body if isinstance(body, dict) else {}), **params}
            payload = (self._delete_collection(resource, ns, params, options, dry) if name is None
                       else self._delete(resource, ns, name, options, dry))
        else:
            raise api_error(405, "MethodNotAllowed", f"{method} is not supported here")
        # Always with a status: kmock keeps the last one given on the reaction for the next answer.
        return kmock.Response(status=status, payload=payload)

    def _resource(self, key: kmock.resource) -> Resource:
        if key not in self.resources:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        info = self.resources[key]
        return Resource(
            group=key.group or "", version=key.version or "", plural=key.plural or "",
            kind=info.kind or "", namespaced=bool(info.namespaced),
            subresources=frozenset(info.subresources),
            custom=(key.group or "", key.version or "", key.plural or "") in self._schemas,
        )

    def _output(self, resource: Resource, obj: Obj, with_kind: bool = True) -> Obj:
        body = {k: copy.deepcopy(v) for k, v in obj.items() if k not in ("apiVersion", "kind")}
        if not with_kind:  # lists of built-in kinds leave both to the list, as a real server does
            return body
        return {"apiVersion": resource.api_version, "kind": resource.kind, **body}

    def _current(self, resource: Resource, ns: str | None, name: str) -> Obj:
        obj = self._objects.get(resource.key(ns, name))
        if obj is None:
            raise api_error(404, "NotFound", f'{resource.qualified} "{name}" not found',
                            name=name, group=resource.group, kind=resource.plural)
        return obj

    async def _serve_version(self, request: kmock.Request) -> kmock.Payload:
        """``/api/v1``, ``/apis/{group}/{version}``: the resources and the subresources served."""
        assert request.resource is not None
        group, version = request.resource.group or "", request.resource.version or ""
        entries = []
        for key, info in self.resources.items():
            if (key.group, key.version) != (group, version):
                continue
            entries.append({
                "name": key.plural, "singularName": info.singular or key.plural, "kind": info.kind,
                "namespaced": bool(info.namespaced), "verbs": sorted(info.verbs),
                "shortNames": sorted(info.shortnames), "categories": sorted(info.categories),
            })
            for sub in sorted(info.subresources):
                binding = sub == "binding"
                entries.append({
                    "name": f"{key.plural}/{sub}", "singularName": "",
                    "namespaced": bool(info.namespaced),
                    "kind": "Binding" if binding else info.kind,
                    "verbs": ["create"] if binding else ["get", "patch", "update"],
                })
        if not entries and group:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        return {"apiVersion": "v1", "kind": "APIResourceList",
                "groupVersion": f"{group}/{version}" if group else version, "resources": entries}

    # -- reading --------------------------------------------------------------------------------

    def _matcher(self, resource: Resource, ns: str | None, name: str | None,
                 params: Mapping[str, str]) -> Callable[[Obj], bool]:
        labels = label_selector(params.get("labelSelector"))
        fields = field_selector(resource, params.get("fieldSelector"))

        def match(obj: Obj) -> bool:
            meta = obj["metadata"]
            return ((ns is None or meta.get("namespace") == ns)
                    and (name is None or meta["name"] == name)
                    and labels(meta.get("labels") or {}) and fields(obj))

        return match

    def _select(self, resource: Resource, match: Callable[[Obj], bool]) -> list[Obj]:
        found = [obj for (group, plural, _, _), obj in self._objects.items()
                 if (group, plural) == (resource.group, resource.plural) and match(obj)]
        return sorted(found, key=lambda o: (o["metadata"].get("namespace", ""),
                                            o["metadata"]["name"]))

    def _list(self, resource: Resource, ns: str | None, params: Mapping[str, str]) -> Obj:
        items = self._select(resource, self._matcher(resource, ns, None, params))
        start = int(params.get("continue") or 0)
        limit = int(params.get("limit") or 0)
        end = start + limit if limit > 0 else len(items)
        meta: Obj = {"resourceVersion": str(self._rv)}
        if end < len(items):
            meta["continue"] = str(end)
        return {
            "apiVersion": resource.api_version, "kind": f"{resource.kind}List", "metadata": meta,
            "items": [self._output(resource, obj, with_kind=resource.custom)
                      for obj in items[start:end]],
        }

    def _watch(self, resource: Resource, ns: str | None, name: str | None,
               params: Mapping[str, str]) -> AsyncIterator[Any]:
        """A watch stream; a bad selector is a 400 before the stream starts."""
        match = self._matcher(resource, ns, name, params)
        timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        return self._stream(resource, match, timeout, params)

    async def _stream(self, resource: Resource, match: Callable[[Obj], bool],
                      timeout: float | None, params: Mapping[str, str]) -> AsyncIterator[Any]:
        yield b""  # send the headers now: clients wait for them before reading events
        deadline = asyncio.get_running_loop().time() + timeout if timeout is not None else None
        since = params.get("resourceVersion") or "0"
        position = int(since) if since.isdigit() else 0
        stream = (resource.group, resource.plural)
        if position == 0 or params.get("sendInitialEvents") == "true":
            position = self._rv
            for obj in self._select(resource, match):
                yield {"type": "ADDED", "object": self._output(resource, obj)}
            if params.get("sendInitialEvents") == "true":
                yield {"type": "BOOKMARK", "object": {
                    "apiVersion": resource.api_version, "kind": resource.kind,
                    "metadata": {"resourceVersion": str(position),
                                 "annotations": {"k8s.io/initial-events-end": "true"}}}}
        elif position < self._compacted.get(stream, 0):
            oldest = self._compacted[stream]
            yield _watch_error(410, "Expired", f"too old resource version: {position} ({oldest})")
            return
        while not self._closing:
            waiter = self._changed
            pending = []
            for change in reversed(self._changes.get(stream, ())):
                if change.rv <= position:
                    break
                pending.append(change)
            for change in reversed(pending):
                position = change.rv
                if event := self._event(resource, change, match):
                    yield event
            remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
            if remaining is not None and remaining <= 0:
                return
            try:
                await asyncio.wait_for(waiter.wait(), remaining)
            except TimeoutError:
                return

    def _event(self, resource: Resource, change: _Change,
               match: Callable[[Obj], bool]) -> Obj | None:
        """What a watch with this selector sees of a change: an object that enters the
        selector is ADDED, one that leaves it is DELETED."""
        now = match(change.obj)
        was = change.old is not None and match(change.old)
        if change.type == "MODIFIED":
            kind = "MODIFIED" if now and was else "ADDED" if now else "DELETED" if was else None
        else:
            kind = change.type if now else None
        if kind is None:
            return None
        return {"type": kind, "object": self._output(resource, change.obj)}

    # -- writing --------------------------------------------------------------------------------

    def _commit(self, resource: Resource, key: _Key, kind: str, obj: Obj, old: Obj | None) -> Obj:
        """Store (or, for DELETED, drop) an object with the next resourceVersion; wake watches."""
        self._rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self._rv)
        if kind == "DELETED":
            del self._objects[key]
            self._uids.pop(obj["metadata"]["uid"], None)
        else:
            self._objects[key] = obj
            self._uids[obj["metadata"]["uid"]] = key
        stream = (resource.group, resource.plural)
        changes = self._changes.setdefault(stream, collections.deque())
        changes.append(_Change(self._rv, kind, obj, old))
        if len(changes) > self.history:
            self._compacted[stream] = changes.popleft().rv
        self._changed.set()
        self._changed = asyncio.Event()
        return obj

    def _create(self, resource: Resource, ns: str | None, body: Obj, dry: bool = False) -> Obj:
        obj = copy.deepcopy(body)
        self._check_type(resource, obj)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise self._invalid(resource, "?", ["metadata: Invalid value: must be an object"])
        if resource.namespaced:
            if meta.get("namespace") and ns and meta["namespace"] != ns:
                raise api_error(400, "BadRequest", "the namespace of the provided object does not "
                                "match the namespace sent on the request")
            meta["namespace"] = ns or meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise self._invalid(resource, "", [
                    "metadata.name: Required value: name or generateName is required"])
            meta["name"] = meta["generateName"][:58] + "".join(random.choices(_GENERATED, k=5))
        name = meta["name"]
        if meta.get("resourceVersion"):
            raise api_error(500, "InternalError",
                            "resourceVersion should not be set on objects to be created")
        for field in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds",
                      "generation", "selfLink", "managedFields"):
            meta.pop(field, None)
        errors = _metadata_errors(resource, meta)
        if errors:
            raise self._invalid(resource, name, errors)
        if resource.namespaced:
            self._check_namespace(resource, name, meta["namespace"])
        key = resource.key(meta.get("namespace"), name)
        if key in self._objects:
            raise api_error(409, "AlreadyExists", f'{resource.qualified} "{name}" already exists',
                            name=name, group=resource.group, kind=resource.plural)
        if "status" in resource.subresources and not resource.is_("", "nodes"):
            obj.pop("status", None)  # status is written through its subresource only
        self._admit(resource, obj, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        if dry:
            return self._output(resource, obj)
        stored = self._commit(resource, key, "ADDED", obj, None)
        self._after_create(resource, stored)
        if meta.get("ownerReferences"):
            self._schedule_gc()  # a dangling owner makes the new object garbage at once
        return self._output(resource, stored)

    def _check_namespace(self, resource: Resource, name: str, namespace: str) -> None:
        found = self._objects.get(("", "namespaces", None, namespace))
        if found is None:
            raise api_error(404, "NotFound", f'namespaces "{namespace}" not found',
                            name=namespace, kind="namespaces")
        if found["status"].get("phase") == "Terminating":
            raise api_error(403, "Forbidden", f'{resource.qualified} "{name}" is forbidden: unable '
                            f"to create new content in namespace {namespace} because it is being "
                            "terminated")

    def _replace(self, resource: Resource, ns: str | None, name: str, body: Obj, sub: str | None,
                 dry: bool) -> Obj:
        current = self._current(resource, ns, name)
        self._check_type(resource, body)
        self._check_preconditions(resource, current, body.get("metadata") or {})
        body_name = (body.get("metadata") or {}).get("name")
        if body_name and body_name != name:
            raise api_error(400, "BadRequest", f"the name of the object ({body_name}) does not "
                            f"match the name on the URL ({name})")
        return self._update(resource, current, body, sub, dry)

    def _patch(self, resource: Resource, ns: str | None, name: str, body: Any, content_type: str,
               sub: str | None, params: Mapping[str, str], dry: bool) -> tuple[int, Obj]:
        key = resource.key(ns, name)
        if content_type == APPLY:
            if not params.get("fieldManager"):
                raise api_error(400, "BadRequest", "PatchOptions.meta.k8s.io is invalid: "
                                "fieldManager: Required value: is required for apply patch")
            body = _object(body)
            if key not in self._objects:
                return 201, self._create(resource, ns, body, dry=dry)
        current = self._current(resource, ns, name)
        base = copy.deepcopy(current)
        if content_type == JSON_PATCH:
            if not isinstance(body, list):
                raise api_error(400, "BadRequest", "a JSON patch must be a list of operations")
            try:
                patched = jsonpatch.apply_patch(base, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise self._invalid(resource, name, [f"the JSON patch did not apply: {exc}"]) \
                    from None
        elif content_type in (MERGE, STRATEGIC, APPLY):
            if not isinstance(body, dict):
                raise api_error(400, "BadRequest", "a merge patch must be a JSON object")
            if content_type == STRATEGIC and resource.custom:
                raise api_error(415, "UnsupportedMediaType", "the body of the request was in an "
                                f"unknown format - accepted media types include: {JSON_PATCH}, "
                                f"{MERGE}, {APPLY}")
            self._check_preconditions(resource, current, body.get("metadata") or {})
            strategic = content_type != MERGE and not resource.custom
            patched = (strategic_merge_patch if strategic else merge_patch)(base, body)
        else:
            raise api_error(415, "UnsupportedMediaType", f"unknown patch type {content_type!r}")
        if not isinstance(patched, dict):
            raise self._invalid(resource, name, ["the patched object is not a JSON object"])
        return 200, self._update(resource, current, patched, sub, dry)

    def _check_type(self, resource: Resource, obj: Obj) -> None:
        if not isinstance(obj, dict):
            raise api_error(400, "BadRequest", "the body must be a JSON object")
        api_version, kind = obj.get("apiVersion"), obj.get("kind")
        if api_version not in (None, "", resource.api_version) or kind not in (
                None, "", resource.kind):
            raise api_error(400, "BadRequest", f"the API version in the data ({api_version}) or "
                            f"its kind ({kind}) does not match the expected "
                            f"({resource.api_version}, {resource.kind})")

    def _check_preconditions(self, resource: Resource, current: Obj, meta: Obj) -> None:
        name = current["metadata"]["name"]
        rv, uid = meta.get("resourceVersion"), meta.get("uid")
        failed = f'Operation cannot be fulfilled on {resource.qualified} "{name}": '
        if uid and uid != current["metadata"]["uid"]:
            raise api_error(409, "Conflict", f"{failed}Precondition failed: UID in precondition: "
                            f'{uid}, UID in object meta: {current["metadata"]["uid"]}',
                            name=name, group=resource.group, kind=resource.plural)
        if rv and rv != current["metadata"]["resourceVersion"]:
            raise api_error(409, "Conflict", f"{failed}the object has been modified; please apply "
                            "your changes to the latest version and try again",
                            name=name, group=resource.group, kind=resource.plural)

    def _update(self, resource: Resource, current: Obj, candidate: Obj, sub: str | None,
                dry: bool) -> Obj:
        """Turn a client's full object into the next stored state and commit it."""
        name = current["metadata"]["name"]
        if sub == "status":
            new = copy.deepcopy(current)
            if "status" in candidate:
                new["status"] = copy.deepcopy(candidate["status"])
            else:
                new.pop("status", None)
        else:
            new = copy.deepcopy(candidate)
            new["metadata"] = meta = dict(new.get("metadata") or {})
            if "status" in resource.subresources:
                if "status" in current:
                    new["status"] = copy.deepcopy(current["status"])
                else:
                    new.pop("status", None)
            for field in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
                          "deletionGracePeriodSeconds", "generation", "resourceVersion"):
                if field in current["metadata"]:
                    meta[field] = current["metadata"][field]
                else:
                    meta.pop(field, None)
            errors = _metadata_errors(resource, meta)
            added = set(meta.get("finalizers") or ()) - set(
                current["metadata"].get("finalizers") or ())
            if current["metadata"].get("deletionTimestamp") and added:
                errors.append("metadata.finalizers: Forbidden: no new finalizers can be added if "
                              f"the object is being deleted, found new finalizers {sorted(added)}")
            if errors:
                raise self._invalid(resource, name, errors)
        new["apiVersion"], new["kind"] = current["apiVersion"], current["kind"]
        self._admit(resource, new, current)
        if _without_rv(new) == _without_rv(current):
            return self._output(resource, current)  # a no-op write changes nothing
        if _spec_part(resource, new) != _spec_part(resource, current):
            new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        if dry:
            return self._output(resource, new)
        key = resource.key(current["metadata"].get("namespace"), name)
        stored = self._commit(resource, key, "MODIFIED", new, current)
        self._after_update(resource, current, stored)
        meta = stored["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers") \
                and not meta.get("deletionGracePeriodSeconds"):  # the last finalizer is gone
            return self._output(resource, self._remove(resource, key))
        return self._output(resource, stored)

    def _delete(self, resource: Resource, ns: str | None, name: str, options: Mapping[str, Any],
                dry: bool) -> Obj:
        """DELETE: at once, or marked with a deletionTimestamp while finalizers, a namespace's
        contents or a running pod's graceful termination (the kubelet's part) hold it."""
        current = self._current(resource, ns, name)
        preconditions = options.get("preconditions")
        if isinstance(preconditions, dict):
            self._check_preconditions(resource, current, preconditions)
        if dry:
            return self._output(resource, current)
        key = resource.key(ns, name)
        if options.get("propagationPolicy") == "Orphan" or options.get("orphanDependents"):
            self._orphan(current["metadata"]["uid"])
        meta = current["metadata"]
        grace = _grace_period(resource, current, options)
        if meta.get("deletionTimestamp"):
            if grace or not meta.get("deletionGracePeriodSeconds"):
                return self._output(resource, current)
            if not meta.get("finalizers"):  # forced, or the kubelet is done with it
                return self._output(resource, self._remove(resource, key))
            shortened = copy.deepcopy(current)
            shortened["metadata"]["deletionGracePeriodSeconds"] = 0
            shortened = self._commit(resource, key, "MODIFIED", shortened, current)
            return self._output(resource, shortened)
        namespace = resource.is_("", "namespaces")
        if not (meta.get("finalizers") or namespace or grace):
            return self._output(resource, self._remove(resource, key))
        marked = copy.deepcopy(current)
        when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=grace)
        marked["metadata"]["deletionTimestamp"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
        marked["metadata"]["deletionGracePeriodSeconds"] = grace
        if namespace:
            marked["status"] = {"phase": "Terminating"}
        marked = self._commit(resource, key, "MODIFIED", marked, current)
        if namespace:  # the namespace controller's work: empty it, then let it go
            for other in [k for k in self._objects if k[2] == name]:
                if other in self._objects:
                    self._delete(self._resource_of(other), other[2], other[3], {}, False)
            marked = self._finish_namespace(name) or marked
        return self._output(resource, marked)

    def _finish_namespace(self, name: str) -> Obj | None:
        """Remove a terminating namespace once nothing is left in it."""
        key = ("", "namespaces", None, name)
        namespace = self._objects.get(key)
        if namespace is None or not namespace["metadata"].get("deletionTimestamp"):
            return None
        if namespace["metadata"].get("finalizers") or any(k[2] == name for k in self._objects):
            return None
        return self._remove(self._resource(kmock.resource("v1", "namespaces")), key)

    def _delete_collection(self, resource: Resource, ns: str | None, params: Mapping[str, str],
                           options: Mapping[str, Any], dry: bool) -> Obj:
        victims = self._select(resource, self._matcher(resource, ns, None, params))
        items = [self._delete(resource, o["metadata"].get("namespace"), o["metadata"]["name"],
                              options, dry) for o in victims]
        return {"apiVersion": resource.api_version, "kind": f"{resource.kind}List",
                "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _remove(self, resource: Resource, key: _Key) -> Obj:
        """Drop an object for good; what depended on it goes next."""
        current = self._objects[key]
        gone = self._commit(resource, key, "DELETED", current, current)
        if resource.is_("apiextensions.k8s.io", "customresourcedefinitions"):
            self._unregister(gone, drop_objects=True)
        if key[2] is not None:
            self._finish_namespace(key[2])
        self._schedule_gc()
        return gone

    def _resource_of(self, key: _Key) -> Resource:
        group, plural, _, _ = key
        api_version = self._objects[key]["apiVersion"]
        return self._resource(kmock.resource(group, api_version.rpartition("/")[2], plural))

    # -- garbage collection ---------------------------------------------------------------------

    def _schedule_gc(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop yet (objects created at start-up): nothing to collect
        if self._gc_handle is None:
            self._gc_handle = loop.call_later(self.gc_delay, self._collect_garbage)

    def _collect_garbage(self) -> None:
        """Background propagation: delete the objects none of whose owners exist. An owner
        counts only in the dependent's namespace (or cluster-wide), as for the real collector."""
        self._gc_handle = None

        def exists(ref: Obj, namespace: str | None) -> bool:
            owner = self._uids.get(ref.get("uid", ""))
            return owner is not None and owner[2] in (None, namespace)

        orphans = [key for key, obj in self._objects.items()
                   if (refs := obj["metadata"].get("ownerReferences"))
                   and not obj["metadata"].get("deletionTimestamp")
                   and not any(exists(ref, key[2]) for ref in refs)]
        for key in orphans:
            if key in self._objects:
                self._delete(self._resource_of(key), key[2], key[3], {}, False)

    def _orphan(self, uid: str) -> None:
        for key, obj in list(self._objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if any(ref.get("uid") == uid for ref in refs):
                new = copy.deepcopy(obj)
                new["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
                self._commit(self._resource_of(key), key, "MODIFIED", new, obj)

    # -- admission: what a default cluster's server does per kind -------------------------------

    def _invalid(self, resource: Resource, name: str, errors: list[str]) -> kmock.KubernetesError:
        group = resource.group or "core"
        return api_error(422, "Invalid", f'{resource.kind}.{group} "{name}" is invalid: '
                         + "; ".join(errors), name=name, group=resource.group, kind=resource.kind,
                         causes=[{"message": error} for error in errors])

    def _admit(self, resource: Resource, obj: Obj, old: Obj | None) -> None:
        """Default and validate an object about to be stored (``old``: its current state)."""
        errors: list[str] = []
        if resource.custom:
            schema = self._schemas[(resource.group, resource.version, resource.plural)]
            errors = structural.prepare(schema, obj)
        elif resource.is_("", "pods"):
            errors = self._admit_pod(obj, old)
        elif resource.is_("", "services"):
            errors = self._admit_service(obj, old)
        elif resource.is_("", "secrets"):
            obj["type"] = obj.get("type") or "Opaque"
        elif resource.is_("", "namespaces"):
            phase = (old or {}).get("status", {}).get("phase", "Active")
            obj.setdefault("status", {})["phase"] = phase
        elif resource.is_("apiextensions.k8s.io", "customresourcedefinitions"):
            errors = _crd_errors(obj)
            obj["status"] = _crd_status(obj)
        if errors:
            raise self._invalid(resource, obj["metadata"]["name"], errors)

    def _admit_pod(self, pod: Obj, old: Obj | None) -> list[str]:
        spec = pod.setdefault("spec", {})
        _default_pod(spec)
        if old is not None:
            for field in ("priority", "priorityClassName"):  # set by admission at creation
                if field in old["spec"]:
                    spec.setdefault(field, old["spec"][field])
            return _pod_update_errors(old, pod)
        pod["status"] = {"phase": "Pending", "qosClass": _qos_class(spec)}
        self._check_service_account(pod)
        self._set_priority(pod)
        return _pod_errors(spec)

    def _check_service_account(self, pod: Obj) -> None:
        name, ns = pod["metadata"]["name"], pod["metadata"]["namespace"]
        account = pod["spec"]["serviceAccountName"]
        if ("", "serviceaccounts", ns, account) not in self._objects:
            raise api_error(403, "Forbidden", f'pods "{name}" is forbidden: error looking up '
                            f'service account {ns}/{account}: serviceaccount "{account}" not found')

    def _set_priority(self, pod: Obj) -> None:
        """The Priority admission plugin: ``spec.priority`` from the named PriorityClass (or the
        global default); an unknown class refuses the pod."""
        spec = pod["spec"]
        classes = {key[3]: obj for key, obj in self._objects.items()
                   if key[:2] == ("scheduling.k8s.io", "priorityclasses")}
        wanted = spec.get("priorityClassName")
        if wanted is None:
            wanted = next((name for name, c in classes.items() if c.get("globalDefault")), None)
        if wanted is None:
            spec["priority"] = 0
        elif wanted in classes:
            spec["priorityClassName"], spec["priority"] = wanted, classes[wanted]["value"]
        else:
            raise api_error(403, "Forbidden", f'pods "{pod["metadata"]["name"]}" is forbidden: '
                            f"no PriorityClass with name {wanted} was found")

    def _admit_service(self, service: Obj, old: Obj | None) -> list[str]:
        spec = service.setdefault("spec", {})
        errors = []
        old_ip = (old or {}).get("spec", {}).get("clusterIP")
        spec.setdefault("type", "ClusterIP")
        if old_ip is not None:
            if spec.setdefault("clusterIP", old_ip) != old_ip:
                errors.append("spec.clusterIP: Invalid value: field is immutable")
        elif spec.get("clusterIP") != "None":
            spec["clusterIP"] = str(next(self._ips))
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        ports = spec.get("ports") or []
        if not ports and spec["clusterIP"] != "None":
            errors.append("spec.ports: Required value")
        for index, port in enumerate(ports):
            if not isinstance(port.get("port"), int) or not 0 < port["port"] < 65536:
                errors.append(f"spec.ports[{index}].port: Invalid value: must be in 1-65535")
            if len(ports) > 1 and not port.get("name"):
                errors.append(f"spec.ports[{index}].name: Required value")
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
        return errors

    def _after_create(self, resource: Resource, obj: Obj) -> None:
        if resource.is_("", "namespaces"):  # the service account controller's work
            self.create({"apiVersion": "v1", "kind": "ServiceAccount",
                         "metadata": {"name": "default", "namespace": obj["metadata"]["name"]}})
        elif resource.is_("apiextensions.k8s.io", "customresourcedefinitions"):
            self._register(obj)

    def _after_update(self, resource: Resource, old: Obj, new: Obj) -> None:
        if resource.is_("apiextensions.k8s.io", "customresourcedefinitions"):
            self._unregister(old, drop_objects=False)
            self._register(new)

    def _bind(self, resource: Resource, ns: str | None, name: str, binding: Obj) -> Obj:
        """``pods/binding``, what a scheduler posts: sets spec.nodeName once, and PodScheduled."""
        pod = self._current(resource, ns, name)
        node = (binding.get("target") or {}).get("name")
        if not node:
            raise self._invalid(resource, name, ["target.name: Required value"])
        failed = f'Operation cannot be fulfilled on pods/binding "{name}": '
        if pod["spec"].get("nodeName"):
            raise api_error(409, "Conflict", f"{failed}pod {name} is already assigned to node "
                            f'"{pod["spec"]["nodeName"]}"')
        if pod["metadata"].get("deletionTimestamp"):
            raise api_error(409, "Conflict", f"{failed}pod {name} is being deleted")
        bound = copy.deepcopy(pod)
        bound["spec"]["nodeName"] = node
        status = bound.setdefault("status", {})
        scheduled = {"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                     "lastTransitionTime": now_rfc3339()}
        others = [c for c in status.get("conditions", []) if c.get("type") != "PodScheduled"]
        status["conditions"] = [*others, scheduled]
        self._commit(resource, resource.key(ns, name), "MODIFIED", bound, pod)
        return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success",
                "code": 201}

    # -- custom resources -----------------------------------------------------------------------

    def _register(self, crd: Obj) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            key = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[key] = kmock.ResourceInfo(
                kind=names["kind"], singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced", verbs=_CR_VERBS,
                shortnames=names.get("shortNames", ()), categories=names.get("categories", ()),
                subresources=set(version.get("subresources") or {}),
            )
            schema = (version.get("schema") or {}).get("openAPIV3Schema") or {
                "type": "object", "x-kubernetes-preserve-unknown-fields": True}
            self._schemas[(spec["group"], version["name"], names["plural"])] = schema

    def _unregister(self, crd: Obj, drop_objects: bool) -> None:
        """Forget a CRD's resources; with ``drop_objects`` (the CRD is deleted) its objects
        go too, finalizers or not (a real server waits for their finalizers)."""
        spec = crd["spec"]
        plural = spec["names"]["plural"]
        for key in [k for k in self.resources if (k.group, k.plural) == (spec["group"], plural)]:
            self._schemas.pop((spec["group"], key.version or "", plural), None)
            del self.resources[key]
        if drop_objects:
            for key in [k for k in self._objects if k[:2] == (spec["group"], plural)]:
                obj = self._objects[key]
                self._commit(_orphaned_resource(obj, spec), key, "DELETED", obj, obj)


    # -- what kubectl and helm ask for: tables, OpenAPI, the server's version -------------------

    def _table(self, resource: Resource, payload: Obj, params: Mapping[str, str]) -> Obj:
        """A ``meta.k8s.io/v1`` Table of a list (or of one object), the form ``kubectl get``
        prints: a CRD's printer columns, the usual columns of a few built-in kinds, else Name
        and Age. Rows carry the object's metadata, or the object with ``includeObject=Object``."""
        columns = self._columns(resource)
        listed = payload.get("kind") == f"{resource.kind}List"
        items = payload["items"] if listed else [payload]
        include = params.get("includeObject", "Metadata")
        rows = []
        for item in items:
            row: Obj = {"cells": [cell(item) for _, cell in columns]}
            if include == "Object":
                row["object"] = {"apiVersion": resource.api_version, "kind": resource.kind, **item}
            elif include != "None":
                row["object"] = {"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                                 "metadata": item["metadata"]}
            rows.append(row)
        meta = payload["metadata"] if listed else {
            "resourceVersion": payload["metadata"].get("resourceVersion", "")}
        return {"apiVersion": "meta.k8s.io/v1", "kind": "Table", "metadata": meta,
                "columnDefinitions": [definition for definition, _ in columns], "rows": rows}

    async def _table_events(self, resource: Resource, events: AsyncIterator[Any],
                            params: Mapping[str, str]) -> AsyncIterator[Any]:
        """``kubectl get -w``: each watch event carries a one-row Table."""
        async for event in events:
            if isinstance(event, dict) and event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                event = {**event, "object": self._table(resource, event["object"], params)}
            yield event

    def _columns(self, resource: Resource) -> list[Column]:
        if not resource.custom:
            return _BUILTIN_COLUMNS.get((resource.group, resource.plural),
                                        [NAME_COLUMN, AGE_COLUMN])
        crd = self._objects.get(("apiextensions.k8s.io", "customresourcedefinitions", None,
                                 f"{resource.plural}.{resource.group}")) or {}
        version = next((v for v in (crd.get("spec") or {}).get("versions", ())
                        if v.get("name") == resource.version), {})
        printed = version.get("additionalPrinterColumns") or []
        return [NAME_COLUMN, *map(_printer_column, printed)] if printed else [NAME_COLUMN,
                                                                               AGE_COLUMN]

    async def _serve_openapi(self, request: kmock.Request) -> kmock.Payload:
        """``/openapi/v3`` and a document per group-version, just enough for kubectl and helm
        to see that every PATCH takes ``fieldValidation``: they then leave validation to the
        server, as with a real one (else they would want OpenAPI v2 schemas, not served here).
        No component schemas: kubectl builds strategic merge patches from its own types."""
        documents = self._openapi_documents()
        path = request.url.path.removeprefix("/openapi/v3").strip("/")
        if not path:
            return {"paths": {gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash="
                                   + hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]}
                              for gv, doc in documents.items()}}
        if path not in documents:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        return documents[path]

    def _openapi_documents(self) -> dict[str, Obj]:
        paths: dict[str, Obj] = {}
        query = [{"name": name, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
                 for name in ("dryRun", "fieldManager", "fieldValidation", "force")]
        for key, info in sorted(self.resources.items(), key=lambda item: str(item[0])):
            group, version, plural = key.group or "", key.version or "", key.plural or ""
            gv = f"apis/{group}/{version}" if group else f"api/{version}"
            scope = "namespaces/{namespace}/" if info.namespaced else ""
            paths.setdefault(gv, {})[f"/{gv}/{scope}{plural}/{{name}}"] = {"patch": {
                "operationId": f"patch{info.kind}", "parameters": query,
                "responses": {"200": {"description": "OK"}},
                "x-kubernetes-action": "patch",
                "x-kubernetes-group-version-kind": {"group": group, "version": version,
                                                    "kind": info.kind},
            }}
        return {gv: {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": KUBE_VERSION},
                     "paths": gv_paths, "components": {"schemas": {}}}
                for gv, gv_paths in paths.items()}

    async def _serve_server_version(self, request: kmock.Request) -> kmock.Payload:
        """The Kubernetes version whose API this emulates (helm reads it for Capabilities)."""
        major, minor, _ = KUBE_VERSION.removeprefix("v").split(".", 2)
        return {"major": major, "minor": minor, "gitVersion": f"{KUBE_VERSION}+tidal.emulator",
                "gitCommit": "", "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z",
                "goVersion": "python", "compiler": "tidal", "platform": "linux/amd64"}


def _orphaned_resource(obj: Obj, spec: Obj) -> Resource:
    """A custom resource's descriptor after its CRD is gone, to record its deletion."""
    group, _, version = obj["apiVersion"].rpartition("/")
    return Resource(group=group, version=version, plural=spec["names"]["plural"], kind=obj["kind"],
                    namespaced=spec.get("scope") == "Namespaced", subresources=frozenset(),
                    custom=True)


def _grace_period(resource: Resource, obj: Obj, options: Mapping[str, Any]) -> int:
    """Seconds a deletion waits for the kubelet: only pods bound to a node and not finished
    have one (``gracePeriodSeconds`` in the options, else the pod's own)."""
    if not resource.is_("", "pods"):
        return 0
    finished = obj.get("status", {}).get("phase") in ("Succeeded", "Failed")
    if finished or not obj["spec"].get("nodeName"):
        return 0
    asked = options.get("gracePeriodSeconds")
    return int(asked if asked is not None else obj["spec"].get("terminationGracePeriodSeconds", 30))


def _spec_part(resource: Resource, obj: Obj) -> Obj:
    """What ``metadata.generation`` counts changes of: all but metadata (and status where it is
    a subresource)."""
    ignored = ("metadata", "status") if "status" in resource.subresources else ("metadata",)
    return {key: value for key, value in obj.items() if key not in ignored}


def _without_rv(obj: Obj) -> Obj:
    return {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}}


def _default_pod(spec: Obj) -> None:
    """The defaults a real server fills into every pod it stores."""
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("serviceAccountName", spec.get("serviceAccount") or "default")
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        if not isinstance(container, dict):
            continue
        resources = container.setdefault("resources", {})
        limits = resources.get("limits") or {}
        if limits:  # requests default to limits
            resources["requests"] = {**limits, **(resources.get("requests") or {})}


def _qos_class(spec: Obj) -> str:
    containers = [c for c in spec.get("containers") or [] if isinstance(c, dict)]
    resources = [(c["resources"].get("limits") or {}, c["resources"].get("requests") or {})
                 for c in containers]
    if not any(limits or requests for limits, requests in resources):
        return "BestEffort"
    guaranteed = all(limits.get(kind) is not None and limits.get(kind) == requests.get(kind)
                     for limits, requests in resources for kind in ("cpu", "memory"))
    return "Guaranteed" if guaranteed else "Burstable"


def _pod_errors(spec: Obj) -> list[str]:
    errors = []
    containers = spec.get("containers") or []
    if not containers:
        errors.append("spec.containers: Required value")
    for field in ("containers", "initContainers"):
        for index, container in enumerate(spec.get(field) or []):
            errors += _container_errors(f"spec.{field}[{index}]", container)
    if len({c.get("name") for c in containers if isinstance(c, dict)}) != len(containers):
        errors.append("spec.containers: Duplicate value: container names must be unique")
    return errors


def _container_errors(where: str, container: Any) -> list[str]:
    if not isinstance(container, dict):
        return [f"{where}: Invalid value: must be an object"]
    errors = []
    if not container.get("name") or not re.fullmatch(_DNS_LABEL, str(container["name"])):
        errors.append(f"{where}.name: Invalid value: {container.get('name')!r}: "
                      "must be a DNS-1123 label")
    if not container.get("image"):
        errors.append(f"{where}.image: Required value")
    resources = container.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    for kind, values in (("limits", limits), ("requests", requests)):
        for resource, value in values.items():
            try:
                _quantity(value)
            except ValueError as exc:
                errors.append(f"{where}.resources.{kind}[{resource}]: Invalid value: {exc}")
    for resource, value in requests.items():
        if not _is_extended_resource(resource):
            continue
        if resource not in limits:
            errors.append(f"{where}.resources.limits: Required value: Limit must be set for non "
                          f"overcommitable resources ({resource})")
        elif str(limits[resource]) != str(value):
            errors.append(f"{where}.resources.requests: Invalid value: {value!r}: must be equal to "
                          f"{resource} limit of {limits[resource]}")
        elif not re.fullmatch(r"\d+", str(value)):
            errors.append(f"{where}.resources.requests[{resource}]: Invalid value: {value!r}: "
                          "must be an integer")
    return errors


def _pod_update_errors(old: Obj, new: Obj) -> list[str]:
    """A pod's spec is immutable but for images, activeDeadlineSeconds and added tolerations;
    spec.nodeName is set through pods/binding only."""
    def mutable_removed(spec: Obj) -> Obj:
        spec = copy.deepcopy(spec)
        for field in ("activeDeadlineSeconds", "tolerations", "schedulingGates"):
            spec.pop(field, None)
        for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
            container.pop("image", None)
        return spec

    if mutable_removed(new.get("spec") or {}) == mutable_removed(old.get("spec") or {}):
        return []
    return ["spec: Forbidden: pod updates may not change fields other than "
            "`spec.containers[*].image`, `spec.initContainers[*].image`, "
            "`spec.activeDeadlineSeconds`, `spec.tolerations` (only "
            "additions to existing tolerations) or `spec.schedulingGates`; spec.nodeName is set by "
            "pods/binding"]


def _crd_errors(crd: Obj) -> list[str]:
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    errors = []
    for field in ("group", "names", "scope", "versions"):
        if not spec.get(field):
            errors.append(f"spec.{field}: Required value")
    for field in ("plural", "kind"):
        if not names.get(field):
            errors.append(f"spec.names.{field}: Required value")
    if errors:
        return errors
    if crd["metadata"]["name"] != f"{names['plural']}.{spec['group']}":
        errors.append(f"metadata.name: Invalid value: {crd['metadata']['name']!r}: must be "
                      f"spec.names.plural+\".\"+spec.group")
    if spec["scope"] not in ("Namespaced", "Cluster"):
        errors.append(f"spec.scope: Unsupported value: {spec['scope']!r}")
    if sum(bool(v.get("storage")) for v in spec["versions"]) != 1:
        errors.append("spec.versions: Invalid value: must have exactly one version marked as "
                      "storage version")
    return errors


def _crd_status(crd: Obj) -> Obj:
    now = now_rfc3339()
    spec = crd["spec"]
    return {
        "acceptedNames": copy.deepcopy(spec["names"]),
        "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
             "message": "no conflicts found", "lastTransitionTime": now},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
             "message": "the initial names have been accepted", "lastTransitionTime": now},
        ],
    }


# ------------------------------------------------------------------------------------------------
# Tables: the columns ``kubectl get`` prints, computed by the server as a real one does

Column = tuple[Obj, Callable[[Obj], Any]]  # its definition in a Table, and its cell of an object


def _wants_table(request: kmock.Request) -> bool:
    """``kubectl get`` asks for ``application/json;as=Table;v=v1;g=meta.k8s.io`` first."""
    accept = next((v for k, v in request.headers.items() if k.lower() == "accept"), "")
    first = accept.split(",")[0]
    params = dict(p.strip().partition("=")[::2] for p in first.split(";")[1:])
    return params.get("as") == "Table" and params.get("g") == "meta.k8s.io"


def human_duration(seconds: float) -> str:
    """An age as kubectl prints it (k8s.io/apimachinery's ``duration.HumanDuration``)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    m, h, d = s // 60, s // 3600, s // 86400
    if s < 120:
        return f"{max(s, 0)}s"
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    if h < 192:
        return f"{d}d{h % 24}h" if h % 24 else f"{d}d"
    y = d // 365
    if y < 2:
        return f"{d}d"
    if y < 8:
        return f"{y}y{d % 365}d" if d % 365 else f"{y}y"
    return f"{y}y"


def _age(timestamp: Any) -> str:
    if not isinstance(timestamp, str) or not timestamp:
        return "<unknown>"
    then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    return human_duration((datetime.datetime.now(datetime.UTC) - then).total_seconds())


def json_path(obj: Any, path: str) -> Any:
    """A printer column's simple JSONPath (``.status.layout.pp``, ``.spec.items[0].name``);
    None where a step is missing."""
    value = obj
    for name, index in re.findall(r"\.([^.\[\]]+)|\[(\d+)\]", path):
        if name:
            value = value.get(name) if isinstance(value, dict) else None
        else:
            value = value[int(index)] if isinstance(value, list) and int(index) < len(
                value) else None
    return value


def _column(name: str, cell: Callable[[Obj], Any], type: str = "string", priority: int = 0,
            format: str = "", description: str = "") -> Column:
    return ({"name": name, "type": type, "format": format, "description": description,
             "priority": priority}, cell)


def _printer_column(column: Obj) -> Column:
    """A CRD's additionalPrinterColumns entry; dates print as ages, as the server does."""
    path = column["jsonPath"]
    cell = ((lambda obj: _age(json_path(obj, path))) if column["type"] == "date"
            else (lambda obj: json_path(obj, path)))
    return _column(column["name"], cell, column["type"], column.get("priority", 0),
                   column.get("format", ""), column.get("description", ""))


NAME_COLUMN = _column("Name", lambda o: o["metadata"]["name"], format="name",
                      description="Name must be unique within a namespace.")
AGE_COLUMN = _column("Age", lambda o: _age(o["metadata"].get("creationTimestamp")),
                     description="The time since the object was created.")


def _status(obj: Obj, *path: str) -> Any:
    return json_path(obj, "".join(f".{step}" for step in ("status", *path)))


def _pod_ready(pod: Obj) -> str:
    containers = (pod.get("spec") or {}).get("containers") or []
    statuses = _status(pod, "containerStatuses")
    if statuses:
        ready = sum(bool(c.get("ready")) for c in statuses)
    else:  # the local kubelet sets conditions only
        conditions = _status(pod, "conditions") or []
        ready = len(containers) if any(c.get("type") == "Ready" and c.get("status") == "True"
                                       for c in conditions) else 0
    return f"{ready}/{len(containers)}"


def _pod_status(pod: Obj) -> str:
    if pod["metadata"].get("deletionTimestamp"):
        return "Terminating"
    return _status(pod, "reason") or _status(pod, "phase") or "Unknown"


def _node_status(node: Obj) -> str:
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in _status(node, "conditions") or [])
    text = "Ready" if ready else "NotReady"
    return text + (",SchedulingDisabled" if (node.get("spec") or {}).get("unschedulable") else "")


def _service_ports(service: Obj) -> str:
    ports = (service.get("spec") or {}).get("ports") or []
    return ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in ports) or "<none>"


def _event_object(event: Obj) -> str:
    involved = event.get("involvedObject") or {}
    return f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}"


_BUILTIN_COLUMNS: dict[tuple[str, str], list[Column]] = {
    ("", "pods"): [
        NAME_COLUMN,
        _column("Ready", _pod_ready), _column("Status", _pod_status),
        _column("Restarts", lambda p: sum(c.get("restartCount", 0)
                                          for c in _status(p, "containerStatuses") or []),
                "integer"),
        AGE_COLUMN,
        _column("IP", lambda p: _status(p, "podIP") or "<none>", priority=1),
        _column("Node", lambda p: (p.get("spec") or {}).get("nodeName") or "<none>", priority=1),
    ],
    ("", "nodes"): [
        NAME_COLUMN,
        _column("Status", _node_status), _column("Roles", lambda n: "<none>"), AGE_COLUMN,
        _column("Version", lambda n: _status(n, "nodeInfo", "kubeletVersion") or ""),
    ],
    ("", "namespaces"): [NAME_COLUMN, _column("Status", lambda n: _status(n, "phase")),
                         AGE_COLUMN],
    ("", "services"): [
        NAME_COLUMN,
        _column("Type", lambda s: s["spec"].get("type")),
        _column("Cluster-IP", lambda s: s["spec"].get("clusterIP")),
        _column("External-IP", lambda s: "<none>"), _column("Port(s)", _service_ports),
        AGE_COLUMN,
    ],
    ("", "events"): [  # the Name last and only with -o wide, as a real server has it
        _column("Last Seen", lambda e: _age(e.get("lastTimestamp") or e.get("eventTime")
                                            or e["metadata"].get("creationTimestamp"))),
        _column("Type", lambda e: e.get("type")), _column("Reason", lambda e: e.get("reason")),
        _column("Object", _event_object), _column("Message", lambda e: e.get("message")),
        (NAME_COLUMN[0] | {"priority": 1}, NAME_COLUMN[1]),
    ],
    ("apps", "deployments"): [
        NAME_COLUMN,
        _column("Ready", lambda d: f"{_status(d, 'readyReplicas') or 0}/"
                                   f"{(d.get('spec') or {}).get('replicas', 1)}"),
        _column("Up-to-date", lambda d: _status(d, "updatedReplicas") or 0, "integer"),
        _column("Available", lambda d: _status(d, "availableReplicas") or 0, "integer"),
        AGE_COLUMN,
    ],
}

def _watch_error(code: int, reason: str, message: str) -> Obj:
    status = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
              "code": code, "reason": reason, "message": message}
    return {"type": "ERROR", "object": status}


def _body(request: kmock.Request) -> Any:
    if request.data is not None or not request.text.strip():
        return request.data
    try:  # server-side apply sends YAML
        return yaml.safe_load(request.text)
    except yaml.YAMLError as exc:
        raise api_error(400, "BadRequest", f"the body could not be decoded: {exc}") from None


def _object(body: Any) -> Obj:
    if not isinstance(body, dict):
        raise api_error(400, "BadRequest", "the body must be a JSON object")
    return body


async def _parse_request(raw: aiohttp.web.BaseRequest, id: int) -> kmock.Request:
    """kmock's request, from a path parser that tells ``/api/v1/namespaces/{name}`` (a
    namespace) from ``/api/v1/namespaces/{namespace}/{plural}``."""
    body = await raw.read()
    text = body.decode("utf-8", errors="replace")  # protobuf bodies are not text
    try:
        data = json.loads(text) if raw.body_exists else None
    except ValueError:
        data = None
    path = parse_path(raw.path)
    method = kmock.method(raw.method)
    resource = None if path.group is None else kmock.resource(
        group=path.group, version=path.version, plural=path.plural)
    return kmock.Request(
        id=id, raw_request=raw, url=raw.url, method=raw.method, params=dict(raw.query),
        headers=dict(raw.headers), cookies=dict(raw.cookies), data=data, body=body,
        text=text, action=parsing.guess_k8s(path, method, dict(raw.query)),
        resource=resource, namespace=path.namespace, name=path.name, subresource=path.subresource,
    )


def parse_path(path: str) -> parsing.ParsedPath:
    """``/api/v1/...`` or ``/apis/{group}/{version}/...`` into group, version, plural, namespace,
    name and subresource."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return parsing.ParsedPath()
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    plural = rest[0] if rest else None
    name = rest[1] if len(rest) > 1 else None
    subresource = "/".join(rest[2:]) or None
    return parsing.ParsedPath(group, version, plural, namespace, name, subresource)


# ------------------------------------------------------------------------------------------------
# Running it


@dataclasses.dataclass(frozen=True)
class Served:
    """A running emulator: where it listens, and its kubeconfig if one was written."""

    emulator: Emulator
    url: str
    kubeconfig: Path | None


@asynccontextmanager
async def serve(host: str = "127.0.0.1", port: int = 0, kubeconfig: str | Path | None = None,
                emulator: Emulator | None = None) -> AsyncIterator[Served]:
    """Serve an emulator on ``host:port`` (0: any free port) until the block ends."""
    emulator = Emulator() if emulator is None else emulator  # an Emulator with no requests is falsy
    emulator._closing = False
    async with emulator:
        server = aiohttp.web.Server(emulator, handler_cancellation=True)
        runner = aiohttp.web.ServerRunner(server, shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = aiohttp.web.TCPSite(runner, host, port)
            await site.start()
            bound_host, bound_port = runner.addresses[0][:2]
            url = f"http://{bound_host}:{bound_port}"
            path = None
            if kubeconfig is not None:
                path = write_kubeconfig(kubeconfig, url)
            yield Served(emulator, url, path)
        finally:
            emulator._closing = True  # end the watch streams, or the shutdown waits for them
            emulator._changed.set()
            await runner.cleanup()


def write_kubeconfig(path: str | Path, url: str, namespace: str = "default",
                     token: str = "tidal-emulator") -> Path:
    """A kubeconfig for the emulator: plain HTTP, a token user (any token is accepted; tests
    tell clients apart by their token in the recorded requests)."""
    path = Path(path)
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "tidal-emulator",
        "clusters": [{"name": "tidal-emulator",
                      "cluster": {"server": url, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "tidal", "user": {"token": token}}],
        "contexts": [{"name": "tidal-emulator", "context": {
            "cluster": "tidal-emulator", "user": "tidal", "namespace": namespace}}],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class EmulatorThread:
    """An emulator served from its own event loop in a background thread: for synchronous
    tests and the CLI. ``with EmulatorThread() as cluster: cluster.url``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, kubeconfig: str | Path | None = None,
                 emulator: Emulator | None = None) -> None:
        self._args = (host, port, kubeconfig)
        self._emulator = emulator
        self._served: Served | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="tidal-emulator", daemon=True)

    def start(self) -> EmulatorThread:
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise RuntimeError("the emulator did not start") from self._failure
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def __enter__(self) -> EmulatorThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def served(self) -> Served:
        if self._served is None:
            raise RuntimeError("the emulator is not running")
        return self._served

    @property
    def url(self) -> str:
        return self.served.url

    @property
    def kubeconfig(self) -> Path | None:
        return self.served.kubeconfig

    @property
    def emulator(self) -> Emulator:
        return self.served.emulator

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the emulator's loop (e.g. ``cluster.call(cluster.emulator.get,
        "v1/pods", "default", "w-0")``) and return its result; a coroutine is awaited there."""
        assert self._loop is not None

        async def run() -> Any:
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Run a coroutine on the emulator's loop (e.g. a scheduler) without waiting for it."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            host, port, kubeconfig = self._args
            async with serve(host, port, kubeconfig, self._emulator) as served:
                self._served = served
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._ready.set()


def load_manifests(paths: Iterable[str | Path]) -> Iterator[Obj]:
    """The objects in YAML files (several documents each; ``List`` kinds unfold)."""
    for path in paths:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if isinstance(doc, dict) and doc.get("kind", "").endswith("List") and "items" in doc:
                yield from doc["items"]
            elif doc:
                yield doc


async def _run_cli(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve(args.host, args.port, args.kubeconfig) as served:
        for obj in load_manifests(args.apply):
            served.emulator.create(obj)
        print(f"ready {served.url}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tidal_kube.emulator",
        description="Serve an in-memory Kubernetes API; prints 'ready URL' once it listens.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig for it here")
    parser.add_argument("--apply", action="append", default=[], metavar="YAML",
                        help="create the objects in this file at start (CRDs, PriorityClasses...)")
    asyncio.run(_run_cli(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
