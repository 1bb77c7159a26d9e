"""Label and field selectors, as list, watch and delete-collection take them: their grammar, the
fields each kind can be selected by, and the 400s of a real server for anything else."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from tidal_kube.resources import Obj, Resource, api_error


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


def matcher(resource: Resource, ns: str | None, name: str | None,
            params: Mapping[str, str]) -> Callable[[Obj], bool]:
    """Whether an object is in the namespace, has the name, and passes the selectors of a
    request's ``params``; a bad selector is a 400 here, before any answer starts."""
    labels = label_selector(params.get("labelSelector"))
    fields = field_selector(resource, params.get("fieldSelector"))

    def match(obj: Obj) -> bool:
        meta = obj["metadata"]
        return ((ns is None or meta.get("namespace") == ns)
                and (name is None or meta["name"] == name)
                and labels(meta.get("labels") or {}) and fields(obj))

    return match
