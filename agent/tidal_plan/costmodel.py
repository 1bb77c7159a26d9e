"""Modeling-based predictor: step time and memory of a layout from FLOPs, bytes and a device.

No profile is needed, so it plans before the first step and for models far larger than any
machine at hand. Each placement unit gets forward / input-grad / weight-grad FLOPs, the bytes
its forward keeps for the backward, and the bytes of its parameters and optimizer state; a
stage sums its units; the dry-run simulator runs the layout's lowered action lists with the
resulting times. Every estimate is first-order (see the assumptions in each function's
docstring): good for ranking layouts, not for promising seconds.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from tidal_plan.devices import Device
from tidal_plan.layout import Layout
from tidal_plan.simulate import Costs, estimate_step


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The shape of the GPT model of ``tidal_agent.model``, optionally with MoE blocks.

    With ``experts > 0`` every block's MLP becomes a router (``d_model x experts``, no bias)
    plus ``experts`` routed and ``shared_experts`` always-on experts, each an MLP
    ``d_model -> expert_hidden -> d_model`` with biases; a token runs ``top_k`` routed experts
    and all shared ones. ``mlp_ratio`` only applies to dense blocks.
    """

    layers: int
    d_model: int
    heads: int
    vocab: int
    seq_len: int
    mtp_heads: int = 0
    mlp_ratio: int = 4
    experts: int = 0
    top_k: int = 0
    expert_hidden: int | None = None
    shared_experts: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "heads", "vocab", "seq_len", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} ({getattr(self, name)}) must be at least 1")
        if self.mtp_heads < 0:
            raise ValueError(f"ModelShape.mtp_heads ({self.mtp_heads}) must be non-negative")
        if self.d_model % self.heads:
            raise ValueError(
                f"heads ({self.heads}) must divide d_model ({self.d_model}): pick a divisor"
            )
        if self.experts < 0 or self.shared_experts < 0:
            raise ValueError("experts and shared_experts must be non-negative")
        if self.experts == 0:
            if self.top_k or self.shared_experts or self.expert_hidden is not None:
                raise ValueError(
                    "top_k, shared_experts and expert_hidden describe MoE blocks: set experts "
                    "> 0 or leave them at their defaults for a dense model"
                )
            return
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"top_k ({self.top_k}) must be between 1 and experts ({self.experts})"
            )
        if self.expert_hidden is None or self.expert_hidden < 1:
            raise ValueError("an MoE model needs expert_hidden, the FFN width of one expert")

    @property
    def num_units(self) -> int:
        return self.layers + 2 + self.mtp_heads

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def unit_kind(self, unit: int) -> str:
        """``embed``, ``block`` or ``head`` (the LM head and every MTP head)."""
        if not 0 <= unit < self.num_units:
            raise ValueError(f"unit {unit} is outside the model's {self.num_units} units")
        if unit == 0:
            return "embed"
        return "block" if unit <= self.layers else "head"


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitFlops:
    """Matmul FLOPs of one unit for some number of tokens, per backward half."""

    forward: float
    input_grad: float
    weight_grad: float


# --- parameters ----------------------------------------------------------------------------------


def _expert_params(d: int, hidden: int) -> int:
    return 2 * d * hidden + hidden + d  # fc1 weight + bias, fc2 weight + bias


def _attention_params(d: int) -> int:
    return 4 * d * d + 4 * d  # qkv (3d^2 + 3d) + proj (d^2 + d)


def _mlp_params(shape: ModelShape, *, active: bool) -> int:
    d = shape.d_model
    if not shape.is_moe:
        return _expert_params(d, shape.mlp_ratio * d)
    routed = shape.top_k if active else shape.experts
    hidden = shape.expert_hidden or 0  # never 0 here: ModelShape insists on it for MoE
    router = d * shape.experts  # every token scores every expert
    return router + (routed + shape.shared_experts) * _expert_params(d, hidden)


def _unit_params(shape: ModelShape, unit: int, *, active: bool) -> int:
    d = shape.d_model
    kind = shape.unit_kind(unit)
    if kind == "embed":
        return (shape.vocab + shape.seq_len) * d  # wte + wpe
    if kind == "head":
        return 2 * d + d * shape.vocab  # LayerNorm + projection without bias
    return 4 * d + _attention_params(d) + _mlp_params(shape, active=active)  # 2 LayerNorms


