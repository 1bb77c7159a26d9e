"""ElasticTrainingJob spec types (DESIGN.md section 3).

Field names on the wire are camelCase, as in every Kubernetes object; in Python they are
snake_case. Unknown fields are refused, so a typo in a manifest is an error rather than a
silently ignored setting. These types are the one declaration of the job's fields: the CRD's
schema is generated from them (tidal_api.crd), and each cross-field validator here has a CEL
twin (``x-kubernetes-validations``) with the same message, so the API server refuses what
``parse_job`` refuses.

What to train and on how many workers have no defaults: a manifest without ``spec.model`` (its
layers, dModel and heads) or ``spec.workers`` (min and max) is refused, rather than trained as
a toy. Counts and sizes have upper bounds (the ``MAX_*`` constants, the schema's ``maximum``):
far above any job Tidal plans for, low enough that a typo (an extra zero or three) is an error
rather than a job that asks for the impossible. What the schema admits but no worker can run
(:meth:`JobSpec.contradiction`) the operator reports as condition Valid=False.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from tidal_api.huggingface import (
    HF_SIZES,
    HF_SIZES_MESSAGE,
    HuggingFaceSpec,
    cel_size,
    hf_size,
    read_config_file,
)
from tidal_api.schema import JobSpecError, Spec, cel, cel_rule, cel_rules
from tidal_api.status import JobStatus

GROUP = "tidal.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ElasticTrainingJob"


# Upper bounds of counts and sizes (the schema's ``maximum``).
MAX_WORKERS = 4096
MAX_STEPS = 10_000_000
MAX_LAYERS = 1024
MAX_D_MODEL = 65536
MAX_HEADS = 1024
MAX_VOCAB = 262_144  # Gemma 3's; above Llama 3's 128,256 and Qwen's 151,936
MAX_SEQ_LEN = 1_048_576
MAX_MLP_RATIO = 64
MAX_MTP_HEADS = 64
MAX_GLOBAL_BATCH = 1_048_576
MAX_MICRO_BATCH = 65536

# What a missing required field's message says, by its place in the manifest.
_REQUIRED = {
    "spec": "required: what to train (spec.model) on how many workers (spec.workers)",
    "spec.model": "required: the model to train, e.g. model: {layers: 12, dModel: 768, "
                  "heads: 12}; Tidal trains no default model",
    "spec.workers": "required: the worker pods the job may run with, e.g. workers: "
                    "{min: 2, max: 8}",
}


class WorkersSpec(Spec):
    """How many worker pods the job may run with."""

    model_config = cel_rules(
        cel_rule(
            "self.min <= self.max",
            "workers.min must not exceed workers.max",
            '"workers.min (" + string(self.min) + ") must not exceed workers.max ("'
            ' + string(self.max) + ")"',
        ),
        cel_rule(
            "!has(self.preferred) || (self.min <= self.preferred && self.preferred <= self.max)",
            "workers.preferred must lie between workers.min and workers.max",
            '"workers.preferred (" + string(self.preferred) + ") must lie between workers.min ("'
            ' + string(self.min) + ") and workers.max (" + string(self.max) + ")"',
        ),
    )

    min: int = Field(ge=1, le=MAX_WORKERS,
                     description="Fewest workers the job runs with; it never goes below.")
    max: int = Field(ge=1, le=MAX_WORKERS, description="Most workers the job may grow to.")
    preferred: int | None = Field(
        None, ge=1, le=MAX_WORKERS, description="Workers the job asks to start with (default "
        "min). Where fewer GPUs are free it starts with what is free, never below min, and "
        "grows by the scaling rules.")

    @model_validator(mode="after")
    def _min_le_max(self) -> WorkersSpec:
        if self.min > self.max:
            raise ValueError(f"workers.min ({self.min}) must not exceed workers.max ({self.max})")
        if self.preferred is not None and not self.min <= self.preferred <= self.max:
            raise ValueError(f"workers.preferred ({self.preferred}) must lie between "
                             f"workers.min ({self.min}) and workers.max ({self.max})")
        return self

    @property
    def start(self) -> int:
        """The workers the job asks to start with."""
        return self.min if self.preferred is None else self.preferred


class ModelSpec(Spec):
    """The job's model, the built-in GPT or a Hugging Face causal LM: its one description, which
    the trainer builds, reshard plans and checkpoints name, and the planner counts
    (ModelShape.of)."""

    model_config = cel_rules(
        cel_rule(
            "self.dModel % self.heads == 0",
            "model.heads must divide model.dModel",
            '"model.heads (" + string(self.heads) + ") must divide model.dModel ("'
            ' + string(self.dModel) + ")"',
        ),
        cel_rule(
            "!has(self.huggingface) || !has(self.huggingface.config) || ("
            + " && ".join(f"{cel_size(key)} == self.{to_camel(field)}"
                          for field, key in HF_SIZES)
            + f" && self.seqLen <= {cel_size('max_position_embeddings', 1 << 62)}"
            + " && self.mtpHeads == 0 && self.dropout == 0.0)",
            HF_SIZES_MESSAGE,
        ),
    )

    layers: int = Field(ge=1, le=MAX_LAYERS, description="Transformer blocks.")
    d_model: int = Field(ge=1, le=MAX_D_MODEL, description="Hidden size.")
    heads: int = Field(ge=1, le=MAX_HEADS, description="Attention heads; must divide dModel.")
    vocab: int = Field(256, ge=2, le=MAX_VOCAB,
                       description="Vocabulary size: every token id of the data is below it.")
    seq_len: int = Field(64, ge=2, le=MAX_SEQ_LEN, description="Tokens per sample.")
    mtp_heads: int = Field(0, ge=0, le=MAX_MTP_HEADS,
                           description="Multi-token-prediction heads after the LM head.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability.")
    mlp_ratio: int = Field(4, ge=1, le=MAX_MLP_RATIO,
                           description="MLP hidden size as a multiple of dModel.")
    huggingface: HuggingFaceSpec | None = Field(
        None, description="Train this Hugging Face causal LM instead of the built-in GPT: "
        "layers, dModel, heads and vocab state its config's sizes (the operator plans from "
        "them without the config), seqLen is at most its max_position_embeddings."
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.d_model % self.heads:
            raise ValueError(f"model.heads ({self.heads}) must divide model.dModel ({self.d_model})")
        return self

    @model_validator(mode="after")
    def _huggingface_sizes(self) -> ModelSpec:
        if self.huggingface is None or self.huggingface.config is None:
            return self
        config = self.huggingface.config
        for field, key in HF_SIZES:
            if hf_size(config, key) is None:
                raise ValueError(f"{HF_SIZES_MESSAGE}: the config lacks {key}")
            if hf_size(config, key) != getattr(self, field):
                raise ValueError(f"{HF_SIZES_MESSAGE}: model.{to_camel(field)} is "
                                 f"{getattr(self, field)}, {key} {hf_size(config, key)}")
        positions = hf_size(config, "max_position_embeddings")
        if positions is not None and self.seq_len > positions:
            raise ValueError(f"{HF_SIZES_MESSAGE}: model.seqLen is {self.seq_len}, "
                             f"max_position_embeddings {positions}")
        if self.mtp_heads or self.dropout:
            raise ValueError(f"{HF_SIZES_MESSAGE}: mtpHeads and dropout are the built-in "
                             "GPT's")
        return self

    @property
    def num_units(self) -> int:
        """Placement units: embedding, blocks, final norm + LM head, MTP heads."""
        return self.layers + 2 + self.mtp_heads

    @property
    def sample_len(self) -> int:
        """Tokens per sample: inputs plus the targets of the LM head and every MTP head."""
        return self.seq_len + 1 + self.mtp_heads


class DataSpec(Spec):
    """Where the training samples come from."""

    model_config = cel(
        "self.kind == 'synthetic' || (has(self.path) && size(self.path) > 0)",
        "training.data.path is required when training.data.kind is tokens or prepared",
        '"training.data.path is required when training.data.kind is " + self.kind',
    )

    kind: Literal["synthetic", "tokens", "prepared"] = Field(
        "synthetic", description="synthetic: a seeded corpus with learnable structure; "
        "tokens: a uint16 token file (nanoGPT-style); prepared: token shards that "
        "tidal data prepare packed from a local Hugging Face dataset."
    )
    path: str | None = Field(None, description="The token file (kind: tokens) or the prepared "
                             "directory (kind: prepared), on every worker's disk.")

    @model_validator(mode="after")
    def _path_for_files(self) -> DataSpec:
        if self.kind != "synthetic" and not self.path:
            raise ValueError(
                f"training.data.path is required when training.data.kind is {self.kind}"
            )
        return self


class TrainingSpec(Spec):
    """Optimisation: steps, batch, learning-rate schedule, data."""

    model_config = cel(
        "self.globalBatchSize % self.microBatchSize == 0",
        "training.microBatchSize must divide training.globalBatchSize",
        '"training.microBatchSize (" + string(self.microBatchSize) + ") must divide '
        'training.globalBatchSize (" + string(self.globalBatchSize) + ")"',
    )

    steps: int = Field(100, ge=1, le=MAX_STEPS, description="Optimizer steps.")
    global_batch_size: int = Field(16, ge=1, le=MAX_GLOBAL_BATCH, description="Samples per step.")
    micro_batch_size: int = Field(2, ge=1, le=MAX_MICRO_BATCH,
                                  description="Samples per micro-batch.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    min_lr: float = Field(3e-4, ge=0, description="Learning rate at the end of the cosine decay.")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (matrices only).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 turns it off.")
    seed: int = Field(0, ge=0, description="Seeds initial values, data and dropout.")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="fp32, or bf16 autocast with fp32 master weights, optimizer state "
        "and gradient accumulation.",
    )
    activation_checkpointing: Literal["off", "layers", "auto"] = Field(
        "off", description="Recompute each decoder layer's forward in its backward, keeping "
        "only the layer's input: off, layers (always), or auto (the planner turns it on for "
        "the layouts that would not fit memory without it).",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="Compile each placement unit's forward (and so its backward) on "
        "its own with torch.compile's inductor, units of one shape sharing compiled code: on, "
        "off, or auto (on where the job trains on CUDA).",
    )
    data: DataSpec = Field(default_factory=DataSpec, description="Where the samples come from.")

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


MAX_LOGICAL_REPLICAS = 1024
_POWERS_OF_TWO = [1 << k for k in range(MAX_LOGICAL_REPLICAS.bit_length())]
_LOGICAL = "parallelism.logicalReplicas must be a power of two up to 1024"


class ParallelismSpec(Spec):
    """Which parallel degrees may change, and how strictly results must match a static run."""

    model_config = cel(
        "!has(self.logicalReplicas) || self.logicalReplicas in "
        + str(_POWERS_OF_TWO).replace(" ", ""),
        _LOGICAL,
    )

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
    logical_replicas: int | None = Field(
        None, ge=1, le=MAX_LOGICAL_REPLICAS,
        description="Strict data parallelism: the global batch is this many logical "
        "replicas, whose gradients are summed in one fixed tree whatever the physical dp (which "
        "must divide it). Default: 1, or with elastic dp-pp and strict consistency the smallest "
        "power of two at least workers.max that divides the micro-batch count (else the "
        "largest that does).",
    )

    @model_validator(mode="after")
    def _power_of_two(self) -> ParallelismSpec:
        if self.logical_replicas is not None and self.logical_replicas not in _POWERS_OF_TWO:
            raise ValueError(f"{_LOGICAL}, not {self.logical_replicas}")
        return self


class ScalingSpec(Spec):
    """The operator's scaling policy for this job (DESIGN.md section 4)."""

    enabled: bool = Field(
        True, description="Let the operator grow the job into idle GPUs; false keeps it at min."
    )
    probability_threshold: float = Field(
        0.99, ge=0, le=1, description="Scale up only if the probability that the idle window "
        "outlasts the switch overhead (a switch up and one back down), "
        "exp(-rate x overhead / gain), exceeds this, and take the last free GPUs only if the "
        "probability that no non-elastic pod needing them arrives within the release latency "
        "(a step and a switch) exceeds it too. Lower values scale up more and make non-elastic "
        "pods wait more (docs/simulator.md has the trade-off). On a loaded cluster it slides "
        "toward loadedThreshold."
    )
    loaded_threshold: float = Field(
        0.9, ge=0, le=1, description="The least the threshold slides to as the cluster "
        "fills: with load the share of its GPUs owed (non-elastic pods' and every elastic "
        "job's minimum) smoothed over the arrival window, a scale-up may take the risk "
        "0.06 x load / (1 - load) (as the queue that load makes anyway grows), never above "
        "probabilityThreshold's and never below this one's. A probabilityThreshold at or "
        "below this does not slide."
    )
    min_gain: float = Field(
        0.05, ge=0, description="Least relative throughput gain a larger scale-table row must "
        "bring to be used."
    )
    arrival_window_seconds: float = Field(
        28800, gt=0, description="Window over which the arrival rate of non-elastic GPU pods "
        "is estimated."
    )
    cooldown_seconds: float = Field(
        60, ge=0, description="Seconds after a scale decision before the next scale-up."
    )
    drain_timeout_seconds: float = Field(
        300, gt=0, description="After a scale-down target, seconds the agent has to release "
        "its pods before the operator deletes them anyway."
    )
    switch_overhead_seconds: float = Field(
        30, ge=0, description="Switch pause the scale-up rule assumes until the agent has "
        "measured one (status.lastSwitchSeconds)."
    )


