"""Modeling-based predictor: step time and memory of a layout from FLOPs, bytes and a device.

No profile is needed, so it plans before the first step and for models far larger than any
machine at hand. Each placement unit's counts (``tidal_plan.modelshape``: forward /
input-grad / weight-grad FLOPs, the bytes its forward keeps for the backward, its parameters)
become seconds and bytes on a ``Device`` under a ``Sharding``; a stage sums its units; the
fast estimate of the dry run (``tidal_plan.estimate``) runs the layout's lowered action lists
with the resulting times. Every estimate is first-order (see the assumptions in each
function's docstring): good for ranking layouts, not for promising seconds.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tidal_api.layout import Layout
from tidal_plan.actioncosts import Costs
from tidal_plan.devices import Device
from tidal_plan.estimate import estimate_step
from tidal_plan.modelshape import (
    ModelShape,
    korthikanti_activation_bytes,
    unit_backward_bytes,
    unit_expert_params,
    unit_flops,
    unit_matmul_weights,
    unit_output_grad_bytes,
    unit_params,
    unit_saved_bytes,
)


# --- sharding inside a pipeline rank ------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Sharding:
    """How one pipeline rank spreads over GPUs, and how state is sharded over replicas.

    ``cp`` GPUs share each micro-batch's sequence (context parallelism, ring attention with a
    load-balanced causal mask): each computes and keeps a ``1 / cp`` share of the tokens and
    holds every parameter. ``ep`` GPUs among the ``dp x cp`` GPUs of a stage share its routed
    experts (expert parallelism: an all-to-all sends each token to its experts and back).
    ``distributed_optimizer`` shards AdamW state over the GPUs that hold the same parameters
    (ZeRO-1, Megatron's distributed optimizer). Tensor parallelism is not modelled.

    None of these is Tidal's trainer's: ``megatron`` prices memory as Megatron-LM keeps a
    model (bf16 parameters and activations, ``korthikanti_activation_bytes``) rather than as
    Tidal's trainer does (fp32 parameters under bf16 autocast, its runtime's buffers:
    ``tidal_plan.modelshape``), for the systems whose presets the planner prices (FlexTrain).
    """

    cp: int = 1
    ep: int = 1
    distributed_optimizer: bool = False
    megatron: bool = False

    def __post_init__(self) -> None:
        if self.cp < 1 or self.ep < 1:
            raise ValueError(f"cp ({self.cp}) and ep ({self.ep}) must be at least 1")

    @property
    def gpus_per_rank(self) -> int:
        return self.cp

    def check(self, shape: ModelShape, dp: int) -> None:
        """Raise ``ValueError`` unless the experts split over ``ep`` of the stage's GPUs."""
        if self.ep == 1:
            return
        if not shape.is_moe:
            raise ValueError(f"ep={self.ep} needs an MoE model: set ep to 1 for a dense one")
        if shape.experts % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide the {shape.experts} experts")
        if (dp * self.cp) % self.ep:
            raise ValueError(
                f"ep ({self.ep}) must divide dp x cp ({dp} x {self.cp}), the GPUs of a stage"
            )


NO_SHARDING = Sharding()


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitCosts:
    """One placement unit on one GPU for one micro-batch: seconds and bytes.

    ``state_bytes`` is what the unit keeps across steps on a GPU (parameters, gradients,
    optimizer state), ``activation_bytes`` what one micro-batch's forward keeps for its backward;
    ``grad_bytes`` are the gradients the data-parallel reduction moves, weighted by the share of
    the ring each crosses. ``recompute_bytes`` is what a checkpointed unit holds for a moment
    while it recomputes its forward in the backward (0 for a unit that is not checkpointed),
    ``backward_bytes`` what its backward holds for a moment beyond that (gradients of its
    widest intermediates, of the logits, of its largest weight), ``held_for_weight_bytes``
    what a split backward's I keeps for its W.
    """

    forward_s: float
    input_grad_s: float
    weight_grad_s: float
    activation_bytes: float
    state_bytes: float
    allreduce_bytes: float
    recompute_bytes: float = 0.0
    backward_bytes: float = 0.0
    held_for_weight_bytes: float = 0.0

    @property
    def seconds(self) -> float:
        return self.forward_s + self.input_grad_s + self.weight_grad_s


def _ring(n: int) -> float:
    """Share of a buffer each GPU sends in a ring all-reduce over ``n`` GPUs."""
    return 2 * (n - 1) / n


