"""The ElasticTrainingJob CRD: generated from tidal_api, structural, and as strict as parse_job.

The checked-in YAML is what `kubectl apply` sees, so the tests read it (and check that it is the
generator's output). An admission pipeline in the API server's order (prune nulls, default,
validate the schema with a JSON-schema validator, run the CEL rules with a CEL evaluator) must
accept what ``parse_job`` accepts and refuse what it refuses, with the same messages.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import importlib.util
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import annotated_types
import celpy
import jsonschema
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from tidal_api import huggingface
from tidal_api import spec as spec_module
from tidal_api import (
    Arrival,
    Condition,
    ElasticTrainingJob,
    JobSpec,
    JobSpecError,
    JobStatus,
    Layout,
    ScaleTable,
    Target,
    WorkersSpec,
    parse_job,
)

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "elastictrainingjobs.tidal.dev.yaml"
GEN_CRD = ROOT / "tools" / "gen_crd.py"
CRD = yaml.safe_load(CRD_FILE.read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
MISSING = object()


# What every manifest must give: what to train, on how many workers.
REQUIRED = {"workers": {"min": 2, "max": 8}, "model": {"layers": 6, "dModel": 64, "heads": 4}}
HF_SIZES = {"num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 4,
            "vocab_size": 256}  # REQUIRED's model's, as a Hugging Face config states them


def _doc(spec: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """A manifest with ``spec``, whose ``workers`` and ``model`` fields go over REQUIRED's."""
    spec = dict(spec or {})
    for key, value in REQUIRED.items():
        spec[key] = {**value, **spec.get(key, {})}
    return _bare(spec, **top)


def _bare(spec: dict[str, Any] | None, **top: Any) -> dict[str, Any]:
    """A manifest with ``spec`` as it is (none if None)."""
    doc = {"apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob",
           "metadata": {"name": "x"}, **top}
    if spec is not None:
        doc["spec"] = spec
    return doc


# --- (a) the checked-in YAML is the generator's output --------------------------------------


def _gen_crd_module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gen_crd", GEN_CRD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_crd_is_the_generators_output():
    assert CRD_FILE.read_text() == _gen_crd_module().render(), "run: python tools/gen_crd.py"


def test_gen_crd_check_refuses_a_stale_file_and_rewrites_it(tmp_path):
    stale = tmp_path / "crd.yaml"
    stale.write_text(CRD_FILE.read_text().replace("- etj", "- tj"))

    def gen(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(GEN_CRD), *args], capture_output=True,
                              text=True, timeout=60)

    refused = gen("--check", str(stale))
    assert refused.returncode == 1 and "out of date" in refused.stderr
    assert gen(str(stale)).returncode == 0
    assert gen("--check", str(stale)).returncode == 0
    assert stale.read_text() == CRD_FILE.read_text()


def test_names_version_subresource_and_columns():
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "elastictrainingjobs.tidal.dev"
    assert (spec["group"], spec["scope"]) == ("tidal.dev", "Namespaced")
    assert spec["names"] | {"categories": None} == {
        "kind": "ElasticTrainingJob", "listKind": "ElasticTrainingJobList",
        "plural": "elastictrainingjobs", "singular": "elastictrainingjob",
        "shortNames": ["etj"], "categories": None}
    [version] = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: (c["type"], c["jsonPath"]) for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Workers": ("integer", ".status.workers"), "PP": ("integer", ".status.layout.pp"),
        "DP": ("integer", ".status.layout.dp"), "Step": ("integer", ".status.step"),
        "Phase": ("string", ".status.phase"), "Restarts": ("integer", ".status.restarts"),
        "Age": ("date", ".metadata.creationTimestamp"),
    }
    wide = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority")]
    assert wide == ["Restarts"]  # kubectl get -o wide
    for type_, path in columns.values():  # every column shows a field the schema has
        if not path.startswith(".metadata."):
            node = SCHEMA
            for name in path.strip(".").split("."):
                node = node["properties"][name]
            assert node["type"] == type_, path


# --- (b) the types and the schema agree, both ways ------------------------------------------

