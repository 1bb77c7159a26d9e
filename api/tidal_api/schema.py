"""The base of the contract's spec types: camelCase on the wire, frozen, unknown fields refused,
and each model validator's CEL twin for the CRD (the API server's copy of the check)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class JobSpecError(ValueError):
    """A job manifest that cannot be run; the message is one line that says how to fix it."""


class Spec(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )


def cel(rule: str, message: str, message_expression: str | None = None) -> ConfigDict:
    """A model's CEL rule for the CRD: the API server's copy of its model validator.

    ``messageExpression`` gives the validator's own message with the values; ``message`` is the
    fallback where the expression cannot be evaluated (and all there is without values).
    """
    return cel_rules(cel_rule(rule, message, message_expression))


def cel_rule(rule: str, message: str, message_expression: str | None = None) -> dict[str, str]:
    validation = {"rule": rule, "message": message}
    if message_expression:
        validation["messageExpression"] = message_expression
    return validation


def cel_rules(*validations: dict[str, str]) -> ConfigDict:
    """A model's CEL rules, one per model validator (see :func:`cel`)."""
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": list(validations)})
