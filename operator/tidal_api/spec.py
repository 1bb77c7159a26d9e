"""ElasticTrainingJob spec types (DESIGN.md section 3).

Field names on the wire are camelCase, as in every Kubernetes object; in Python they are
snake_case. Unknown fields are refused, so a typo in a manifest is an error rather than a
silently ignored setting.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from tidal_api.status import JobStatus

GROUP = "tidal.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ElasticTrainingJob"


class JobSpecError(ValueError):
    """A job manifest that cannot be run; the message is one line that says how to fix it."""


class _Spec(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )


class WorkersSpec(_Spec):
    min: int = Field(2, ge=1, description="Workers the job starts with and never goes below.")
    max: int = Field(8, ge=1, description="Most workers the job may grow to.")

    @model_validator(mode="after")
    def _min_le_max(self) -> WorkersSpec:
        if self.min > self.max:
            raise ValueError(f"workers.min ({self.min}) must not exceed workers.max ({self.max})")
        return self


class ModelSpec(_Spec):
    layers: int = Field(6, ge=1, description="Transformer blocks.")
    d_model: int = Field(64, ge=1, description="Hidden size.")
    heads: int = Field(4, ge=1, description="Attention heads; must divide dModel.")
    vocab: int = Field(256, ge=2, le=65536, description="Vocabulary size (token files are uint16).")
    seq_len: int = Field(64, ge=2, description="Tokens per sample.")
    mtp_heads: int = Field(0, ge=0, description="Multi-token-prediction heads after the LM head.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability.")
    mlp_ratio: int = Field(4, ge=1, description="MLP hidden size as a multiple of dModel.")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.d_model % self.heads:
            raise ValueError(f"model.heads ({self.heads}) must divide model.dModel ({self.d_model})")
        return self

    @property
    def num_units(self) -> int:
        """Placement units: embedding, blocks, final norm + LM head, MTP heads."""
        return self.layers + 2 + self.mtp_heads


class DataSpec(_Spec):
    kind: Literal["synthetic", "tokens"] = Field(
        "synthetic", description="synthetic: a seeded corpus with learnable structure; "
        "tokens: a uint16 token file (nanoGPT-style)."
    )
    path: str | None = Field(None, description="Token file, for kind: tokens.")

    @model_validator(mode="after")
    def _path_for_tokens(self) -> DataSpec:
        if self.kind == "tokens" and not self.path:
            raise ValueError("training.data.path is required when training.data.kind is tokens")
        return self


class TrainingSpec(_Spec):
    steps: int = Field(100, ge=1, description="Optimizer steps.")
    global_batch_size: int = Field(16, ge=1, description="Samples per step.")
    micro_batch_size: int = Field(2, ge=1, description="Samples per micro-batch.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    min_lr: float = Field(3e-4, ge=0, description="Learning rate at the end of the cosine decay.")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (matrices only).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 turns it off.")
    seed: int = Field(0, ge=0, description="Seeds initial values, data and dropout.")
    data: DataSpec = Field(default_factory=DataSpec)

    @model_validator(mode="after")
    def _batch_divides(self) -> TrainingSpec:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"training.microBatchSize ({self.micro_batch_size}) must divide "
                f"training.globalBatchSize ({self.global_batch_size})"
            )
        return self

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size


class ParallelismSpec(_Spec):
    elastic: Literal["pp", "dp-pp"] = Field("pp", description="Which degrees may change.")
    consistency: Literal["strict", "relaxed"] = Field(
        "strict", description="strict: bitwise the same result as a static run."
    )
    schedule: Literal["auto", "gpipe", "1f1b", "interleaved", "zb"] = Field(
        "auto", description="Pipeline schedule; auto lets Tidal choose."
    )
    virtual_stages: int = Field(
        2, ge=1, description="Model chunks per rank for the interleaved schedule."
    )


class ScalingSpec(_Spec):
    enabled: bool = True
    probability_threshold: float = Field(0.6, ge=0, le=1)
    min_gain: float = Field(0.05, ge=0)
    arrival_window_seconds: float = Field(28800, gt=0)
    cooldown_seconds: float = Field(60, ge=0)
    drain_timeout_seconds: float = Field(
        300, gt=0, description="After a scale-down target, seconds the agent has to release "
        "its pods before the operator deletes them anyway."
    )
    switch_overhead_seconds: float = Field(
        30, ge=0, description="Switch pause the scale-up rule assumes until the agent has "
        "measured one (status.lastSwitchSeconds)."
    )


class CheckpointSpec(_Spec):
    path: str | None = None
    every_steps: int = Field(0, ge=0, description="0 turns periodic checkpoints off.")


class JobSpec(_Spec):
    workers: WorkersSpec = Field(default_factory=WorkersSpec)
    gpus_per_worker: int = Field(1, ge=1)
    max_scale_factor: int = Field(4, ge=1)
    model: ModelSpec = Field(default_factory=ModelSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    template: dict[str, Any] = Field(default_factory=dict)


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = "job"
    namespace: str | None = None


class ElasticTrainingJob(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: Literal["tidal.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["ElasticTrainingJob"] = KIND
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: JobSpec = Field(default_factory=JobSpec)
    status: JobStatus | None = None


def _first_error(err: ValidationError) -> str:
    e = err.errors()[0]
    where = ".".join(str(p) for p in e["loc"]) or "(top level)"
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        msg = "unknown field"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{where}: {msg}{more}"


def parse_job(document: Any, source: str = "job") -> ElasticTrainingJob:
    """Validate a decoded manifest; raise JobSpecError with one line on bad input."""
    if not isinstance(document, dict):
        raise JobSpecError(f"{source}: expected an ElasticTrainingJob mapping")
    try:
        return ElasticTrainingJob.model_validate(document)
    except ValidationError as err:
        raise JobSpecError(f"{source}: {_first_error(err)}") from None