_SCALAR_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}
_BOUND_KEYS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "maxLength",
               "pattern")


def _fields(model: type) -> dict[str, Any]:
    """A model's fields by wire name; a stdlib dataclass's (the layout) as pydantic sees them."""
    if dataclasses.is_dataclass(model):
        hints = get_type_hints(model, include_extras=True)
        alias = model.__pydantic_config__["alias_generator"]
        return {
            alias(f.name): FieldInfo.from_annotated_attribute(
                hints[f.name],
                PydanticUndefined if f.default is dataclasses.MISSING else f.default)
            for f in dataclasses.fields(model)
        }
    return {field.alias or name: field for name, field in model.model_fields.items()}


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        return rest[0] if len(rest) == 1 else Union[tuple(rest)]  # noqa: UP007
    return annotation


def _check_model(model: type, node: dict, where: str) -> None:
    fields, properties = _fields(model), node["properties"]
    assert node["type"] == "object", where
    name = model.__name__
    assert set(properties) - set(fields) == set(), f"{where}: in the schema, not in {name}"
    assert set(fields) - set(properties) == set(), f"{where}: in {name}, not in the schema"
    required = {alias for alias, field in fields.items() if field.is_required()}
    assert set(node.get("required", [])) == required, where
    for alias, field in fields.items():
        _check_field(field, properties[alias], f"{where}.{alias}")
    if where.startswith("spec"):
        # A spec validator without a CEL twin would let the API server store a job that the
        # operator then refuses. (Status is written only through these types, by our agent.)
        has_validator = bool(model.__pydantic_decorators__.model_validators)
        has_rule = bool(node.get("x-kubernetes-validations"))
        assert has_validator == has_rule, f"{where}: a model validator needs a CEL rule"


def _check_field(field: Any, node: dict, where: str) -> None:
    assert field.description and node.get("description") == field.description, where
    annotation = _without_none(field.annotation)
    _check_type(annotation, node, where)
    expected: dict[str, Any] = {}
    for bound in field.metadata:
        if isinstance(bound, annotated_types.Ge):
            expected["minimum"] = bound.ge
        elif isinstance(bound, annotated_types.Gt):
            expected |= {"minimum": bound.gt, "exclusiveMinimum": True}
        elif isinstance(bound, annotated_types.Le):
            expected["maximum"] = bound.le
        elif isinstance(bound, annotated_types.Lt):
            expected |= {"maximum": bound.lt, "exclusiveMaximum": True}
        elif isinstance(bound, annotated_types.MaxLen):
            expected["maxLength"] = bound.max_length
        elif getattr(bound, "pattern", None) is not None:
            expected["pattern"] = bound.pattern
        else:
            pytest.fail(f"{where}: no check for the constraint {bound!r}: teach this test")
    assert {k: node[k] for k in _BOUND_KEYS if k in node} == expected, where
    assert node.get("default", MISSING) == _expected_default(field), where


def _expected_default(field: Any) -> Any:
    """A nested model defaults to {} (its fields' defaults fill it in); absent means empty."""
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return {}
        assert value in ({}, []), "only empty collections as default factories"
        return MISSING
    default = field.default
    if default is PydanticUndefined or default is None or (
            isinstance(default, tuple | dict) and not default):
        return MISSING
    return list(default) if isinstance(default, tuple) else default


def _check_type(annotation: Any, node: dict, where: str) -> None:
    origin, args = get_origin(annotation), get_args(annotation)
    if isinstance(annotation, type) and (
            issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)):
        _check_model(annotation, node, where)
    elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        assert (node["type"], node["enum"]) == ("string", [m.value for m in annotation]), where
    elif origin is Literal:
        assert (node["type"], node["enum"]) == ("string", list(args)), where
    elif origin in (Union, types.UnionType):
        assert set(args) == {int, str}, where
        assert node.get("x-kubernetes-int-or-string") is True and "type" not in node, where
    elif origin is tuple:
        assert node["type"] == "array", where
        if args[1:] == (Ellipsis,):
            assert "minItems" not in node and "maxItems" not in node, where
        else:
            assert len(set(args)) == 1, f"{where}: a tuple of mixed types"
            assert node["minItems"] == node["maxItems"] == len(args), where
        _check_type(args[0], node["items"], f"{where}[]")
    elif origin is dict:
        assert args[0] is str and node["type"] == "object" and "properties" not in node, where
        if args[1] is Any:
            assert node.get("x-kubernetes-preserve-unknown-fields") is True, where
        else:
            _check_type(args[1], node["additionalProperties"], f"{where}{{}}")
    elif annotation in _SCALAR_TYPES:
        assert node["type"] == _SCALAR_TYPES[annotation], where
        assert "enum" not in node, where
    else:
        pytest.fail(f"{where}: no check for the type {annotation!r}: teach this test")