def unit_params(shape: ModelShape, unit: int) -> int:
    """Parameters of ``unit``, every expert counted."""
    return _unit_params(shape, unit, active=False)


def unit_active_params(shape: ModelShape, unit: int) -> int:
    """Parameters one token touches in ``unit``: ``top_k`` routed plus the shared experts.

    The embedding counts whole, as parameter counts usually do, although a token reads one row.
    """
    return _unit_params(shape, unit, active=True)


def total_params(shape: ModelShape) -> int:
    return sum(unit_params(shape, u) for u in range(shape.num_units))


def active_params(shape: ModelShape) -> int:
    return sum(unit_active_params(shape, u) for u in range(shape.num_units))


# --- FLOPs ---------------------------------------------------------------------------------------


def unit_flops(shape: ModelShape, unit: int, tokens: int) -> UnitFlops:
    """Matmul FLOPs of ``unit`` over ``tokens`` tokens (micro-batch size x seq_len).

    Assumptions: a matmul with ``P`` weights costs ``2 P`` FLOPs per token forward, ``2 P`` for
    the input gradient and ``2 P`` for the weight gradient; biases, LayerNorms, GELU, softmax
    and the router's top-k are counted as if they were weights too (well under 1%). Causal
    attention adds ``QK^T`` and ``AV``, each ``2 seq d`` per token, halved by the mask:
    ``2 seq d`` per token forward and twice that for the input gradient (dQ, dK from dS; dV,
    dS from dO); it has no weights. The embedding is a lookup: no FLOPs, no input gradient,
    and its scatter-add weight gradient is counted as free.
    """
    if tokens < 0:
        raise ValueError(f"tokens ({tokens}) must be non-negative")
    if shape.unit_kind(unit) == "embed":
        return UnitFlops(forward=0.0, input_grad=0.0, weight_grad=0.0)
    linear = 2.0 * unit_active_params(shape, unit) * tokens
    attention = 0.0
    if shape.unit_kind(unit) == "block":
        attention = 2.0 * shape.seq_len * shape.d_model * tokens
    return UnitFlops(
        forward=linear + attention, input_grad=linear + 2 * attention, weight_grad=linear
    )


# --- memory --------------------------------------------------------------------------------------


def unit_activation_bytes(
    shape: ModelShape,
    unit: int,
    micro_batch_size: int,
    dtype_bytes: int,
    *,
    flash_attention: bool = True,
) -> float:
    """Bytes one micro-batch's forward of ``unit`` keeps until its backward frees them.

    Blocks follow Korthikanti et al. (2022), no recomputation, no tensor or sequence
    parallelism: per token ``d (34 + 5 heads seq / d)`` bytes in 16-bit, of which attention
    keeps ``11 d`` (qkv input, Q, K, V, proj input, dropout mask), the two LayerNorms ``4 d``
    and the MLP ``19 d`` (fc1 input ``2 d``, GELU input and output ``2 r d`` each, a dropout
    mask ``d``). An MoE MLP keeps one input copy per expert a token visits plus GELU input and
    output at ``expert_hidden`` per visit. ``flash_attention`` (SDPA, as our model runs on
    GPU) drops the ``5 heads seq^2`` attention-score term. Everything scales by
    ``dtype_bytes / 2``. A loss head keeps its LayerNorm and projection inputs and the logits;
    the embedding keeps only the token ids.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must be at least 1")
    tokens = micro_batch_size * shape.seq_len
    d = shape.d_model
    kind = shape.unit_kind(unit)
    if kind == "embed":
        return float(tokens * 8)  # int64 ids for the scatter-add of the weight gradient
    if kind == "head":
        return float(tokens * (2 * d + shape.vocab) * dtype_bytes)
    if shape.is_moe:
        visits = shape.top_k + shape.shared_experts
        mlp = 1 + visits * (2 + 4 * (shape.expert_hidden or 0) / d)
    else:
        mlp = 3 + 4 * shape.mlp_ratio  # 19 at mlp_ratio 4
    per_token = d * (11 + 4 + mlp)
    if not flash_attention:
        per_token += 5 * shape.heads * shape.seq_len
    return tokens * per_token * dtype_bytes / 2


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
    """

    cp: int = 1
    ep: int = 1
    distributed_optimizer: bool = False

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