class StragglerSpec(Spec):
    """Straggler detection and re-planning by measured rank speed (DESIGN.md section 2)."""

    factor: float = Field(
        1.5, gt=1, le=100, description="A worker whose decoder-layer forwards take at least "
        "this many times the median of the other workers' is slow. Lower values catch milder "
        "stragglers; ranks that share cores (or SMT siblings) can differ by 1.4x from the load's "
        "pattern alone."
    )
    steps: int = Field(
        5, ge=1, le=10000, description="Consecutive slow steps that flag a worker as a "
        "straggler, and steps back under the factor that clear the flag."
    )
    replan: bool = Field(
        False, description="When a flag is raised or cleared, re-partition the placement "
        "units by the workers' measured speeds, and with data parallelism share the "
        "micro-batches unevenly over the replicas (same members, through the live switch), "
        "where that is predicted to cut the step's time by at least minGain."
    )
    min_gain: float = Field(
        0.1, ge=0, description="Least predicted gain (a fraction) a re-plan must bring."
    )


class CheckpointSpec(Spec):
    """Periodic distributed checkpoints, which reload into any layout."""

    path: str | None = Field(
        None, description="Directory the checkpoints go to, on storage every worker can reach."
    )
    every_steps: int = Field(0, ge=0, description="0 turns periodic checkpoints off.")
    peer_snapshots: bool = Field(
        True, description="At snapshot boundaries each worker copies its state into host memory "
        "and the next worker keeps a copy too, so a lost worker costs only the steps since the "
        "newest complete snapshot; the price is four times the state's host memory per worker "
        "and one state-sized transfer per snapshot, in the background."
    )
    snapshot_every_steps: int = Field(
        0, ge=0, description="Steps between peer snapshots; 0 (the default) chooses the interval "
        "at run time from their measured cost, the fewest steps that keep it within 5% of the "
        "training time."
    )


