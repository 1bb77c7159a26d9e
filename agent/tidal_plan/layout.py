"""Building layouts: the even split of units over stages, and a layout checked against a model.

The layout type itself (``Layout``, ``ScheduleKind``, ``LayoutError``) is the contract's
(``tidal_api.layout``): the planner, the scale table and the status share it.
"""

from __future__ import annotations

from tidal_api import ElasticTrainingJob
from tidal_api.layout import Layout, LayoutError, ScheduleKind


def even_partition(num_units: int, num_stages: int) -> tuple[int, ...]:
    """Contiguous units per stage, as even as possible, larger stages first."""
    if not 1 <= num_stages <= num_units:
        raise LayoutError(
            f"cannot split {num_units} units into {num_stages} stages: "
            f"use between 1 and {num_units} stages"
        )
    base, extra = divmod(num_units, num_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(num_stages))


def build_layout(
    *,
    num_units: int,
    workers: int,
    micro_batch_size: int,
    num_micro_batches: int,
    schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B,
    partition: tuple[int, ...] | None = None,
    virtual_stages: int = 1,
    dp: int = 1,
    activation_checkpointing: bool = False,
) -> Layout:
    """A layout of ``workers`` ranks as ``dp`` pipeline replicas, checked against the model.

    ``num_micro_batches`` is the global batch's count, split evenly over the replicas. Without
    ``partition`` the units are split as evenly as possible over the stages.
    """
    schedule = ScheduleKind(schedule)
    if dp < 1 or workers % dp:
        raise LayoutError(f"dp ({dp}) must divide the worker count ({workers})")
    if num_micro_batches % dp:
        raise LayoutError(
            f"{num_micro_batches} micro-batches do not split over dp={dp} replicas: "
            "make globalBatchSize / microBatchSize a multiple of dp"
        )
    workers //= dp
    if schedule is not ScheduleKind.INTERLEAVED:
        virtual_stages = 1
    if workers < 1:
        raise LayoutError(f"workers ({workers}) must be at least 1")
    stages = workers * virtual_stages
    if stages > num_units:
        hint = f" (x{virtual_stages} virtual stages)" if virtual_stages > 1 else ""
        raise LayoutError(
            f"{workers} workers{hint} need {stages} stages but the model has only {num_units} "
            f"placement units: use at most {num_units // virtual_stages} workers or add layers"
        )
    if partition is None:
        partition = even_partition(num_units, stages)
    elif sum(partition) != num_units:
        raise LayoutError(
            f"partition {list(partition)} covers {sum(partition)} units; the model has {num_units}"
        )
    return Layout(
        pp=workers,
        dp=dp,
        partition=tuple(partition),
        micro_batch_size=micro_batch_size,
        num_micro_batches=num_micro_batches // dp,
        schedule=schedule,
        virtual_stages=virtual_stages,
        activation_checkpointing=activation_checkpointing,
    )


def resolve_layout(
    job: ElasticTrainingJob,
    *,
    workers: int,
    schedule: str | None = None,
    partition: tuple[int, ...] | None = None,
) -> Layout:
    """The layout for ``workers`` pipeline ranks without the planner: the units split evenly
    under the CLI's schedule, else the spec's (``auto`` is 1F1B here), or a forced partition.
    Activation checkpointing is on where the spec says ``layers`` (``auto`` is the planner's
    choice: off here)."""
    spec = job.spec
    kind = schedule or spec.parallelism.schedule
    if kind == "auto":
        kind = ScheduleKind.ONE_F_ONE_B.value
    return build_layout(
        num_units=spec.model.num_units,
        workers=workers,
        micro_batch_size=spec.training.micro_batch_size,
        num_micro_batches=spec.training.num_micro_batches,
        schedule=kind,
        partition=partition,
        virtual_stages=spec.parallelism.virtual_stages,
        activation_checkpointing=spec.training.activation_checkpointing == "layers",
    )