def unit_expert_params(shape: ModelShape, unit: int) -> int:
    """Parameters of ``unit``'s routed experts, the part expert parallelism shards."""
    if shape.unit_kind(unit) != "block" or not shape.is_moe:
        return 0
    return shape.experts * _expert_params(shape.d_model, shape.expert_hidden or 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitCosts:
    """One placement unit on one GPU for one micro-batch: seconds and bytes.

    ``state_bytes`` is what the unit keeps across steps on a GPU (parameters, gradients,
    optimizer state), ``activation_bytes`` what one micro-batch's forward keeps for its backward;
    ``grad_bytes`` are the gradients the data-parallel reduction moves, weighted by the share of
    the ring each crosses.
    """

    forward_s: float
    input_grad_s: float
    weight_grad_s: float
    activation_bytes: float
    state_bytes: float
    allreduce_bytes: float

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
) -> UnitCosts:
    """What ``unit`` costs each GPU of its stage per micro-batch, under ``sharding``.

    Compute is the unit's FLOPs on the GPU's ``1 / cp`` of the tokens over ``matmul_flops``.
    Communication inside a stage is counted as exposed (not overlapped): ring attention passes
    K and V (``2 tokens d`` elements per hop, ``cp - 1`` hops; twice that backward) and expert
    parallelism sends each token's hidden state to its ``top_k`` experts and back
    (``(ep - 1) / ep`` of them remote), forward and backward, over NVLink within a node
    and ``p2p_bandwidth`` across nodes.
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
    return UnitCosts(
        forward_s=flops.forward / rate + comm,
        input_grad_s=flops.input_grad / rate + 2 * comm,
        weight_grad_s=flops.weight_grad / rate,
        activation_bytes=unit_activation_bytes(shape, unit, micro_batch_size, dtype)
        / sharding.cp,
        state_bytes=state,
        allreduce_bytes=allreduce,
    )


@functools.lru_cache(maxsize=256)
def model_unit_costs(
    shape: ModelShape,
    micro_batch_size: int,
    device: Device,
    dp: int = 1,
    sharding: Sharding = NO_SHARDING,
) -> tuple[UnitCosts, ...]:
    """``unit_costs`` of every placement unit, in unit order.

    Cached: a search prices thousands of layouts over a handful of (micro-batch size, dp).
    """
    return tuple(
        unit_costs(shape, u, micro_batch_size, device, dp=dp, sharding=sharding)
        for u in range(shape.num_units)
    )


# --- a layout on a device ------------------------------------------------------------------------


def _check_layout(shape: ModelShape, layout: Layout) -> None:
    if layout.num_units != shape.num_units:
        raise ValueError(
            f"layout {layout.describe()} covers {layout.num_units} units but the model has "
            f"{shape.num_units}: build the layout with num_units={shape.num_units}"
        )


def stage_costs(units: Sequence[UnitCosts], layout: Layout, comm: float) -> Costs:
    """The simulator's per-stage costs of ``layout``: each stage sums its units."""
    edges = list(itertools.accumulate(layout.partition, initial=0))

    def per_stage(field: str) -> tuple[float, ...]:
        column = [getattr(u, field) for u in units]
        return tuple(sum(column[a:b]) for a, b in itertools.pairwise(edges))

    return Costs(
        forward=per_stage("forward_s"),
        input_grad=per_stage("input_grad_s"),
        weight_grad=per_stage("weight_grad_s"),
        comm=comm,
        activation_bytes=per_stage("activation_bytes"),
    )


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
    """Per-stage costs of ``layout`` for the simulator, in seconds and bytes (``unit_costs``).

    A message between neighbours carries one micro-batch's hidden state (``mbs seq d``
    elements, split over ``cp``) and costs its bytes over ``p2p_bandwidth`` plus
    ``p2p_latency_s``.
    """
    _check_layout(shape, layout)
    units = model_unit_costs(shape, layout.micro_batch_size, device, layout.dp, sharding)
    return stage_costs(units, layout, message_seconds(shape, layout.micro_batch_size, device,
                                                      sharding))


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
    """A layout's step before simulation: the pipeline's costs and what follows it.

    ``after_pipeline_s`` (the all-reduce and the optimizer) adds to the simulated makespan;
    ``state_bytes`` is each pipeline rank's memory before activations.
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
    """Everything ``predict`` needs but the simulation (see there)."""
    _check_layout(shape, layout)
    sharding.check(shape, layout.dp)
    units = model_unit_costs(shape, layout.micro_batch_size, device, layout.dp, sharding)
    comm = message_seconds(shape, layout.micro_batch_size, device, sharding)
    edges = list(itertools.accumulate(layout.partition, initial=0))

    def per_rank(column: list[float]) -> list[float]:
        return [
            sum(itertools.chain.from_iterable(
                column[edges[stage]:edges[stage + 1]] for stage in layout.rank_stages(rank)
            ))
            for rank in range(layout.pp)
        ]

    state = tuple(per_rank([u.state_bytes for u in units]))
    moved = max(per_rank([u.allreduce_bytes for u in units]))
    return StepModel(
        costs=stage_costs(units, layout, comm),
        allreduce_s=moved / device.p2p_bandwidth,
        optimizer_s=2 * max(state) / device.memory_bandwidth,
        state_bytes=state,
        tokens=layout.dp * layout.num_micro_batches * layout.micro_batch_size * shape.seq_len,
        memory_bytes=device.memory_bytes,
    )


def predict(
    shape: ModelShape, layout: Layout, device: Device, sharding: Sharding = NO_SHARDING
) -> Prediction:
    """Step time, throughput and per-rank peak memory of ``layout`` for ``shape`` on ``device``.

    The step is the simulated pipeline makespan, then the data-parallel gradient all-reduce
    (ring over the GPUs holding each parameter, over ``p2p_bandwidth``, not overlapped with
    the backward), then the optimizer step (memory-bound: AdamW reads and writes each GPU's
    whole state once, over ``memory_bandwidth``). Ranks run in parallel, so each phase costs
    its slowest rank. Memory is a GPU's state plus the simulator's peak of live activations;
    CUDA context, workspaces, communication buffers and fragmentation are not counted, so
    leave headroom.
    """
    model = step_model(shape, layout, device, sharding)
    sim = estimate_step(layout, model.costs)
    return model.finish(sim.makespan, sim.bubble_fraction, sim.peak_memory)


# --- FlexTrain's configurations -----------------------------------------------------------------

# The Small / Medium / Large models of FlexTrain (MLSys 2026), table "Real-world tests": layers,
# MTP heads and sequence length from the slides, the rest chosen here so that the parameter
# counts (embedding, blocks, LM and MTP heads all included) land near the slides' active/total
# figures; DeepSeek-V3's vocabulary. Global batch sizes (in sequences) are in FLEXTRAIN_BATCH.
# Counts with this module's formulas (active / total): small 1.002B / 7.026B, medium
# 6.084B / 61.57B, large 29.85B / 594.2B. The blocks are MoE throughout (no dense first layers)
# with standard multi-head attention and learned positions, so the attention share differs
# from DeepSeek-V3's MLA.
_DEEPSEEK_VOCAB = 129280
FLEXTRAIN: dict[str, ModelShape] = {
    "small": ModelShape(
        layers=15, d_model=1536, heads=12, vocab=_DEEPSEEK_VOCAB, seq_len=8192, mtp_heads=2,
        experts=256, top_k=1, expert_hidden=512, shared_experts=1,
    ),
    "medium": ModelShape(
        layers=29, d_model=3072, heads=24, vocab=_DEEPSEEK_VOCAB, seq_len=32768, mtp_heads=2,
        experts=160, top_k=8, expert_hidden=2048, shared_experts=1,
    ),
    "large": ModelShape(
        layers=61, d_model=7168, heads=56, vocab=_DEEPSEEK_VOCAB, seq_len=8192, mtp_heads=2,
        experts=256, top_k=4, expert_hidden=2560, shared_experts=2,
    ),
}
FLEXTRAIN_BATCH = {"small": 1024, "medium": 256, "large": 768}