def test_root_properties_are_the_jobs_fields():
    assert list(SCHEMA["properties"]) == list(_fields(ElasticTrainingJob))
    assert SCHEMA["properties"]["metadata"] == {"type": "object"}
    assert SCHEMA["description"] == ElasticTrainingJob.__doc__


@pytest.mark.parametrize("name", ["spec", "status"])
def test_types_and_schema_agree_both_ways(name):
    _check_field(_fields(ElasticTrainingJob)[name], SCHEMA["properties"][name], name)


def _drop_max(node):
    del node["properties"]["max"]


@pytest.mark.parametrize("mutate", [
    _drop_max,
    lambda node: node["properties"].update(maxWorkers={"type": "integer", "description": "x"}),
    lambda node: node["properties"]["min"].update(default=3),
    lambda node: node["properties"]["min"].update(minimum=0),
    lambda node: node["properties"]["min"].update(type="number"),
    lambda node: node["properties"]["max"].update(description="Other words."),
    lambda node: node.pop("x-kubernetes-validations"),
])
def test_the_walk_sees_a_schema_that_drifted(mutate):
    node = copy.deepcopy(SCHEMA["properties"]["spec"]["properties"]["workers"])
    _check_model(WorkersSpec, node, "spec.workers")  # as checked in: agrees
    mutate(node)
    with pytest.raises(AssertionError):
        _check_model(WorkersSpec, node, "spec.workers")


# --- (c) admission: the API server's steps, with a real JSON-schema validator and CEL ---------


