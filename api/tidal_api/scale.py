"""Scale tables: what a job expects of each worker count it could get (DESIGN.md sections 2-3).

The agent's planner writes the table (``status.scaleTable``); the operator reads it to decide
whether a scale-up pays off and which job loses least on a scale-down. Every worker count in
``[minWorkers, maxWorkers]`` is either a row (the best layout found for it) or a dropped entry
that says why it is not worth running. A row's layout is the one type the planner and
``status.layout`` use too. Field names on the wire are camelCase; byte counts are integers, so
that ``kubectl describe etj`` shows 4941824, not 4.941824e+06.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from tidal_api.layout import Layout

DropReason = Literal["hyperparameters", "memory", "disagreement", "gain"]
PredictorName = Literal["profiled", "modeled"]


class _Wire(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class ScaleRow(_Wire):
    """The best layout for one worker count and what it is predicted to do."""

    workers: int = Field(ge=1, description="Worker pods.")
    gpus: int = Field(ge=1, description="GPUs (ranks) of all workers together.")
    layout: Layout = Field(description="The layout: dp, pp, partition, schedule, "
                           "micro-batching.")
    step_seconds: float = Field(gt=0, description="Predicted seconds per optimizer step.")
    tokens_per_second: float = Field(gt=0, description="Predicted training throughput.")
    peak_memory_bytes: int = Field(ge=0, description="Predicted peak of the fullest GPU, in bytes.")
    speedup: float = Field(gt=0, description="Throughput over the table's smallest row.")
    predictor: PredictorName = Field(description="The predictor whose figures these are.")
    other_step_seconds: float | None = Field(
        None, description="The other predictor's step seconds for this layout, where it ran."
    )

    @field_validator("peak_memory_bytes", mode="before")
    @classmethod
    def _whole_bytes(cls, value: object) -> object:
        """A predictor's bytes (a float) as whole bytes, rounded up: a peak is not less."""
        return math.ceil(value) if isinstance(value, float) and math.isfinite(value) else value


class DroppedRow(_Wire):
    """A worker count the job should not run at, and why."""

    workers: int = Field(ge=1, description="Worker pods.")
    reason: DropReason = Field(
        description="hyperparameters: no layout fits the batch; memory: it would not fit; "
        "disagreement: the predictors disagree; gain: too little over the row below."
    )
    detail: str = Field(description="One line: the numbers behind the reason.")


class ScaleTable(_Wire):
    """A job's scale table: one row or one dropped entry per worker count in the range."""

    job: str = Field(description="Name of the job the table was planned for.")
    device: str = Field(description="The device description the modeled figures use.")
    source: PredictorName = Field(description="Which predictor chose the rows.")
    min_workers: int = Field(ge=1, description="Smallest worker count in the table.")
    max_workers: int = Field(ge=1, description="Largest worker count in the table.")
    gpus_per_worker: int = Field(1, ge=1, description="GPUs (ranks) per worker pod.")
    global_batch_size: int = Field(ge=1, description="Samples per step, fixed for every row.")
    seq_len: int = Field(ge=1, description="Tokens per sample.")
    min_gain: float = Field(ge=0, description="Least gain over the next smaller row kept.")
    rows: tuple[ScaleRow, ...] = Field((), description="Worker counts worth running, ascending.")
    dropped: tuple[DroppedRow, ...] = Field((), description="Worker counts not worth running.")

    @model_validator(mode="after")
    def _one_entry_per_count(self) -> ScaleTable:
        workers, _, _ = self.columns
        counts = [*workers, *(d.workers for d in self.dropped)]
        expected = list(range(self.min_workers, self.max_workers + 1))
        if sorted(counts) != expected:
            raise ValueError(
                f"a scale table needs one row or dropped entry per worker count "
                f"{self.min_workers}..{self.max_workers}; it has {sorted(counts)}"
            )
        if list(workers) != sorted(workers):
            raise ValueError("scale table rows must be in increasing worker order")
        return self

    @property
    def columns(self) -> tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]:
        """The rows' workers, tokens/s and step seconds, as three tuples in row order.

        Worked out once, when the table is validated (or first asked, for a table made
        without validation), and kept with the rows they come from: the operator's policy
        reads them for every job at every decision, and a walk over every row's fields is,
        in a cluster of thousands of jobs, much of a decision's time. Not a field: neither
        dumped nor compared.
        """
        kept = self.__dict__.get("_columns")
        if kept is None or kept[0] is not self.rows:
            rows = self.rows
            kept = (rows, tuple(r.workers for r in rows),
                    tuple(r.tokens_per_second for r in rows), tuple(r.step_seconds for r in rows))
            self.__dict__["_columns"] = kept
        return kept[1:]

    def row(self, workers: int) -> ScaleRow | None:
        """The row for exactly ``workers``, or None where that count was dropped."""
        return next((r for r in self.rows if r.workers == workers), None)

    def best_within(self, workers: int) -> ScaleRow | None:
        """The largest row with at most ``workers`` workers: where the job should run."""
        fitting = [r for r in self.rows if r.workers <= workers]
        return fitting[-1] if fitting else None
