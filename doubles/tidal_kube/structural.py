"""What the API server does to a custom resource with its CRD's structural schema.

In order: prune the fields the schema does not know (and nulls of non-nullable fields), apply
the schema's defaults, then validate (types, enums, bounds, patterns, required fields) and run
the ``x-kubernetes-validations`` CEL rules. The emulator does this on every write of a custom
resource, so a field missing from the CRD vanishes and an invalid spec is refused with 422, as
in a real cluster. Tests may use it to check manifests against the CRD.

CEL: the subset of :mod:`tidal_kube.cel` is evaluated; a rule outside it, or one that reads
``oldSelf``, is not checked.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from typing import Any

from tidal_kube.cel import CelError, CelUnsupported, compile_cel

Schema = Mapping[str, Any]

_ROOT_FIELDS = ("apiVersion", "kind", "metadata")


def prepare(schema: Schema, obj: dict[str, Any]) -> list[str]:
    """Prune, default and validate ``obj`` in place; returns the errors (empty if valid).

    ``apiVersion``, ``kind`` and ``metadata`` are left alone: the server owns them.
    """
    root = {key: obj.pop(key) for key in _ROOT_FIELDS if key in obj}
    body = _default(schema, _prune(schema, obj))
    obj.clear()
    obj.update(root)
    obj.update(body)
    errors: list[str] = []
    _validate(schema, {k: v for k, v in obj.items() if k not in _ROOT_FIELDS}, "", errors)
    return errors


def _preserves(schema: Schema) -> bool:
    return bool(schema.get("x-kubernetes-preserve-unknown-fields")) or bool(
        schema.get("x-kubernetes-int-or-string")
    )


def _prune(schema: Schema, value: Any) -> Any:
    if isinstance(value, dict):
        props: Mapping[str, Schema] = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        out = {}
        for key, item in value.items():
            sub = props.get(key) if key in props else extra if isinstance(extra, Mapping) else None
            if item is None and not (sub or {}).get("nullable"):
                continue  # the server drops nulls of non-nullable fields before defaulting
            if sub is not None:
                out[key] = _prune(sub, item)
            elif _preserves(schema) or extra is True:
                out[key] = item
        return out
    if isinstance(value, list) and "items" in schema:
        return [_prune(schema["items"], item) for item in value]
    return value


def _default(schema: Schema, value: Any) -> Any:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _default(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for key in set(value) - set(schema.get("properties", {})):
                value[key] = _default(extra, value[key])
    elif isinstance(value, list) and "items" in schema:
        return [_default(schema["items"], item) for item in value]
    return value


_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
}


def _validate(schema: Schema, value: Any, path: str, errors: list[str]) -> None:
    where = path or "<root>"
    if value is None:
        return  # only nullable nulls survive pruning
    kind = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not (_TYPES["integer"](value) or isinstance(value, str)):
            errors.append(f"{where}: Invalid value: must be an integer or a string")
            return
    elif kind in _TYPES and not _TYPES[kind](value):
        errors.append(f"{where}: Invalid value: {value!r}: must be of type {kind}")
        return
    before = len(errors)
    _check_bounds(schema, value, where, errors)
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{_join(path, key)}: Required value")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key) or (extra if isinstance(extra, Mapping) else None)
            if sub is not None:
                _validate(sub, item, _join(path, key), errors)
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            _validate(schema["items"], item, f"{path}[{index}]", errors)
    for sub in schema.get("allOf", ()):
        _validate(sub, value, path, errors)
    if len(errors) == before:  # CEL rules see only values that passed the schema
        _check_rules(schema, value, where, errors)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check_bounds(schema: Schema, value: Any, where: str, errors: list[str]) -> None:
    def fail(why: str) -> None:
        errors.append(f"{where}: Invalid value: {value!r}: {why}")

    if "enum" in schema and value not in schema["enum"]:
        fail(f"supported values: {', '.join(map(repr, schema['enum']))}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        low, high = schema.get("minimum"), schema.get("maximum")
        low_open, high_open = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if low is not None and (value <= low if low_open else value < low):
            fail(f"should be greater than {'' if low_open else 'or equal to '}{low}")
        if high is not None and (value >= high if high_open else value > high):
            fail(f"should be less than {'' if high_open else 'or equal to '}{high}")
    sized = {str: ("Length", "characters"), list: ("Items", "items"),
             dict: ("Properties", "properties")}
    for typ, (suffix, unit) in sized.items():
        if isinstance(value, typ):
            if len(value) < schema.get(f"min{suffix}", 0):
                fail(f"should have at least {schema[f'min{suffix}']} {unit}")
            if f"max{suffix}" in schema and len(value) > schema[f"max{suffix}"]:
                fail(f"may have at most {schema[f'max{suffix}']} {unit}")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        fail(f"should match {schema['pattern']!r}")


def _check_rules(schema: Schema, value: Any, where: str, errors: list[str]) -> None:
    for rule in schema.get("x-kubernetes-validations", ()):
        try:
            check = compile_cel(rule["rule"])
        except CelUnsupported:
            continue
        try:
            ok = check({"self": value}) is True
        except CelError as exc:
            errors.append(f"{where}: Invalid value: {exc} evaluating rule: {rule['rule']}")
            continue
        if not ok:
            field = rule.get("fieldPath", "").lstrip(".")
            at = _join(where, field) if field else where
            errors.append(f"{at}: Invalid value: {_rule_message(rule, value)}")


def _rule_message(rule: Mapping[str, Any], value: Any) -> str:
    if "messageExpression" in rule:
        try:
            message = compile_cel(rule["messageExpression"])({"self": value})
            if isinstance(message, str) and message:
                return message
        except (CelUnsupported, CelError):
            pass
    return rule.get("message") or f"failed rule: {rule['rule']}"