def _json_schema(node: dict) -> dict:
    """The structural schema as JSON Schema draft 4 (OpenAPI v3.0's boolean exclusive bounds).

    Unknown fields are refused, as the API server's strict field validation (kubectl's
    default) does; int-or-string is spelled out.
    """
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node:
        out["properties"] = {k: _json_schema(v) for k, v in node["properties"].items()}
        out["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _json_schema(node["additionalProperties"])
    if "items" in node:
        out["items"] = _json_schema(node["items"])
    return out


VALIDATOR = jsonschema.Draft4Validator(_json_schema(SCHEMA))
CEL = celpy.Environment()


@functools.cache
def _cel_program(expression: str) -> Any:
    return CEL.program(CEL.compile(expression))


def _without_nulls(value: Any) -> Any:
    """Nulls of non-nullable fields are pruned before defaulting (none is nullable here)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _defaulted(node: dict, value: Any) -> Any:
    """Structural defaulting: absent properties get their default, nested ones too."""
    if isinstance(value, dict) and "properties" in node:
        properties = node["properties"]
        out = {k: _defaulted(properties[k], v) if k in properties else v for k, v in value.items()}
        for name, prop in properties.items():
            if name not in out and "default" in prop:
                out[name] = _defaulted(prop, copy.deepcopy(prop["default"]))
        return out
    if isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
        return {k: _defaulted(node["additionalProperties"], v) for k, v in value.items()}
    if isinstance(value, list) and "items" in node:
        return [_defaulted(node["items"], v) for v in value]
    return value


def _cel_failures(node: dict, value: Any) -> list[tuple[str, str]]:
    """The CEL rules that ``value`` breaks, at every level, each with its message."""
    failures = []
    if isinstance(value, dict):
        activation = {"self": celpy.json_to_cel(value)}
        for rule in node.get("x-kubernetes-validations", []):
            verdict = _cel_program(rule["rule"]).evaluate(activation)
            assert isinstance(verdict, celpy.celtypes.BoolType), (rule, verdict)
            if not verdict:
                expression = rule.get("messageExpression")
                message = (str(_cel_program(expression).evaluate(activation))
                           if expression else rule["message"])
                failures.append((rule["rule"], message))
        for name, item in value.items():
            if name in node.get("properties", {}):
                failures += _cel_failures(node["properties"][name], item)
    elif isinstance(value, list) and "items" in node:
        for item in value:
            failures += _cel_failures(node["items"], item)
    return failures


def _admit(doc: dict) -> list[str]:
    """The errors the API server would answer a create with; [] when it stores the object."""
    doc = _defaulted(SCHEMA, _without_nulls(doc))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in VALIDATOR.iter_errors(doc)]
    return errors or [message for _, message in _cel_failures(SCHEMA, doc)]


def _example_jobs() -> list[Any]:
    jobs = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "ElasticTrainingJob":
                jobs.append(pytest.param(doc, id=path.name))
    return jobs


def test_the_examples_include_the_elastic_one():
    names = [param.id for param in _example_jobs()]
    assert "tiny.yaml" in names and "elastic-small.yaml" in names


@pytest.mark.parametrize("doc", _example_jobs())
def test_examples_are_admitted_and_parse(doc):
    assert _admit(doc) == []
    parse_job(doc)


def test_api_server_defaults_are_the_pydantic_defaults():
    defaulted = _defaulted(SCHEMA, _doc())
    spec = JobSpec.model_validate(REQUIRED)
    expected = spec.model_dump(mode="json", by_alias=True, exclude_none=True)

    def without_empty(value: Any) -> Any:  # absent means empty, so the CRD leaves them out
        if isinstance(value, dict):
            value = {k: without_empty(v) for k, v in value.items()}
            return {k: v for k, v in value.items() if v not in ({}, [])}
        return value

    assert without_empty(defaulted["spec"]) == without_empty(expected)
    assert parse_job(defaulted).spec == spec
    assert "status" not in defaulted


# Each cross-field rule: the API server's message is the one parse_job gives.
CEL_REFUSALS = [
    ({"workers": {"min": 4, "max": 2}}, "workers.min (4) must not exceed workers.max (2)"),
    ({"workers": {"min": 10}}, "workers.min (10) must not exceed workers.max (8)"),
    ({"workers": {"min": 2, "max": 8, "preferred": 9}},
     "workers.preferred (9) must lie between workers.min (2) and workers.max (8)"),
    ({"model": {"dModel": 30, "heads": 4}}, "model.heads (4) must divide model.dModel (30)"),
    ({"training": {"globalBatchSize": 10, "microBatchSize": 4}},
     "training.microBatchSize (4) must divide training.globalBatchSize (10)"),
    ({"training": {"data": {"kind": "tokens"}}},
     "training.data.path is required when training.data.kind is tokens"),
    ({"training": {"data": {"kind": "tokens", "path": ""}}},
     "training.data.path is required when training.data.kind is tokens"),
    ({"training": {"data": {"kind": "prepared"}}},
     "training.data.path is required when training.data.kind is prepared"),
    ({"model": {"huggingface": {"config": {**HF_SIZES, "model_type": "bert"}}}},
     huggingface.HF_KIND),
    ({"model": {"huggingface": {"config": {**HF_SIZES, "model_type": "llama",
                                           "num_hidden_layers": 5}}}},
     huggingface.HF_SIZES_MESSAGE),
    ({"model": {"huggingface": {"config": {**HF_SIZES, "model_type": "llama"}, "path": "/m"}}},
     huggingface.HF_SOURCE),
    ({"model": {"huggingface": {}}}, huggingface.HF_SOURCE),
    ({"parallelism": {"logicalReplicas": 6}}, spec_module._LOGICAL),
    ({"priorityClassName": "high"}, spec_module._PRIORITY_NEEDS_QUEUE),
]


@pytest.mark.parametrize(("spec", "message"), CEL_REFUSALS)
def test_cel_rules_refuse_what_parse_job_refuses_with_its_message(spec, message):
    assert _admit(_doc(spec)) == [message]
    with pytest.raises(JobSpecError) as err:
        parse_job(_doc(spec))
    assert message in str(err.value)


def test_every_cel_rule_has_a_refusal_case():
    rules, stack = set(), [SCHEMA]
    while stack:
        node = stack.pop()
        rules |= {r["rule"] for r in node.get("x-kubernetes-validations", [])}
        stack += node.get("properties", {}).values()
        stack += [node["items"]] if "items" in node else []
    broken = {rule for spec, _ in CEL_REFUSALS
              for rule, _ in _cel_failures(SCHEMA, _defaulted(SCHEMA, _doc(spec)))}
    assert rules == broken and len(rules) == 10


@pytest.mark.parametrize(("spec", "where"), [
    ({"model": {"layerz": 3}}, "spec.model"),
    ({"parallelism": {"schedule": "fast"}}, "spec.parallelism.schedule"),
    ({"training": {"lr": 0}}, "spec.training.lr"),
    ({"model": {"dropout": 1.0}}, "spec.model.dropout"),
    ({"model": {"vocab": 262_145}}, "spec.model.vocab"),
    ({"workers": {"min": 0}}, "spec.workers.min"),
    ({"training": {"betas": [0.9]}}, "spec.training.betas"),
    ({"gpusPerWorker": "two"}, "spec.gpusPerWorker"),
    ({"template": {"imagePullPolicy": "Sometimes"}}, "spec.template.imagePullPolicy"),
    ({"template": {"resources": {"requests": {"cpu": 0.5}}}},
     "spec.template.resources.requests.cpu"),
    ({"template": {"labels": {"team": 1}}}, "spec.template.labels.team"),
    ({"template": {"tolerations": ["gpu"]}}, "spec.template.tolerations.0"),
    ({"template": {"command": ["sh"]}}, "spec.template"),
    ({"workers": {"max": 4097}}, "spec.workers.max"),
    ({"training": {"steps": 10_000_001}}, "spec.training.steps"),
    ({"model": {"seqLen": 2**20 + 1}}, "spec.model.seqLen"),
    ({"training": {"globalBatchSize": 2**20 + 2}}, "spec.training.globalBatchSize"),
    ({"queueName": "Team_A"}, "spec.queueName"),
    ({"queueName": "q", "priorityClassName": "x" * 254}, "spec.priorityClassName"),
])
def test_schema_refuses_what_parse_job_refuses(spec, where):
    errors = _admit(_doc(spec))
    assert errors and all(e.startswith(f"{where}: ") for e in errors), errors
    with pytest.raises(JobSpecError):
        parse_job(_doc(spec))


@pytest.mark.parametrize(("spec", "where"), [
    (None, ""), ({}, "spec"), ({"model": REQUIRED["model"]}, "spec"),
    ({"workers": REQUIRED["workers"]}, "spec"),
    ({"workers": {"min": 2}, "model": REQUIRED["model"]}, "spec.workers"),
    ({"workers": REQUIRED["workers"], "model": {"dModel": 64, "heads": 4}}, "spec.model"),
])
def test_what_to_train_and_on_how_many_workers_is_required(spec, where):
    errors = _admit(_bare(spec))
    assert errors and all(e.startswith(f"{where}: ") and "is a required property" in e
                          for e in errors), errors
    with pytest.raises(JobSpecError, match="required"):
        parse_job(_bare(spec))


@settings(max_examples=60, deadline=None)
@given(
    workers=st.fixed_dictionaries({}, optional={"min": st.integers(-1, 10),
                                                "max": st.integers(-1, 10)}),
    model=st.fixed_dictionaries({"layers": st.integers(0, 3)}, optional={
        "dModel": st.integers(0, 48), "heads": st.integers(0, 8)}),
    training=st.fixed_dictionaries({}, optional={
        "globalBatchSize": st.integers(0, 24), "microBatchSize": st.integers(0, 8),
        "data": st.fixed_dictionaries({}, optional={
            "kind": st.sampled_from(["synthetic", "tokens", "prepared"]),
            "path": st.sampled_from(["", "/data/train.bin", None])}),
    }),
)
def test_api_server_and_parse_job_agree(workers, model, training):
    doc = _bare({"workers": workers, "model": model, "training": training})
    try:
        parse_job(doc)
        parsed = True
    except JobSpecError:
        parsed = False
    assert (_admit(doc) == []) == parsed, _admit(doc)


def test_a_full_status_is_admitted_and_survives_defaulting():
    table = ScaleTable.model_validate_json(
        (ROOT / "examples" / "scale-tables" / "flextrain-small-pp.json").read_text())
    status = JobStatus(
        phase="Scaling", workers=4, generation=3, step=120, loss=2.5, tokens_per_second=1.4e6,
        members=("j-worker-0", "j-worker-1", "j-worker-2", "j-worker-3"),
        target=Target(workers=3, generation=4, reason="PendingGPUPods",
                      release=("j-worker-3",), issued_at="2026-01-01T00:00:00Z",
                      deadline="2026-01-01T00:05:00Z"),
        conditions=(Condition(type="Valid", status="True", reason="SpecValid",
                              last_transition_time="2026-01-01T00:00:00Z"),),
        layout=Layout(dp=1, pp=4, partition=(5, 4, 4, 2), schedule="1f1b",
                      micro_batch_size=1, num_micro_batches=1024),
        scale_table=table,
        arrivals=(Arrival(pod="batch/train-7", created_at="2026-01-01T00:00:00Z"),),
        rendezvous_missing_since="2026-01-01T00:04:00Z",
    )
    doc = _doc(status=status.model_dump(mode="json", by_alias=True))
    assert _admit(doc) == []
    defaulted = _defaulted(SCHEMA, _without_nulls(doc))
    assert JobStatus.model_validate(defaulted["status"]) == status
    bad = copy.deepcopy(doc)
    bad["status"]["scaleTable"]["rows"][0]["layout"]["schedule"] = "fast"
    assert _admit(bad) and _admit(bad)[0].startswith(
        "status.scaleTable.rows.0.layout.schedule: ")


# --- (d) the schema is structural ------------------------------------------------------------

# The fields of apiextensions.k8s.io/v1 JSONSchemaProps.
_SCHEMA_KEYS = {
    "description", "type", "format", "title", "default", "maximum", "exclusiveMaximum",
    "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems",
    "uniqueItems", "multipleOf", "enum", "maxProperties", "minProperties", "required", "items",
    "allOf", "oneOf", "anyOf", "not", "properties", "additionalProperties", "nullable",
    "externalDocs", "example", "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-embedded-resource", "x-kubernetes-int-or-string", "x-kubernetes-list-map-keys",
    "x-kubernetes-list-type", "x-kubernetes-map-type", "x-kubernetes-validations",
    # in JSONSchemaProps, but refused in a CRD's structural schema:
    "$ref", "$schema", "id", "definitions", "patternProperties", "dependencies",
    "additionalItems",
}
_REFUSED = {"$ref", "$schema", "id", "definitions", "patternProperties", "dependencies",
            "additionalItems"}
_JUNCTORS = {"allOf", "oneOf", "anyOf", "not"}
_RULE_KEYS = {"rule", "message", "messageExpression", "reason", "fieldPath", "optionalOldSelf"}


def structural_problems(node: dict, where: str = "") -> list[str]:
    """Where ``node`` breaks Kubernetes' structural-schema rules (or ours, a little stricter).

    Every node has a type (unless int-or-string or preserve-unknown-fields); no $ref and no
    junctors (Kubernetes allows value validation in them; the generator needs none);
    properties and additionalProperties exclude each other; arrays have one items schema;
    metadata at the root is not restricted (not even described); every property is described;
    defaults validate against their node; CEL rules compile and have a one-line message.
    """
    at = where or "(root)"
    problems = [f"{at}: unknown key {k}" for k in sorted(set(node) - _SCHEMA_KEYS)]
    problems += [f"{at}: {k} is not allowed in a CRD" for k in sorted(set(node) & _REFUSED)]
    problems += [f"{at}: {k}: the generator emits no junctors"
                 for k in sorted(set(node) & _JUNCTORS)]
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    if not node.get("type") and not (int_or_string or preserve):
        problems.append(f"{at}: no type")
    if int_or_string and "type" in node:
        problems.append(f"{at}: x-kubernetes-int-or-string with a type")
    if preserve and node.get("type") != "object":
        problems.append(f"{at}: preserve-unknown-fields on a non-object")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{at}: properties and additionalProperties together")
    if "additionalProperties" in node and not isinstance(node["additionalProperties"], dict):
        problems.append(f"{at}: additionalProperties must be a schema")
    if node.get("uniqueItems"):
        problems.append(f"{at}: uniqueItems: true is refused (quadratic)")
    if (node.get("type") == "array") != isinstance(node.get("items"), dict):
        problems.append(f"{at}: items is one schema, exactly on arrays")
    if set(node.get("required", [])) - set(node.get("properties", {})):
        problems.append(f"{at}: required names a field that does not exist")
    if "default" in node and not jsonschema.Draft4Validator(_json_schema(node)).is_valid(
            node["default"]):
        problems.append(f"{at}: default does not validate")
    for rule in node.get("x-kubernetes-validations", []):
        problems += _rule_problems(rule, at)
    properties = node.get("properties", {})
    if not where:
        if node.get("type") != "object":
            problems.append("(root): not an object")
        if properties.get("metadata", {"type": "object"}) != {"type": "object"}:
            problems.append("metadata: restricts or describes metadata")
    for name, prop in properties.items():
        path = f"{where}.{name}".lstrip(".")
        if not (where == "" and name == "metadata") and not prop.get("description"):
            problems.append(f"{path}: no description")
        problems += structural_problems(prop, path)
    for key, suffix in (("items", "[]"), ("additionalProperties", "{}")):
        if isinstance(node.get(key), dict):
            problems += structural_problems(node[key], f"{where}{suffix}")
    return problems


def _rule_problems(rule: dict, at: str) -> list[str]:
    problems = [f"{at}: unknown rule key {k}" for k in sorted(set(rule) - _RULE_KEYS)]
    message = rule.get("message", "")
    if not message or "\n" in message:
        problems.append(f"{at}: a rule needs a one-line message")
    for key in ("rule", "messageExpression"):
        if key in rule:
            try:
                CEL.compile(rule[key])
            except celpy.CELParseError as err:
                problems.append(f"{at}: {key} does not compile: {err}")
    return problems


def test_schema_is_structural():
    assert structural_problems(SCHEMA) == []
    jsonschema.Draft4Validator.check_schema(_json_schema(SCHEMA))


@pytest.mark.parametrize(("schema", "problem"), [
    ({"type": "object", "properties": {"spec": {"description": "d"}}}, "spec: no type"),
    ({"type": "object", "properties": {"spec": {"type": "object"}}}, "spec: no description"),
    ({"type": "object", "properties": {"metadata": {"type": "object", "description": "m"}}},
     "metadata: restricts"),
    ({"type": "object", "properties": {"a": {"description": "d", "$ref": "#/x"}}}, "$ref"),
    ({"type": "object", "properties": {"a": {"description": "d", "type": "object",
      "properties": {}, "additionalProperties": {"type": "string"}}}}, "properties and addit"),
    ({"type": "object", "properties": {"a": {"description": "d", "anyOf": [{"type": "integer"}]}}},
     "junctors"),
    ({"type": "object", "properties": {"a": {"description": "d", "type": "array"}}}, "items"),
    ({"type": "object", "properties": {"a": {"description": "d", "type": "integer",
      "minimum": 1, "default": 0}}}, "default does not validate"),
    ({"type": "object", "x-kubernetes-validations": [{"rule": "self.a <=", "message": "m"}]},
     "does not compile"),
    ({"type": "object", "x-kubernetes-validations": [{"rule": "true"}]}, "one-line message"),
])
def test_structural_checker_finds_problems(schema, problem):
    assert any(problem in p for p in structural_problems(schema)), structural_problems(schema)