def unit_costs(
    shape: ModelShape,
    unit: int,
    micro_batch_size: int,
    device: Device,
    *,
    dp: int = 1,
    sharding: Sharding = NO_SHARDING,
    checkpointing: bool = False,
) -> UnitCosts:
    """What ``unit`` costs each GPU of its stage per micro-batch, under ``sharding``.

    Compute is the unit's FLOPs on the GPU's ``1 / cp`` of the tokens over ``matmul_flops``.
    Communication inside a stage is counted as exposed (not overlapped): ring attention passes
    K and V (``2 tokens d`` elements per hop, ``cp - 1`` hops; twice that backward) and expert
    parallelism sends each token's hidden state to its ``top_k`` experts and back
    (``(ep - 1) / ep`` of them remote), forward and backward, over NVLink within a node
    and ``p2p_bandwidth`` across nodes. Memory is what the trainer holds
    (``tidal_plan.modelshape``): a micro-batch's saved tensors, its bf16 weight copies under
    autocast (of the GPU's own experts only), and what the backward holds for a moment. A
    decoder layer under activation ``checkpointing`` keeps only its output (fp32, as the agent
    passes the hidden state between units, the next unit's input) and runs its forward again
    in the backward, before its input gradient.
    """
    tokens = micro_batch_size * shape.seq_len / sharding.cp
    dtype = device.dtype_bytes
    flops = unit_flops(shape, unit, tokens)
    rate = device.matmul_flops
    comm = 0.0
    if shape.unit_kind(unit) == "block":
        hidden = tokens * shape.d_model * dtype
        if sharding.cp > 1:
            comm += 2 * hidden * (sharding.cp - 1) / device.bandwidth(sharding.cp)
        if sharding.ep > 1:
            a2a = 2 * hidden * shape.top_k * (sharding.ep - 1) / sharding.ep
            comm += a2a / device.bandwidth(sharding.ep)
    params, experts = unit_params(shape, unit), unit_expert_params(shape, unit)
    dense = params - experts
    replicas = dp * sharding.cp  # GPUs that hold a dense parameter of this stage
    expert_replicas = replicas // sharding.ep
    per_param = 8 + (4 if dtype == 2 else 0)  # two fp32 moments (+ an fp32 master copy)
    shard, expert_shard = (
        (replicas, expert_replicas) if sharding.distributed_optimizer else (1, 1)
    )
    local_experts = experts / sharding.ep
    state = (
        2 * dtype * (dense + local_experts)  # parameters and gradients
        + per_param * (dense / shard + local_experts / expert_shard)
    )
    allreduce = dtype * (dense * _ring(replicas) + local_experts * _ring(expert_replicas))
    forward_s = flops.forward / rate + comm
    if sharding.megatron:
        activations = korthikanti_activation_bytes(shape, unit, micro_batch_size,
                                                   dtype) / sharding.cp
        backward = held_for_weight = 0.0
    else:
        copied = unit_matmul_weights(shape, unit) - experts * (1 - 1 / sharding.ep)
        activations = (unit_saved_bytes(shape, unit, micro_batch_size, dtype) / sharding.cp
                       + (2 * copied if dtype == 2 else 0.0))
        backward = unit_backward_bytes(shape, unit, tokens, dtype)
        held_for_weight = unit_output_grad_bytes(shape, unit, tokens, dtype)
    recompute = checkpointing and shape.unit_kind(unit) == "block"
    return UnitCosts(
        forward_s=forward_s,
        input_grad_s=flops.input_grad / rate + 2 * comm + (forward_s if recompute else 0.0),
        weight_grad_s=flops.weight_grad / rate,
        activation_bytes=tokens * shape.d_model * 4 if recompute else activations,
        state_bytes=state,
        allreduce_bytes=allreduce,
        recompute_bytes=activations if recompute else 0.0,
        backward_bytes=backward,
        held_for_weight_bytes=held_for_weight,
    )


@functools.lru_cache(maxsize=256)
def model_unit_costs(
    shape: ModelShape,
    micro_batch_size: int,
    device: Device,
    dp: int = 1,
    sharding: Sharding = NO_SHARDING,
    checkpointing: bool = False,
) -> tuple[UnitCosts, ...]:
    """``unit_costs`` of every placement unit, in unit order.

    Cached: a search prices thousands of layouts over a handful of (micro-batch size, dp).
    """
    return tuple(
        unit_costs(shape, u, micro_batch_size, device, dp=dp, sharding=sharding,
                   checkpointing=checkpointing)
        for u in range(shape.num_units)
    )


