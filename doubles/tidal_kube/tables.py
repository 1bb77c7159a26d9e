"""Tables: what ``kubectl get`` prints, computed by the server as a real one does. A
``meta.k8s.io/v1`` Table of a list, an object or each event of a watch, with a CRD's printer
columns, the usual columns of a few built-in kinds, else Name and Age; ages as kubectl prints
them."""

from __future__ import annotations

import datetime
import re
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import kmock

from tidal_kube.resources import Obj, Resource

Column = tuple[Obj, Callable[[Obj], Any]]  # its definition in a Table, and its cell of an object


def wants_table(request: kmock.Request) -> bool:
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


def columns_of(resource: Resource, crd: Obj | None) -> list[Column]:
    """The columns of a resource's Table (``crd``: a custom resource's definition)."""
    if not resource.custom:
        return _BUILTIN_COLUMNS.get((resource.group, resource.plural), [NAME_COLUMN, AGE_COLUMN])
    version = next((v for v in ((crd or {}).get("spec") or {}).get("versions", ())
                    if v.get("name") == resource.version), {})
    printed = version.get("additionalPrinterColumns") or []
    return [NAME_COLUMN, *map(_printer_column, printed)] if printed else [NAME_COLUMN,
                                                                           AGE_COLUMN]


def table(resource: Resource, payload: Obj, params: Mapping[str, str],
          columns: list[Column]) -> Obj:
    """A ``meta.k8s.io/v1`` Table of a list (or of one object), the form ``kubectl get``
    prints. Rows carry the object's metadata, or the object with ``includeObject=Object``."""
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


async def table_events(resource: Resource, events: AsyncIterator[Any], params: Mapping[str, str],
                       columns: list[Column]) -> AsyncIterator[Any]:
    """``kubectl get -w``: each watch event carries a one-row Table."""
    async for event in events:
        if isinstance(event, dict) and event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
            event = {**event, "object": table(resource, event["object"], params, columns)}
        yield event
