"""From a job to its scale table: the search space a job's spec allows, and the presets.

``plan_job`` is what ``tidal plan`` and the runner call: strict consistency fixes what changes
the bits of a step (dp = 1 and the micro-batch size: both fix the order in which gradients are
summed), relaxed consistency lets the micro-batch size vary and, with ``elastic: dp-pp``, the
data-parallel degree too. With a profile the profiling-based predictor chooses the layouts and
the modeling-based one checks them (rows where they disagree are dropped); without one the
modeling-based predictor chooses alone.

``plan_flextrain`` plans the three configurations of the FlexTrain slides, their memory priced as
Megatron-LM keeps a model (``Sharding.megatron``), not as Tidal's trainer does,
on a device description: a worker there is one node of eight GPUs that holds one pipeline
rank's context-parallel group (CP = 8), and experts are spread over EP GPUs of each stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from tidal_api import ElasticTrainingJob, ScaleTable
from tidal_api.layout import Layout, LayoutError, ScheduleKind
from tidal_api.spec import JobSpec
from tidal_plan.costmodel import Prediction, Sharding
from tidal_plan.devices import Device
from tidal_plan.elastic import (
    default_logical_replicas,
    logical_replicas,
    strict_data_parallel,
)
from tidal_plan.modelshape import FLEXTRAIN, FLEXTRAIN_BATCH, ModelShape
from tidal_plan.predictors import ModeledPredictor, Predictor, ProfiledPredictor
from tidal_plan.profiled import Profile
from tidal_plan.search import (
    Dropped,
    SearchResult,
    SearchSpace,
    choose,
    scale_table,
    search,
)

DEFAULT_MAX_DISAGREEMENT = 0.25


def _micro_batch_sizes(spec: JobSpec) -> tuple[int, ...]:
    """The spec's size, and in relaxed mode also half and twice it where they divide the batch."""
    mbs, batch = spec.training.micro_batch_size, spec.training.global_batch_size
    if spec.parallelism.consistency == "strict":
        return (mbs,)
    sizes = {mbs, max(1, mbs // 2), 2 * mbs}
    return tuple(sorted(s for s in sizes if batch % s == 0))


_CHECKPOINTING = {"off": (False,), "layers": (True,), "auto": (False, True)}


def job_device(spec: JobSpec, device: Device) -> Device:
    """``device`` with the job's precision: parameters, gradients and activations counted in
    2 bytes for bf16 (and an fp32 master copy), 4 for fp32."""
    return dataclasses.replace(device, dtype_bytes=2 if spec.training.precision == "bf16" else 4)


def job_space(
    spec: JobSpec, device: Device, *, max_disagreement: float = DEFAULT_MAX_DISAGREEMENT,
    profile: Profile | None = None,
) -> SearchSpace:
    """What the search may vary for this job, and its thresholds. The profiling-based
    predictor prices only the activation checkpointing it measured."""
    par = spec.parallelism
    strict_dp = strict_data_parallel(spec)
    checkpointing = _CHECKPOINTING[spec.training.activation_checkpointing]
    if profile is not None:
        checkpointing = (profile.checkpointing,)
    free_dp = par.elastic == "dp-pp" and par.consistency == "relaxed"
    schedules = tuple(ScheduleKind) if par.schedule == "auto" else (ScheduleKind(par.schedule),)
    return SearchSpace(
        min_workers=spec.workers.min,
        max_workers=spec.workers.max,
        gpus_per_worker=spec.gpus_per_worker,
        global_batch_size=spec.training.global_batch_size,
        micro_batch_sizes=_micro_batch_sizes(spec),
        memory_bytes=device.memory_bytes,
        dp=None if free_dp or strict_dp else 1,
        logical_replicas=logical_replicas(spec) if strict_dp else 0,
        schedules=schedules,
        virtual_stages=par.virtual_stages,
        checkpointing=checkpointing,
        min_gain=spec.scaling.min_gain,
        max_disagreement=max_disagreement,
    )


def plan_job(
    job: ElasticTrainingJob,
    device: Device,
    *,
    profile: Profile | None = None,
    max_disagreement: float = DEFAULT_MAX_DISAGREEMENT,
    on_row: Callable[[int], None] | None = None,
) -> tuple[ScaleTable, SearchResult]:
    """The job's scale table on ``device``, from its profile where one is given."""
    spec = job.spec
    device = job_device(spec, device)
    space = job_space(spec, device, max_disagreement=max_disagreement, profile=profile)
    modeled = ModeledPredictor(ModelShape.of(spec.model), device)
    if profile is None:
        result = search(modeled, space, on_row=on_row)
    else:
        profiled = ProfiledPredictor(profile, spec.model.seq_len)
        result = search(profiled, space, other=modeled, on_row=on_row)
    table = scale_table(result, space, job=job.metadata.name, device=device.name,
                        seq_len=spec.model.seq_len)
    return table, result


class LayoutPlanner:
    """The planner's layout for a worker count the runner was given, and its prediction.

    The runner gives dp (``data_parallel_degree``: 1, or None for the planner's pick) and
    fixes the spec's micro-batch size (the relaxed table's other sizes are not run); the
    planner picks the schedule (where the spec says auto), virtual stages and the partition.
    """

    def __init__(self, job: ElasticTrainingJob, device: Device, profile: Profile | None = None):
        device = job_device(job.spec, device)
        self.space = job_space(job.spec, device, profile=profile)
        self.micro_batch_size = job.spec.training.micro_batch_size
        self.predictor: Predictor = (
            ModeledPredictor(ModelShape.of(job.spec.model), device) if profile is None
            else ProfiledPredictor(profile, job.spec.model.seq_len)
        )

    def layout(self, workers: int, dp: int | None = 1) -> tuple[Layout, Prediction]:
        """The best layout for ``workers`` at ``dp`` (None: any dp the job allows)."""
        space = dataclasses.replace(
            self.space, dp=dp, micro_batch_sizes=(self.micro_batch_size,),
            min_workers=workers, max_workers=workers,
        )
        found = choose(self.predictor, space, workers)
        if isinstance(found, Dropped):
            raise LayoutError(f"no layout for {workers} workers: {found.detail}")
        return found.layout, found.prediction

    def predict(self, layout: Layout) -> Prediction:
        return self.predictor.predict(layout)

    def unit_seconds(self) -> tuple[float, ...]:
        """Each placement unit's seconds per micro-batch (forward and backward): what a
        re-plan for measured rank speeds weighs the units by."""
        return tuple(u.seconds for u in self.predictor.units(self.micro_batch_size, 1))


@dataclass(frozen=True, kw_only=True, slots=True)
class FlexTrainRun:
    """One configuration of the slides' "Real-world tests" table."""

    dp: int
    pp: int
    cp: int
    ep: int
    gpus: tuple[int, int]  # elastic range


FLEXTRAIN_RUNS = {
    "small": FlexTrainRun(dp=1, pp=4, cp=8, ep=8, gpus=(32, 128)),
    "medium": FlexTrainRun(dp=2, pp=4, cp=8, ep=8, gpus=(64, 256)),
    "large": FlexTrainRun(dp=4, pp=8, cp=8, ep=16, gpus=(256, 1024)),
}


def flextrain_space(
    name: str, device: Device, *, elastic: str = "pp", min_gain: float = 0.05
) -> tuple[ModelShape, Sharding, SearchSpace]:
    """Model, sharding and search space of a FlexTrain configuration.

    ``elastic="pp"`` keeps the slides' DP degree (PP scaling); ``"dp-pp"`` lets DP vary too,
    as strict data parallelism does: dp divides the logical replicas, the smallest power of two
    at least the largest worker count that divides the batch. Both keep the bits. Micro-batches
    hold one sequence of 8K or 32K tokens.
    """
    if name not in FLEXTRAIN_RUNS:
        raise ValueError(f"unknown FlexTrain configuration {name!r}: use one of "
                         f"{sorted(FLEXTRAIN_RUNS)}")
    if elastic not in ("pp", "dp-pp"):
        raise ValueError(f"elastic must be pp or dp-pp, not {elastic!r}")
    run = FLEXTRAIN_RUNS[name]
    sharding = Sharding(cp=run.cp, ep=run.ep, distributed_optimizer=True, megatron=True)
    per_worker = sharding.gpus_per_rank
    space = SearchSpace(
        min_workers=run.gpus[0] // per_worker,
        max_workers=run.gpus[1] // per_worker,
        gpus_per_worker=per_worker,
        global_batch_size=FLEXTRAIN_BATCH[name],
        micro_batch_sizes=(1,),
        memory_bytes=device.memory_bytes,
        dp=run.dp if elastic == "pp" else None,
        logical_replicas=0 if elastic == "pp" else default_logical_replicas(
            run.gpus[1] // per_worker, FLEXTRAIN_BATCH[name]),
        min_gain=min_gain,
    )
    return FLEXTRAIN[name], sharding, space


def plan_flextrain(
    name: str,
    device: Device,
    *,
    elastic: str = "pp",
    on_row: Callable[[int], None] | None = None,
) -> tuple[ScaleTable, SearchResult]:
    """The scale table of a FlexTrain configuration, from the modeling-based predictor."""
    shape, sharding, space = flextrain_space(name, device, elastic=elastic)
    result = search(ModeledPredictor(shape, device, sharding), space, on_row=on_row)
    table = scale_table(result, space, job=f"flextrain-{name}-{elastic}", device=device.name,
                        seq_len=shape.seq_len)
    return table, result
