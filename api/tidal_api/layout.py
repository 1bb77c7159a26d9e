"""The layout: who computes which placement units and micro-batches (DESIGN.md section 2).

The global batch is a fixed ordered list of micro-batches and the model a fixed ordered list
of placement units; a layout only decides which rank computes what. Stage ``s`` of a layout with
``pp`` ranks and ``v`` virtual stages per rank runs on pipeline rank ``s % pp`` (the looped
placement of interleaved 1F1B; with ``v == 1`` stage ``s`` is rank ``s``).

One type serves the planner, the scale table's rows (``ScaleRow.layout``) and the status
(``status.layout``). It is a stdlib dataclass, not a pydantic model, because the planner's
search builds it by the hundred thousand and a dataclass is cheaper to build; pydantic validates
it where it is a field of the contract types (its field constraints and ``__post_init__`` both
run) and writes it camelCase on the wire (``__pydantic_config__``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Annotated, ClassVar

from pydantic import ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer
from pydantic.alias_generators import to_camel


class ScheduleKind(str, Enum):
    """A pipeline schedule: GPipe, 1F1B, interleaved 1F1B (virtual stages) or zero-bubble."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zb"


class LayoutError(ValueError):
    """A layout that cannot be built; the message says how to fix it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """A parallel layout of one training step.

    ``partition`` gives the number of contiguous placement units of each stage, in stage order;
    it has ``pp * virtual_stages`` entries. ``num_micro_batches`` is per data-parallel replica:
    replica ``r`` computes global micro-batches ``r * num_micro_batches`` onwards, unless
    ``shares`` gives each replica its own count (replicas of unequal speed: a slow one computes
    fewer), in replica order, summing to ``dp * num_micro_batches``. World rank
    ``replica * pp + pipeline rank`` holds a position.
    """

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid"
    )

    dp: Annotated[int, Field(ge=1, description="Data-parallel pipeline replicas.")] = 1
    pp: Annotated[int, Field(ge=1, description="Pipeline ranks per replica.")]
    partition: Annotated[tuple[int, ...], Field(
        description="Placement units per stage, in stage order.")]
    schedule: Annotated[ScheduleKind, Field(
        description="Pipeline schedule.")] = ScheduleKind.ONE_F_ONE_B
    virtual_stages: Annotated[int, Field(
        ge=1, description="Model chunks per rank (interleaved).")] = 1
    micro_batch_size: Annotated[int, Field(ge=1, description="Samples per micro-batch.")]
    num_micro_batches: Annotated[int, Field(
        ge=1, description="Micro-batches per replica and step.")]
    activation_checkpointing: Annotated[bool, Field(
        description="Decoder layers recompute their forward in the backward.")] = False
    shares: Annotated[tuple[int, ...], Field(
        description="Micro-batches of each replica where they differ (empty: "
                    "numMicroBatches each).")] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", ScheduleKind(self.schedule))
        object.__setattr__(self, "partition", tuple(self.partition))
        object.__setattr__(self, "shares", tuple(self.shares))
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
        if self.shares:
            self._check_shares()

    @model_serializer(mode="wrap")
    def _even_unwritten(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """Even shares (the planner's every row) stay off the wire, as in ``to_dict``."""
        out = handler(self)
        if not self.shares:
            out.pop("shares", None)
        return out

    def _check_shares(self) -> None:
        shares, total = self.shares, self.dp * self.num_micro_batches
        if len(shares) != self.dp or min(shares) < 1 or sum(shares) != total:
            raise LayoutError(
                f"shares {list(shares)} must give each of the {self.dp} replicas at least one "
                f"micro-batch and sum to dp x numMicroBatches = {total}"
            )
        if len(set(shares)) == 1:  # even: one way to write it
            object.__setattr__(self, "shares", ())

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def num_units(self) -> int:
        return sum(self.partition)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    @property
    def global_micro_batches(self) -> int:
        return self.dp * self.num_micro_batches

    def replica_micro_batches(self, replica: int) -> int:
        """Micro-batches replica ``replica`` computes per step."""
        return self.shares[replica] if self.shares else self.num_micro_batches

    def replica_offset(self, replica: int) -> int:
        """The global index of replica ``replica``'s first micro-batch."""
        if self.shares:
            return sum(self.shares[:replica])
        return replica * self.num_micro_batches

    def replica_pipeline(self, replica: int) -> Layout:
        """The pipeline replica ``replica`` runs: this layout with its micro-batch count, the
        one its schedule is built for."""
        if not self.shares:
            return self
        return replace(self, num_micro_batches=self.shares[replica], shares=())

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
        """Short human form, e.g. ``dp1 pp3 [3,2,3] 1f1b 2x8`` (uneven shares: ``2x6/2``)."""
        parts = ",".join(str(n) for n in self.partition)
        virtual = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        recompute = " ac" if self.activation_checkpointing else ""
        count = "/".join(map(str, self.shares)) if self.shares else self.num_micro_batches
        return (
            f"dp{self.dp} pp{self.pp} [{parts}] {self.schedule.value}{virtual} "
            f"{self.micro_batch_size}x{count}{recompute}"
        )

    def to_dict(self) -> dict[str, object]:
        """The agent's own form (snake_case), as its reports, profiles and snapshots hold it;
        ``Layout(**d)`` reads it back."""
        return {
            "dp": self.dp,
            "pp": self.pp,
            "partition": list(self.partition),
            "micro_batch_size": self.micro_batch_size,
            "num_micro_batches": self.num_micro_batches,
            "schedule": self.schedule.value,
            "virtual_stages": self.virtual_stages,
            "activation_checkpointing": self.activation_checkpointing,
            **({"shares": list(self.shares)} if self.shares else {}),
        }
