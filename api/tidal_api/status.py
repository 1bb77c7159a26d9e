"""ElasticTrainingJob status: who owns which field, and the protocol they speak (DESIGN.md 3).

The operator owns ``target``, ``phase``, ``conditions``, ``restarts``, ``failures`` and its
hysteresis (``lastScaleTime``, ``lastDecision``, ``observedGeneration``), and the decision state
that must outlive the operator process (``arrivals``, ``rendezvousMissingSince``): a restarted
operator reads them back and decides as the one before it would have; the agent leader owns
``generation`` (applied), ``members``, ``lost``, ``layout``, ``step``, ``loss``,
``tokensPerSecond``, ``stepSeconds``, ``predictedStepSeconds``, ``lastSwitchSeconds`` and
``scaleTable``. Each side writes only its own fields, with a merge patch on the status
subresource, so neither overwrites the other; the one exception is a restart, when no agent
runs: the operator empties ``members`` and ``lost`` with the target, for the new leader to
publish afresh.

Scale up: the operator creates the joiners' pods, then writes ``target = {workers, generation:
g+1, join: [pods]}``; the leader switches at a step boundary once every joiner waits in the
rendezvous and writes ``generation = g+1``. Scale down: ``target = {workers, generation: g+1,
release: [pods], deadline}``; the leader moves state off the released pods, which exit 0, and
the operator deletes them; past the deadline it deletes them anyway.

The operator writes its fields through these types too (:func:`status_patch`), so the wire
form of each is declared once, here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from tidal_api.layout import Layout
from tidal_api.scale import ScaleTable

Phase = Literal["Pending", "Running", "Scaling", "Restarting", "Succeeded", "Failed", "Invalid"]
ConditionStatus = Literal["True", "False", "Unknown"]

# Condition types the operator sets.
VALID = "Valid"  # the spec can be run; False with the reason why not
READY = "Ready"  # every worker of the applied generation is running
SCALING = "Scaling"  # a target is outstanding; its reason says up or down and why


class _Status(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class Condition(_Status):
    """A Kubernetes-style condition: one line of state with the reason it changed."""

    type: str = Field(description="Valid, Ready or Scaling.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason, e.g. IdleGPUs or PendingGPUPods.")
    message: str = Field("", description="One line for humans: what happened and why.")
    last_transition_time: str = Field(description="RFC 3339 time the status last changed.")
    observed_generation: int = Field(
        0, ge=0, description="metadata.generation of the spec this condition describes."
    )


class Target(_Status):
    """What the operator asks of the agent: a worker count, as a new generation."""

    workers: int = Field(ge=1, description="Worker pods the job should run with.")
    generation: int = Field(ge=0, description="Generation the agent reports once applied.")
    reason: str = Field("", description="Why the operator asks for this count.")
    join: tuple[str, ...] = Field((), description="Pods created for this target (scale up).")
    release: tuple[str, ...] = Field(
        (), description="Pods to drain and let go (scale down); they exit 0 once drained."
    )
    issued_at: str = Field("", description="RFC 3339 time the target was set.")
    deadline: str | None = Field(
        None, description="RFC 3339 time after which released pods are deleted anyway."
    )


class Arrival(_Status):
    """A non-elastic GPU pod the operator saw, for the arrival rate of the Poisson rule."""

    pod: str = Field(description="namespace/name of the pod.")
    created_at: str = Field(description="RFC 3339 creationTimestamp of the pod.")
    gpus: int = Field(1, ge=1, description="GPUs the pod asked for (the headroom rule's).")


class Straggler(_Status):
    """A worker the agent leader flags as a straggler (tidal_plan.stragglers)."""

    member: str = Field(description="The worker pod.")
    slowdown: float = Field(
        gt=0, description="Its seconds per decoder-layer forward over the median of the other "
        "workers', when it was flagged."
    )
    since_step: int = Field(ge=0, description="The step it was flagged at.")
    release: bool = Field(
        False, description="The agent asks the operator to release it: a pipeline without it "
        "is predicted faster than the re-planned one with it (never the leader)."
    )


class JobStatus(_Status):
    """status of an ElasticTrainingJob; every field optional until its owner writes it."""

    # The operator's fields.
    phase: Phase = Field("Pending", description="Where the job is in its life.")
    workers: int = Field(0, ge=0, description="Worker pods of the applied generation.")
    target: Target | None = Field(None, description="The operator's outstanding request.")
    conditions: tuple[Condition, ...] = Field((), description="Valid, Ready and Scaling.")
    last_scale_time: str | None = Field(
        None, description="RFC 3339 time of the last target: the cooldown counts from it."
    )
    last_decision: str | None = Field(
        None, description="The last scale decision, one line, as in its Event."
    )
    observed_generation: int = Field(
        0, ge=0, description="metadata.generation of the spec the operator last acted on."
    )
    restarts: int = Field(0, ge=0, description="Times the operator restarted the job.")
    failures: int = Field(
        0, ge=0, description="Of the restarts, those after a failure (spec.maxRestarts bounds "
        "them), not after a leader asked to stop."
    )
    arrivals: tuple[Arrival, ...] = Field(
        (), description="The non-elastic GPU pods created within spec.scaling."
        "arrivalWindowSeconds, oldest first, also those already gone: the arrival rate the "
        "scale-up rule estimates from them outlives the operator process."
    )
    rendezvous_missing_since: str | None = Field(
        None, description="RFC 3339 time the operator first missed the rendezvous pod of a "
        "job that ran: missing long enough, the job restarts."
    )
    # The agent leader's fields.
    generation: int = Field(0, ge=0, description="Generation the agent runs (applied).")
    members: tuple[str, ...] = Field(
        (), description="Pods of the applied generation, in rank order."
    )
    lost: tuple[str, ...] = Field(
        (), description="Pods the fault path declared lost, over the job's life: the operator "
                        "deletes any still running and never reuses their names."
    )
    layout: Layout | None = Field(None, description="Layout of the applied generation.")
    step: int = Field(0, ge=0, description="Optimizer steps done.")
    loss: float | None = Field(None, description="Loss of the last step.")
    tokens_per_second: float | None = Field(None, ge=0, description="Measured throughput.")
    step_seconds: float | None = Field(None, ge=0, description="Measured seconds per step.")
    predicted_step_seconds: float | None = Field(
        None, ge=0, description="The scale table's seconds per step for the applied layout."
    )
    last_switch_seconds: float | None = Field(
        None, ge=0, description="Pause of the last layout switch: the overhead the policy weighs."
    )
    stragglers: tuple[Straggler, ...] = Field(
        (), description="Workers that stay slower than the others by spec.stragglers.factor "
        "(flagged after spec.stragglers.steps steps, cleared as long after they recover)."
    )
    scale_table: ScaleTable | None = Field(None, description="The planner's scale table.")


def set_condition(conditions: tuple[Condition, ...], condition: Condition) -> tuple[Condition, ...]:
    """``conditions`` with ``condition`` in place of the one of its type (or added): its
    lastTransitionTime is kept from the old one where the status did not change."""
    out, found = [], False
    for old in conditions:
        if old.type != condition.type:
            out.append(old)
            continue
        found = True
        if old.status == condition.status:
            condition = condition.model_copy(
                update={"last_transition_time": old.last_transition_time})
        out.append(condition)
    return tuple(out) if found else (*out, condition)


def status_patch(**fields: Any) -> dict[str, Any]:
    """A merge patch of the given status fields (snake_case names, typed values), in their
    wire form: validated by JobStatus, camelCase, and None as null, which deletes the field."""
    status = JobStatus.model_validate(fields)
    return status.model_dump(mode="json", by_alias=True, include=set(fields))
