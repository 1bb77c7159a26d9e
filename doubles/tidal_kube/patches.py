"""Patch semantics: JSON merge patch (RFC 7386), JSON patch (RFC 6902, its ``test`` op failing
with 422 as kopf expects), strategic merge patch for built-in kinds (a custom resource answers
415, as a real server does), and server-side apply treated as a merge patch (no field
management)."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch

from tidal_kube.resources import Obj, Resource, api_error

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"


def patched(resource: Resource, current: Obj, body: Any, content_type: str) -> Obj:
    """``current`` after the patch ``body`` of ``content_type`` (``current`` is left alone)."""
    name = current["metadata"]["name"]
    base = copy.deepcopy(current)
    if content_type == JSON_PATCH:
        if not isinstance(body, list):
            raise api_error(400, "BadRequest", "a JSON patch must be a list of operations")
        try:
            result = jsonpatch.apply_patch(base, body)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise resource.invalid(name, [f"the JSON patch did not apply: {exc}"]) from None
    elif content_type in (MERGE, STRATEGIC, APPLY):
        if not isinstance(body, dict):
            raise api_error(400, "BadRequest", "a merge patch must be a JSON object")
        if content_type == STRATEGIC and resource.custom:
            raise api_error(415, "UnsupportedMediaType", "the body of the request was in an "
                            f"unknown format - accepted media types include: {JSON_PATCH}, "
                            f"{MERGE}, {APPLY}")
        strategic = content_type != MERGE and not resource.custom
        result = (strategic_merge_patch if strategic else merge_patch)(base, body)
    else:
        raise api_error(415, "UnsupportedMediaType", f"unknown patch type {content_type!r}")
    if not isinstance(result, dict):
        raise resource.invalid(name, ["the patched object is not a JSON object"])
    return result


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
