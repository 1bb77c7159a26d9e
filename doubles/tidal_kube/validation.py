"""Field validation of what clients write, with the API server's messages: names, label and
annotation keys and values, owner references, resource quantities, a pod's containers and what
may change in a pod, a CustomResourceDefinition's names and versions."""

from __future__ import annotations

import copy
import re
from typing import Any

from tidal_kube.resources import Obj, Resource

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*"
_DNS_1035 = r"[a-z]([-a-z0-9]*[a-z0-9])?"
_LABEL_VALUE = r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"


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


def metadata_errors(resource: Resource, meta: Obj) -> list[str]:
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


def pod_errors(spec: Obj) -> list[str]:
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


def pod_update_errors(old: Obj, new: Obj) -> list[str]:
    """A pod's spec is immutable but for images, activeDeadlineSeconds, added tolerations and
    removed scheduling gates; spec.nodeName is set through pods/binding only."""
    def mutable_removed(spec: Obj) -> Obj:
        spec = copy.deepcopy(spec)
        for field in ("activeDeadlineSeconds", "tolerations", "schedulingGates"):
            spec.pop(field, None)
        for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
            container.pop("image", None)
        return spec

    old_gates = {g.get("name") for g in (old.get("spec") or {}).get("schedulingGates") or ()}
    added = [g.get("name") for g in (new.get("spec") or {}).get("schedulingGates") or ()
             if g.get("name") not in old_gates]
    if added:
        return [f"spec.schedulingGates: Forbidden: only deletion is allowed, but found new "
                f"scheduling gate '{added[0]}'"]
    if mutable_removed(new.get("spec") or {}) == mutable_removed(old.get("spec") or {}):
        return []
    return ["spec: Forbidden: pod updates may not change fields other than "
            "`spec.containers[*].image`, `spec.initContainers[*].image`, "
            "`spec.activeDeadlineSeconds`, `spec.tolerations` (only "
            "additions to existing tolerations) or `spec.schedulingGates`; spec.nodeName is set by "
            "pods/binding"]


def crd_errors(crd: Obj) -> list[str]:
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
