"""Layouts: who computes which placement units and micro-batches.

The global batch is a fixed ordered list of micro-batches and the model a fixed ordered list
of placement units; a layout only decides which rank computes what. Stage ``s`` of a layout with
``pp`` ranks and ``v`` virtual stages per rank runs on pipeline rank ``s % pp`` (the looped
placement of interleaved 1F1B; with ``v == 1`` stage ``s`` is rank ``s``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ScheduleKind(str, Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zb"


class LayoutError(ValueError):
    """A layout that cannot be built; the message says how to fix it."""


def even_partition(num_units: int, num_stages: int) -> tuple[int, ...]:
    """Contiguous units per stage, as even as possible, larger stages first."""
    if not 1 <= num_stages <= num_units:
        raise LayoutError(
            f"cannot split {num_units} units into {num_stages} stages: "
            f"use between 1 and {num_units} stages"
        )
    base, extra = divmod(num_units, num_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(num_stages))


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """A parallel layout of one training step.

    ``partition`` gives the number of contiguous placement units of each stage, in stage order;
    it has ``pp * virtual_stages`` entries. ``num_micro_batches`` is per data-parallel replica:
    replica ``r`` computes global micro-batches ``r * num_micro_batches`` onwards. World rank
    ``replica * pp + pipeline rank`` holds a position.
    """

    pp: int
    partition: tuple[int, ...]
    micro_batch_size: int
    num_micro_batches: int
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    virtual_stages: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", ScheduleKind(self.schedule))
        object.__setattr__(self, "partition", tuple(self.partition))
        if self.pp < 1 or self.dp < 1:
            raise LayoutError(f"pp ({self.pp}) and dp ({self.dp}) must be at least 1")
        if self.virtual_stages < 1:
            raise LayoutError(f"virtual_stages ({self.virtual_stages}) must be at least 1")
        if self.virtual_stages > 1 and self.schedule is not ScheduleKind.INTERLEAVED:
            raise LayoutError(
                f"virtual_stages={self.virtual_stages} needs the interleaved schedule, "
                f"not {self.schedule.value}"
            )
        if len(self.partition) != self.num_stages:
            raise LayoutError(
                f"partition {list(self.partition)} has {len(self.partition)} stages; "
                f"pp={self.pp} x virtual_stages={self.virtual_stages} needs {self.num_stages}"
            )
        if any(n < 1 for n in self.partition):
            raise LayoutError(
                f"partition {list(self.partition)} has an empty stage: every stage needs a unit"
            )
        if self.micro_batch_size < 1 or self.num_micro_batches < 1:
            raise LayoutError("micro-batch size and count must be at least 1")

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def num_units(self) -> int:
        return sum(self.partition)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    def stage_rank(self, stage: int) -> int:
        """Pipeline rank that runs ``stage``."""
        return stage % self.pp

    def rank_stages(self, rank: int) -> tuple[int, ...]:
        """Stages of pipeline rank ``rank``, in stage order."""
        return tuple(range(rank, self.num_stages, self.pp))

    def stage_units(self, stage: int) -> range:
        """Placement units of ``stage``, a contiguous range."""
        start = sum(self.partition[:stage])
        return range(start, start + self.partition[stage])

    def unit_stage(self, unit: int) -> int:
        """Stage that holds placement unit ``unit``."""
        end = 0
        for stage, count in enumerate(self.partition):
            end += count
            if unit < end:
                return stage
        raise LayoutError(f"unit {unit} is outside the {self.num_units} units of this layout")

    def describe(self) -> str:
        """Short human form, e.g. ``dp1 pp3 [3,2,3] 1f1b 2x8``."""
        parts = ",".join(str(n) for n in self.partition)
        virtual = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (
            f"dp{self.dp} pp{self.pp} [{parts}] {self.schedule.value}{virtual} "
            f"{self.micro_batch_size}x{self.num_micro_batches}"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "dp": self.dp,
            "pp": self.pp,
            "partition": list(self.partition),
            "micro_batch_size": self.micro_batch_size,
            "num_micro_batches": self.num_micro_batches,
            "schedule": self.schedule.value,
            "virtual_stages": self.virtual_stages,
        }


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
    )