def layout_unit_costs(
    shape: ModelShape, layout: Layout, device: Device, sharding: Sharding = NO_SHARDING
) -> tuple[UnitCosts, ...]:
    """``model_unit_costs`` for ``layout``'s micro-batch size, dp and checkpointing."""
    return model_unit_costs(shape, layout.micro_batch_size, device, layout.dp, sharding,
                            layout.activation_checkpointing)


# --- a layout on a device ------------------------------------------------------------------------


def _check_layout(shape: ModelShape, layout: Layout) -> None:
    if layout.num_units != shape.num_units:
        raise ValueError(
            f"layout {layout.describe()} covers {layout.num_units} units but the model has "
            f"{shape.num_units}: build the layout with num_units={shape.num_units}"
        )


def _stage_slices(layout: Layout) -> list[slice]:
    """Which units each stage of ``layout`` holds, as slices of the units in order."""
    edges = itertools.accumulate(layout.partition, initial=0)
    return list(itertools.starmap(slice, itertools.pairwise(edges)))


def stage_costs(units: Sequence[UnitCosts], layout: Layout, comm: float,
                message: float = 0.0) -> Costs:
    """The dry run's per-stage costs of ``layout``: each stage sums its units.

    Where stages talk across ranks, each pipeline message is a ``message``-byte buffer: a
    stage keeps the input it received until its backward, and the runtime keeps what it sent
    (its output, its input gradient) until the step's end, where it waits for its sends."""
    stage_units = _stage_slices(layout)
    last = layout.num_stages - 1

    def per_stage(field: str) -> tuple[float, ...]:
        column = list(map(operator.attrgetter(field), units))
        return tuple(map(sum, map(column.__getitem__, stage_units)))

    apart = message if layout.pp > 1 else 0.0
    return Costs(
        forward=per_stage("forward_s"),
        input_grad=per_stage("input_grad_s"),
        weight_grad=per_stage("weight_grad_s"),
        comm=comm,
        activation_bytes=tuple(a + (apart if s > 0 else 0.0)
                               for s, a in enumerate(per_stage("activation_bytes"))),
        # A first stage has no input gradient: its W is the whole backward. Another's I also
        # makes the input gradient it sends.
        held_for_weight_bytes=(0.0, *(g + apart for g in per_stage("held_for_weight_bytes")[1:])),
        retained_bytes=tuple(apart * ((s > 0) + (s < last)) for s in range(last + 1)),
    )


def message_bytes(shape: ModelShape, micro_batch_size: int,
                  sharding: Sharding = NO_SHARDING) -> float:
    """A pipeline message's buffer on each GPU that Tidal's runtime keeps: its share of one
    micro-batch's hidden state, fp32 (the trainer passes the hidden state between units and
    ranks in fp32). None counted for ``Sharding.megatron``."""
    if sharding.megatron:
        return 0.0
    return micro_batch_size * shape.seq_len / sharding.cp * shape.d_model * 4



def message_seconds(
    shape: ModelShape, micro_batch_size: int, device: Device, sharding: Sharding = NO_SHARDING
) -> float:
    """One message between pipeline neighbours: each GPU's share of the hidden state."""
    tokens = micro_batch_size * shape.seq_len / sharding.cp
    message_bytes = tokens * shape.d_model * device.dtype_bytes
    return message_bytes / device.p2p_bandwidth + device.p2p_latency_s


def model_costs(
    shape: ModelShape, layout: Layout, device: Device, sharding: Sharding = NO_SHARDING
) -> Costs:
    """Per-stage costs of ``layout`` for the dry run, in seconds and bytes (``unit_costs``).

    A message between neighbours carries one micro-batch's hidden state (``mbs seq d``
    elements, split over ``cp``) and costs its bytes over ``p2p_bandwidth`` plus
    ``p2p_latency_s``.
    """
    _check_layout(shape, layout)
    units = layout_unit_costs(shape, layout, device, sharding)
    return stage_costs(units, layout, message_seconds(shape, layout.micro_batch_size, device,
                                                      sharding),
                       message_bytes(shape, layout.micro_batch_size, sharding))


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """What a predictor expects of one step of a layout.

    ``peak_memory_bytes`` has one entry per pipeline rank (every data-parallel replica is the
    same), per GPU; ``fits`` says every rank stays within the device's memory.
    """

    step_seconds: float
    tokens_per_second: float
    pipeline_seconds: float
    optimizer_seconds: float
    allreduce_seconds: float
    bubble_fraction: float
    peak_memory_bytes: tuple[float, ...]
    fits: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class StepModel:
    """A layout's step before its dry run: the pipeline's costs and what follows it.

    ``after_pipeline_s`` (the all-reduce and the optimizer) adds to the simulated makespan;
    ``state_bytes`` is each pipeline rank's memory besides the dry run's: its state and the
    most its backward holds for a moment.
    """

    costs: Costs
    allreduce_s: float
    optimizer_s: float
    state_bytes: tuple[float, ...]
    tokens: int
    memory_bytes: float

    @property
    def after_pipeline_s(self) -> float:
        return self.allreduce_s + self.optimizer_s

    def finish(self, makespan: float, bubble: float, peak: Sequence[float]) -> Prediction:
        step = makespan + self.after_pipeline_s
        memory = tuple(s + a for s, a in zip(self.state_bytes, peak, strict=True))
        return Prediction(
            step_seconds=step,
            tokens_per_second=self.tokens / step,
            pipeline_seconds=makespan,
            optimizer_seconds=self.optimizer_s,
            allreduce_seconds=self.allreduce_s,
            bubble_fraction=bubble,
            peak_memory_bytes=memory,
            fits=all(p <= self.memory_bytes for p in memory),
        )


