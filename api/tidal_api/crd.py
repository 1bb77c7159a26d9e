"""The ElasticTrainingJob CustomResourceDefinition, generated from the pydantic types.

crds/elastictrainingjobs.tidal.dev.yaml is this module's output written as YAML by
tools/gen_crd.py (tidal_api stays stdlib + pydantic, so no YAML here), and a test keeps the
two equal: the types in this package are the one place a field is declared. Pydantic's JSON
schema becomes a Kubernetes *structural* schema:

- ``$ref`` is inlined (a CRD allows none), and every property must have a description;
- ``X | None`` becomes ``X``: the API server prunes nulls of non-nullable fields before
  defaulting, which is pydantic's "None means absent" (and a merge patch's null deletes);
- ``gt``/``lt`` become OpenAPI v3.0's ``minimum`` + ``exclusiveMinimum: true`` (and maximum);
- fixed-length tuples become arrays with ``minItems == maxItems``; ``int | str`` becomes
  ``x-kubernetes-int-or-string``; free-form objects ``x-kubernetes-preserve-unknown-fields``;
- a nested model with a default gets ``default: {}``, so the API server fills in the defaults
  inside it as pydantic does; empty-collection defaults are left out (absent means empty);
- each model's CEL rules (``x-kubernetes-validations``, see tidal_api.spec) are kept.
"""

from __future__ import annotations

import copy
from typing import Any

from tidal_api.spec import GROUP, KIND, VERSION, ElasticTrainingJob

PLURAL = "elastictrainingjobs"
SINGULAR = "elastictrainingjob"
SHORT_NAMES = ("etj",)
CRD_NAME = f"{PLURAL}.{GROUP}"

PRINTER_COLUMNS = (
    {"name": "Workers", "type": "integer", "jsonPath": ".status.workers",
     "description": "Worker pods of the applied generation."},
    {"name": "PP", "type": "integer", "jsonPath": ".status.layout.pp",
     "description": "Pipeline ranks per replica."},
    {"name": "DP", "type": "integer", "jsonPath": ".status.layout.dp",
     "description": "Data-parallel replicas."},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step",
     "description": "Optimizer steps done."},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase",
     "description": "Where the job is in its life."},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts",
     "description": "Times the operator restarted the job.", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)

# The order keys are written in: what a reader looks for first.
_KEY_ORDER = (
    "description", "type", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
    "default", "enum", "minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum",
    "minItems", "maxItems", "minLength", "maxLength", "pattern", "items",
    "additionalProperties", "properties", "required", "x-kubernetes-validations",
)
_COPIED = ("enum", "minimum", "maximum", "minItems", "maxItems", "minLength", "maxLength",
           "pattern")
_SCALARS = ("integer", "number", "string", "boolean")


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition (apiextensions.k8s.io/v1), as a plain dict."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["tidal"],
            },
            "scope": "Namespaced",
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [dict(c) for c in PRINTER_COLUMNS],
                "schema": {"openAPIV3Schema": openapi_schema()},
            }],
        },
    }


def openapi_schema() -> dict[str, Any]:
    """The structural openAPIV3Schema of an ElasticTrainingJob."""
    raw = ElasticTrainingJob.model_json_schema(by_alias=True)
    # metadata may not be restricted beyond name and generateName, not even described.
    del raw["properties"]["metadata"]
    root = _schema(raw, raw["$defs"], "")
    fields = root["properties"]
    # The API server checks apiVersion and kind itself; an enum would tie the schema to one
    # version.
    root["properties"] = {
        **{name: {"description": fields[name]["description"], "type": "string"}
           for name in ("apiVersion", "kind")},
        "metadata": {"type": "object"},
        "spec": fields["spec"],
        "status": fields["status"],
    }
    return root


def _schema(node: dict[str, Any], defs: dict[str, Any], where: str) -> dict[str, Any]:
    """One node of pydantic's JSON schema as a structural schema node."""
    node = _resolve(node, defs)
    # Lists copied: a type used twice (the layout) must not share them, or YAML writes anchors.
    out: dict[str, Any] = {k: copy.copy(node[k]) for k in _COPIED if k in node}
    if "x-kubernetes-validations" in node:  # the rule first, then its message
        out["x-kubernetes-validations"] = [
            {"rule": v["rule"], "message": v["message"], **v}
            for v in node["x-kubernetes-validations"]
        ]
    if "description" in node:
        out["description"] = node["description"]
    for bound, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node:
            out[inclusive], out[bound] = node[bound], True
    kind = node.get("type")
    if "anyOf" in node:
        types = sorted(branch.get("type", "?") for branch in node["anyOf"])
        if types != ["integer", "string"]:
            raise ValueError(f"{where}: no structural schema for the union {types}")
        out["x-kubernetes-int-or-string"] = True
    elif "const" in node:
        out["type"], out["enum"] = _json_type(node["const"], where), [node["const"]]
    elif kind == "object":
        out["type"] = "object"
        out.update(_object(node, defs, where))
    elif kind == "array":
        out["type"] = "array"
        items = node.get("prefixItems")
        if items:
            if any(item != items[0] for item in items):
                raise ValueError(f"{where}: a tuple of mixed types has no structural schema")
            out["items"] = _schema(items[0], defs, f"{where}[]")
        else:
            out["items"] = _schema(node["items"], defs, f"{where}[]")
    elif kind in _SCALARS:
        out["type"] = kind
    else:
        raise ValueError(f"{where}: no structural schema for {node}")
    return _ordered(out)


def _object(node: dict[str, Any], defs: dict[str, Any], where: str) -> dict[str, Any]:
    properties = node.get("properties")
    if not properties:
        values = node.get("additionalProperties")
        if isinstance(values, dict):  # dict[str, X]
            return {"additionalProperties": _schema(values, defs, f"{where}{{}}")}
        return {"x-kubernetes-preserve-unknown-fields": True}  # dict[str, Any]
    required = node.get("required", [])
    out: dict[str, Any] = {"properties": {
        name: _property(prop, defs, f"{where}.{name}".lstrip("."), name in required)
        for name, prop in properties.items()
    }}
    if required:
        out["required"] = list(required)
    return out


def _property(prop: dict[str, Any], defs: dict[str, Any], where: str, required: bool) -> dict:
    out = _schema(prop, defs, where)
    if not out.get("description"):
        raise ValueError(f"{where} has no description: give its pydantic field one")
    default = prop.get("default")
    if default not in (None, [], {}):
        out["default"] = default
    elif "$ref" in prop and not required:  # a nested model with a default_factory
        out["default"] = {}
    return _ordered(out)


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline a ``$ref`` (its siblings win) and drop the ``null`` branch of ``X | None``."""
    branches = node.get("anyOf")
    if branches and {"type": "null"} in branches:
        rest = [b for b in branches if b != {"type": "null"}]
        node = {k: v for k, v in node.items() if k != "anyOf"}
        node = {**node, **rest[0]} if len(rest) == 1 else {**node, "anyOf": rest}
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[1]]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _json_type(value: Any, where: str) -> str:
    for kind, python in (("boolean", bool), ("integer", int), ("number", float), ("string", str)):
        if isinstance(value, python):
            return kind
    raise ValueError(f"{where}: no JSON type for {value!r}")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    unknown = set(node) - set(_KEY_ORDER)
    if unknown:
        raise ValueError(f"schema keys without a place: {sorted(unknown)}")
    return {k: node[k] for k in _KEY_ORDER if k in node}