class ResourcesSpec(Spec):
    """Requests and limits of the agent container, as Kubernetes quantities ("500m", "16Gi", 4)."""

    requests: dict[str, int | str] = Field(
        default_factory=dict, description="Resource requests, e.g. {cpu: 8, memory: 32Gi}."
    )
    limits: dict[str, int | str] = Field(
        default_factory=dict,
        description="Resource limits; the operator sets the GPU limit from gpusPerWorker.",
    )


class TemplateSpec(Spec):
    """What the cluster needs of the worker pods; the operator adds everything Tidal needs.

    The lists are passed to the pod as they are (Kubernetes validates them when the pod is
    created), so any toleration, env var or volume the cluster supports can be used.
    """

    image: str = Field(
        "ghcr.io/tidal-dev/tidal-agent:0.1.0",
        description="The agent image (the Dockerfile's agent target, as the chart names it).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="When the kubelet pulls the image; IfNotPresent (also for "
        ":latest) lets a locally loaded image run."
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="CPU, memory and other resources per worker."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels a worker's node must have."
    )
    tolerations: tuple[dict[str, Any], ...] = Field(
        (), description="Pod tolerations, e.g. for tainted GPU nodes."
    )
    env: tuple[dict[str, Any], ...] = Field(
        (), description="Extra environment variables of the agent container (EnvVar objects)."
    )
    volumes: tuple[dict[str, Any], ...] = Field(
        (), description="Pod volumes, e.g. the token file's or the checkpoints' storage."
    )
    volume_mounts: tuple[dict[str, Any], ...] = Field(
        (), description="Where the agent container mounts the volumes (VolumeMount objects)."
    )
    labels: dict[str, str] = Field(
        default_factory=dict, description="Extra labels of the worker pods."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, description="Annotations of the worker pods."
    )
    termination_grace_period_seconds: int | None = Field(
        None, ge=0, description="Seconds a worker pod has to stop once asked (Kubernetes' "
        "default, 30, when unset): a member leaves at its next step boundary, the leader halts "
        "the job there and every member saves a checkpoint of it. Leave room for a step and a "
        "checkpoint save; a pod still running then is killed."
    )


# A Kubernetes object name (DNS subdomain): a LocalQueue's, a PriorityClass's.
_OBJECT_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_PRIORITY_NEEDS_QUEUE = ("priorityClassName is the class of the workers a queue admits: set "
                         "queueName too (the workers above the minimum run as tidal-elastic)")


class JobSpec(Spec):
    """spec of an ElasticTrainingJob: what to train, on how many workers, under which policy."""

    model_config = cel("!has(self.priorityClassName) || has(self.queueName)",
                       _PRIORITY_NEEDS_QUEUE)

    workers: WorkersSpec = Field(description="Worker pod range; the job starts at min.")
    gpus_per_worker: int = Field(1, ge=1, description="GPUs (ranks) per worker pod.")
    max_scale_factor: int = Field(
        4, ge=1, description="The job never runs more than this times workers.min workers."
    )
    model: ModelSpec = Field(description="The model to train.")
    training: TrainingSpec = Field(
        default_factory=TrainingSpec, description="Steps, batch, optimiser and data."
    )
    parallelism: ParallelismSpec = Field(
        default_factory=ParallelismSpec, description="How the model is spread over the GPUs."
    )
    scaling: ScalingSpec = Field(
        default_factory=ScalingSpec, description="When the operator grows and shrinks the job."
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec, description="Periodic checkpoints."
    )
    stragglers: StragglerSpec = Field(
        default_factory=StragglerSpec, description="Slow workers: when one is flagged, and "
        "whether the job re-plans around it."
    )
    max_restarts: int = Field(
        3, ge=0, description="Failures the operator restarts the job after: its rendezvous "
        "pod failed, its first leader failed before the first generation, or every worker "
        "did. A restart is fresh pods, starting from the newest complete checkpoint under "
        "checkpoint.path; one more failure, and the job fails. A leader asked to stop (its pod "
        "deleted, preempted or drained), or a rendezvous pod gone, is no failure: the job "
        "restarts whatever the count."
    )
    template: TemplateSpec = Field(
        default_factory=TemplateSpec, description="Overrides for the worker pods."
    )
    queue_name: str | None = Field(
        None, max_length=253, pattern=_OBJECT_NAME, description="A Kueue LocalQueue in the "
        "job's namespace: the job's minimum workers are a Kueue pod group admitted through it "
        "(labelled kueue.x-k8s.io/queue-name and pod-group-name, held by the "
        "kueue.x-k8s.io/admission gate until Kueue admits them), as every job in the queue. "
        "The workers above the minimum are not queued: they run on idle GPUs only, as "
        "tidal-elastic, and are the first to go. Unset: no worker is queued."
    )
    priority_class_name: str | None = Field(
        None, max_length=253, pattern=_OBJECT_NAME, description="The PriorityClass of the "
        "workers the queue admits (needs queueName): Kueue orders and preempts the job's pod "
        "group by it, as any pod group's. Unset: the cluster's default priority."
    )

    @model_validator(mode="after")
    def _priority_needs_queue(self) -> JobSpec:
        if self.priority_class_name is not None and self.queue_name is None:
            raise ValueError(_PRIORITY_NEEDS_QUEUE)
        return self

    def contradiction(self) -> str | None:
        """What makes this schema-valid spec impossible to run, in one line; None if nothing.

        Not a validator: the API server admits such a spec (there is no CEL twin), and the
        operator reports it on the job as condition Valid=False with an Event.
        """
        units = self.model.num_units
        if self.gpus_per_worker != 1:
            return (f"gpusPerWorker is {self.gpus_per_worker}: the agent runs one rank per pod; "
                    "use gpusPerWorker: 1")
        if self.workers.min > units:
            return (f"workers.min ({self.workers.min}) exceeds the model's {units} placement "
                    "units (embedding, blocks, head): every pipeline stage needs at least one")
        replicas, micro_batches = (self.parallelism.logical_replicas,
                                   self.training.num_micro_batches)
        if replicas is not None and micro_batches % replicas:
            return (f"parallelism.logicalReplicas ({replicas}) must divide the "
                    f"{micro_batches} micro-batches of a step (globalBatchSize / microBatchSize)")
        return None


class ObjectMeta(BaseModel):
    """The few metadata fields Tidal reads; the rest are kept as they are."""

    model_config = ConfigDict(extra="allow")
    name: str = "job"
    namespace: str | None = None


class ElasticTrainingJob(BaseModel):
    """A training job that grows into idle GPUs and gives them back when other work needs them."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: Literal["tidal.dev/v1alpha1"] = Field(
        API_VERSION, alias="apiVersion", description="Versioned schema of this object."
    )
    kind: Literal["ElasticTrainingJob"] = Field(KIND, description="Kind of this object.")
    metadata: ObjectMeta = Field(default_factory=ObjectMeta, description="Standard metadata.")
    spec: JobSpec = Field(description="What to train and how to scale.")
    status: JobStatus | None = Field(
        None, description="Written by the operator and the agent leader; see tidal_api.status."
    )


def _first_error(err: ValidationError) -> str:
    e = err.errors()[0]
    where = ".".join(str(p) for p in e["loc"]) or "(top level)"
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        msg = "unknown field"
    elif e["type"] == "missing":
        msg = _REQUIRED.get(where, "required")
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{where}: {msg}{more}"


def parse_job(document: Any, source: str = "job", *, local_files: bool = False
              ) -> ElasticTrainingJob:
    """Validate a decoded manifest; raise JobSpecError with one line on bad input.

    With ``local_files`` (where the job's files are: the agent, ``tidal run``) a Hugging Face
    ``path`` is read: its config.json replaces it, and is checked like an inline config.
    """
    if not isinstance(document, dict):
        raise JobSpecError(f"{source}: expected an ElasticTrainingJob mapping")
    if local_files:
        document = read_config_file(document, source)
    try:
        return ElasticTrainingJob.model_validate(document)
    except ValidationError as err:
        raise JobSpecError(f"{source}: {_first_error(err)}") from None