def step_model(
    shape: ModelShape, layout: Layout, device: Device, sharding: Sharding = NO_SHARDING
) -> StepModel:
    """Everything ``predict`` needs but the dry run (see there)."""
    _check_layout(shape, layout)
    sharding.check(shape, layout.dp)
    units = layout_unit_costs(shape, layout, device, sharding)
    comm = message_seconds(shape, layout.micro_batch_size, device, sharding)
    stage_units = _stage_slices(layout)

    def per_rank(column: list[float], total: Callable[[Iterable[float]], float] = sum,
                 ) -> list[float]:
        """``total`` of each rank's units, in order: its stages' in stage order."""
        stages = list(map(column.__getitem__, stage_units))
        if layout.virtual_stages == 1:
            return list(map(total, stages))
        return [total(itertools.chain.from_iterable(stages[rank::layout.pp]))
                for rank in range(layout.pp)]

    held = per_rank([u.state_bytes for u in units])
    transient = per_rank(list(_backward_peaks(units, stage_units)), max)
    state = tuple(s + t + device.memory_overhead_bytes
                  for s, t in zip(held, transient, strict=True))
    moved = max(per_rank([u.allreduce_bytes for u in units]))
    return StepModel(
        costs=stage_costs(units, layout, comm,
                          message_bytes(shape, layout.micro_batch_size, sharding)),
        allreduce_s=moved / device.p2p_bandwidth,
        optimizer_s=2 * max(held) / device.memory_bandwidth,
        state_bytes=state,
        tokens=layout.dp * layout.num_micro_batches * layout.micro_batch_size * shape.seq_len,
        memory_bytes=device.memory_bytes,
    )


def _backward_peaks(units: Sequence[UnitCosts], stage_units: Sequence[slice]
                    ) -> Iterable[float]:
    """Per unit, what its backward adds for a moment to the activations a rank holds: its
    recomputed activations (checkpointing) and backward working set, less the activations of
    the units after it on its stage, which their backward has freed by then."""
    for units_of in stage_units:
        stage = units[units_of]
        freed = 0.0
        peaks = []
        for unit in reversed(stage):
            peaks.append(max(0.0, unit.recompute_bytes + unit.backward_bytes - freed))
            freed += unit.activation_bytes
        yield from reversed(peaks)


def predict(
    shape: ModelShape, layout: Layout, device: Device, sharding: Sharding = NO_SHARDING
) -> Prediction:
    """Step time, throughput and per-rank peak memory of ``layout`` for ``shape`` on ``device``.

    The step is the simulated pipeline makespan, then the data-parallel gradient all-reduce
    (ring over the GPUs holding each parameter, over ``p2p_bandwidth``, not overlapped with
    the backward), then the optimizer step (memory-bound: AdamW reads and writes each GPU's
    whole state once, over ``memory_bandwidth``). Ranks run in parallel, so each phase costs
    its slowest rank. Memory is a GPU's state, the dry run's peak of what micro-batches in
    flight keep (activations, what a split backward keeps for W, pipeline messages) and the
    most a unit's backward holds for a moment, plus the device's ``memory_overhead_bytes``
    (zero but where a run measured it: CUDA's workspaces, NCCL's buffers, fragmentation).
    """
    model = step_model(shape, layout, device, sharding)
    sim = estimate_step(layout, model.costs)
    return model.finish(sim.makespan, sim.bubble_fraction, sim.peak_memory)
