"""The model's shape and what each placement unit counts: parameters, FLOPs, activation bytes.

Device-free arithmetic on ``ModelShape`` (a job's model, or an MoE model the trainer cannot
build), and the shapes of FlexTrain's Small / Medium / Large models. ``tidal_plan.costmodel``
turns these counts into seconds and bytes on a device.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal_api.spec import ModelSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The cost model's view of a model: the GPT of ``tidal_agent.model``, optionally with MoE
    blocks.

    A job's model is described once, by its ``ModelSpec`` (the trainer, reshard plans,
    checkpoints and snapshots all read that); ``ModelShape.of`` is the one way from it to here.
    This type stays beside it for the shapes the planner prices but no job spec can describe:
    FlexTrain's MoE models (the trainer builds dense blocks only, so the spec has no expert
    fields for every worker to refuse) with DeepSeek-V3's 129k vocabulary.

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
    # A Hugging Face model's differences from the built-in GPT (whose values the defaults are):
    # grouped-query attention, a head size of its own, an FFN width that is no multiple of
    # d_model, a gated MLP (gate, up, down), RMSNorm (one vector, not two), which linear layers
    # have biases, per-head q/k norms (Qwen3), and learned positions (their table's length).
    kv_heads: int | None = None
    head_dim: int | None = None
    ffn_hidden: int | None = None
    gated_mlp: bool = False
    norm_vectors: int = 2
    qkv_bias: bool = True
    out_bias: bool = True
    mlp_bias: bool = True
    qk_norm: bool = False
    positions: int | None = -1  # -1: learned, seq_len of them; None: rotary, no table
    dropout: bool = False  # the built-in GPT's dropout (its masks are kept for the backward)

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

    @classmethod
    def of(cls, model: ModelSpec) -> ModelShape:
        """The shape of a job's (dense) model: the built-in GPT's, or what a Hugging Face
        model's config says (with the library's defaults for what it leaves out)."""
        sizes = dict(layers=model.layers, d_model=model.d_model, heads=model.heads,
                     vocab=model.vocab, seq_len=model.seq_len)
        if model.huggingface is None:
            return cls(**sizes, mtp_heads=model.mtp_heads, mlp_ratio=model.mlp_ratio,
                       dropout=model.dropout > 0)
        config = model.huggingface.config
        kind = config["model_type"]
        if kind == "gpt2":  # the built-in GPT's layout, with its own FFN width and positions
            return cls(**sizes, ffn_hidden=config.get("n_inner") or 4 * model.d_model,
                       positions=config.get("n_positions", 1024))
        defaults = _HF_DEFAULTS[kind]
        attention_bias = config.get("attention_bias", False)
        return cls(
            **sizes,
            kv_heads=config.get("num_key_value_heads") or model.heads,
            head_dim=config.get("head_dim") or defaults["head_dim"] or None,
            ffn_hidden=config.get("intermediate_size", defaults["intermediate_size"]),
            gated_mlp=True, norm_vectors=1, positions=None,
            qkv_bias=attention_bias or kind == "qwen2", out_bias=attention_bias,
            mlp_bias=config.get("mlp_bias", False), qk_norm=kind == "qwen3",
        )

    @property
    def attention_width(self) -> int:
        """Heads times the head size: the queries' width (d_model unless set apart)."""
        return self.heads * (self.head_dim or self.d_model // self.heads)

    @property
    def kv_width(self) -> int:
        """Keys' (and values') width: the key-value heads times the head size."""
        return (self.kv_heads or self.heads) * (self.attention_width // self.heads)

    @property
    def hidden(self) -> int:
        """The dense MLP's width."""
        return self.ffn_hidden or self.mlp_ratio * self.d_model

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


def _attention_params(shape: ModelShape) -> int:
    """q, k, v and the output projection (4d^2 + 4d for the built-in GPT), q/k norms."""
    d, width, kv = shape.d_model, shape.attention_width, shape.kv_width
    qkv = d * (width + 2 * kv) + (width + 2 * kv if shape.qkv_bias else 0)
    out = width * d + (d if shape.out_bias else 0)
    return qkv + out + (2 * (width // shape.heads) if shape.qk_norm else 0)


def _mlp_params(shape: ModelShape, *, active: bool) -> int:
    d = shape.d_model
    if not shape.is_moe:
        if shape.gated_mlp:  # gate and up (d -> hidden), down (hidden -> d)
            return 3 * d * shape.hidden + (2 * shape.hidden + d if shape.mlp_bias else 0)
        return _expert_params(d, shape.hidden)
    routed = shape.top_k if active else shape.experts
    hidden = shape.expert_hidden or 0  # never 0 here: ModelShape insists on it for MoE
    router = d * shape.experts  # every token scores every expert
    return router + (routed + shape.shared_experts) * _expert_params(d, hidden)


def _unit_params(shape: ModelShape, unit: int, *, active: bool) -> int:
    d = shape.d_model
    kind = shape.unit_kind(unit)
    norm = shape.norm_vectors * d  # LayerNorm: scale and shift; RMSNorm: scale
    if kind == "embed":
        positions = shape.seq_len if shape.positions == -1 else shape.positions or 0
        return (shape.vocab + positions) * d  # token (and position) tables
    if kind == "head":
        return norm + d * shape.vocab  # the final norm + projection without bias
    return 2 * norm + _attention_params(shape) + _mlp_params(shape, active=active)


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


def unit_expert_params(shape: ModelShape, unit: int) -> int:
    """Parameters of ``unit``'s routed experts, the part expert parallelism shards."""
    if shape.unit_kind(unit) != "block" or not shape.is_moe:
        return 0
    return shape.experts * _expert_params(shape.d_model, shape.expert_hidden or 0)


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
        attention = 2.0 * shape.seq_len * shape.attention_width * tokens
    return UnitFlops(
        forward=linear + attention, input_grad=linear + 2 * attention, weight_grad=linear
    )


# --- memory --------------------------------------------------------------------------------------
#
# What Tidal's trainer holds, counted tensor by tensor from what autograd saves in its units
# (tidal_agent.model, tidal_agent.hf) and checked on the CPU against the bytes the trainer
# allocates (bench/predictor.py, tidal_agent.measure.TensorMemory). Two facts of the trainer
# shape every count: the hidden state between units and inside a block's residual stream is
# fp32 whatever the precision, and parameters are fp32, so that under bf16 autocast every
# matmul casts its input (each matmul its own copy) and its weight to bf16 and keeps both, and
# norms run in fp32. ``a`` below is an activation element's size: 2 under bf16 autocast, 4 in
# fp32; counts are per token.


def _norm_bytes(shape: ModelShape, consumers: int, a: int) -> float:
    """A norm and the input its ``consumers`` matmuls keep: LayerNorm keeps its mean and
    reciprocal deviation (its input is the residual, counted where it is made); RMSNorm also
    its normalised fp32 input. In fp32 the matmuls keep the norm's output itself, under bf16
    autocast one bf16 copy each."""
    d = shape.d_model
    own = 4 * d + 4 if shape.norm_vectors == 1 else 8
    return own + (4 * d if a == 4 else consumers * 2 * d)


def _attention_bytes(shape: ModelShape, a: int, flash_attention: bool) -> float:
    """Attention: the norm, queries, keys and values as attention keeps them (rotary ones
    made fp32 by the fp32 position table, then cast back under autocast), its output (the
    output projection's input) and log-sum-exp; without flash attention also the scores and
    probabilities."""
    width, kv = shape.attention_width, shape.kv_width
    rotary = shape.positions is None  # the HF families: q, k and v apart, rotary positions
    out = _norm_bytes(shape, 3 if rotary else 1, a) + a * (2 * width + 2 * kv)
    out += 4 * shape.heads  # log-sum-exp, fp32
    if shape.qk_norm:  # RMSNorm on each head's queries and keys: their fp32 normalised copies
        out += 4 * (width + kv)
    if not flash_attention:
        out += 2 * a * shape.heads * shape.seq_len
    return out


def _mlp_bytes(shape: ModelShape, a: int) -> float:
    """The MLP: its norm and the widest intermediates (GELU's input and output; gate, up,
    their activation and product for a gated MLP); an MoE MLP keeps the router's fp32 scores
    and, per expert a token visits, its copy of the token and the expert's GELU input and
    output."""
    if shape.is_moe:
        visits = shape.top_k + shape.shared_experts
        per_visit = a * (shape.d_model + 2 * (shape.expert_hidden or 0))
        return _norm_bytes(shape, 1, a) + 4 * shape.experts + visits * per_visit
    gated = shape.gated_mlp
    return _norm_bytes(shape, 2 if gated else 1, a) + (4 if gated else 2) * a * shape.hidden


def unit_matmul_weights(shape: ModelShape, unit: int) -> int:
    """The weights of ``unit``'s matmuls: what autocast copies to bf16 (every expert's: each
    sees tokens in a micro-batch of any size)."""
    d, kind = shape.d_model, shape.unit_kind(unit)
    if kind == "embed":
        return 0  # a lookup, which autocast leaves in fp32
    if kind == "head":
        return d * shape.vocab
    width, kv = shape.attention_width, shape.kv_width
    attention = d * (width + 2 * kv) + width * d
    if shape.is_moe:
        hidden = shape.expert_hidden or 0
        return attention + d * shape.experts + (
            shape.experts + shape.shared_experts) * 2 * d * hidden
    return attention + (3 if shape.gated_mlp else 2) * d * shape.hidden


def unit_saved_bytes(
    shape: ModelShape,
    unit: int,
    micro_batch_size: int,
    dtype_bytes: int,
    *,
    flash_attention: bool = True,
) -> float:
    """Bytes one micro-batch's forward of ``unit`` leaves until its backward frees them: what
    autograd keeps and the unit's output (the fp32 hidden state, which the next unit keeps as
    its input), without the bf16 weight copies (``unit_weight_copy_bytes``).

    A decoder block keeps, per token: two fp32 residual-stream tensors (after attention, and
    its output), attention's and the MLP's parts (``_attention_bytes``, ``_mlp_bytes``), and
    with dropout its masks. ``flash_attention`` (SDPA's fused kernels, on a GPU as on the CPU)
    keeps no score matrix. A loss head keeps its norm and matmul input, the fp32 log-softmax
    of the logits (the loss is computed in fp32), the targets (int64) and its output (a copy
    of its input, which the model's last unit drops); the embedding its output and the token
    ids. ``dtype_bytes`` is 2 for bf16
    autocast, 4 for fp32.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must be at least 1")
    a = dtype_bytes
    tokens = micro_batch_size * shape.seq_len
    d, kind = shape.d_model, shape.unit_kind(unit)
    output = 4 * d if unit < shape.num_units - 1 else 0  # the last unit's is dropped at once
    if kind == "embed":
        per_token = 4 * d + 8 + (4 * d if shape.dropout else 0)
    elif kind == "head":
        per_token = _norm_bytes(shape, 1, a) + 4 * shape.vocab + 8 + output
    else:
        per_token = (8 * d + _attention_bytes(shape, a, flash_attention) + _mlp_bytes(shape, a)
                     + (2 * a * d if shape.dropout else 0))
    return float(tokens * per_token)


def unit_weight_copy_bytes(shape: ModelShape, unit: int, dtype_bytes: int) -> float:
    """The bf16 copies of ``unit``'s matmul weights that one micro-batch's forward under
    autocast keeps for its backward (the weights are fp32); none in fp32."""
    return 2.0 * unit_matmul_weights(shape, unit) if dtype_bytes == 2 else 0.0


def unit_activation_bytes(
    shape: ModelShape,
    unit: int,
    micro_batch_size: int,
    dtype_bytes: int,
    *,
    flash_attention: bool = True,
) -> float:
    """Bytes one micro-batch's forward of ``unit`` keeps until its backward: its saved tensors
    and output (``unit_saved_bytes``) and its bf16 weight copies (``unit_weight_copy_bytes``).
    """
    return (unit_saved_bytes(shape, unit, micro_batch_size, dtype_bytes,
                             flash_attention=flash_attention)
            + unit_weight_copy_bytes(shape, unit, dtype_bytes))


def unit_backward_bytes(shape: ModelShape, unit: int, tokens: float, dtype_bytes: int) -> float:
    """Bytes ``unit``'s backward holds at once beyond what the forward kept, the larger of:
    the gradients of its widest intermediates (a loss head's two fp32 gradients of the logits
    in log-softmax's backward; a block's MLP: two, three for a gated MLP's product, per expert
    visit for MoE) and the gradient of its largest weight before it is added to ``.grad`` (in
    bf16, also its fp32 copy). ``tokens``: the micro-batch's, or a GPU's share of them."""
    a, d, kind = dtype_bytes, shape.d_model, shape.unit_kind(unit)
    per_weight = 6 if a == 2 else 4
    if kind == "embed":
        return 0.0
    if kind == "head":
        return float(max(tokens * 8 * shape.vocab, per_weight * d * shape.vocab))
    if shape.is_moe:
        hidden = shape.expert_hidden or 0
        visits = shape.top_k + shape.shared_experts
        return float(max(tokens * 2 * a * hidden * visits, per_weight * d * hidden))
    widest = (3 if shape.gated_mlp else 2) * a * shape.hidden
    return float(max(tokens * widest, per_weight * d * shape.hidden))


def unit_output_grad_bytes(shape: ModelShape, unit: int, tokens: float, dtype_bytes: int
                           ) -> float:
    """Bytes a split backward's input half (I) leaves for the weight half (W): the gradients
    at ``unit``'s matmul outputs (queries, keys and values, the attention's and the MLP's
    projections: gate and up apart, per expert visit for MoE; the logits) and, fp32, at its
    norms' outputs; less what I frees, a loss head's log-softmax output. The embedding has
    none (a first stage's backward is all W)."""
    a, d, kind = dtype_bytes, shape.d_model, shape.unit_kind(unit)
    if kind == "embed":
        return 0.0
    if kind == "head":
        return float(tokens * max(0, a * shape.vocab + 4 * d - 4 * shape.vocab))
    width, kv = shape.attention_width, shape.kv_width
    attention = width + 2 * kv + d
    if shape.is_moe:
        visits = shape.top_k + shape.shared_experts
        mlp = shape.experts + visits * ((shape.expert_hidden or 0) + d)
    else:
        mlp = (2 if shape.gated_mlp else 1) * shape.hidden + d
    return float(tokens * (a * (attention + mlp) + 2 * 4 * d))


def korthikanti_activation_bytes(
    shape: ModelShape,
    unit: int,
    micro_batch_size: int,
    dtype_bytes: int,
    *,
    flash_attention: bool = True,
) -> float:
    """Bytes one micro-batch's forward of ``unit`` keeps until its backward, as Megatron-LM
    keeps a model (bf16 parameters and activations throughout, no weight copies): for the
    models the planner prices but Tidal's trainer does not run (FlexTrain's presets).

    Blocks follow Korthikanti et al. (2022), no recomputation, no tensor or sequence
    parallelism: per token ``d (34 + 5 heads seq / d)`` bytes in 16-bit, of which attention
    keeps ``11 d`` (qkv input, Q, K, V, proj input, dropout mask), the two LayerNorms ``4 d``
    and the MLP ``19 d`` (fc1 input ``2 d``, GELU input and output ``2 r d`` each, a dropout
    mask ``d``). An MoE MLP keeps one input copy per expert a token visits plus GELU input and
    output at ``expert_hidden`` per visit. ``flash_attention`` drops the ``5 heads seq^2``
    attention-score term. Everything scales by ``dtype_bytes / 2``. A loss head keeps its
    LayerNorm and projection inputs and the logits; the embedding keeps only the token ids.
    The backward's own working set is not counted.
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
        mlp = 3 + (6 if shape.gated_mlp else 4) * shape.hidden / shape.d_model  # 19: GPT
    per_token = d * (11 + 4 + mlp)
    if not flash_attention:
        per_token += 5 * shape.heads * shape.seq_len
    return tokens * per_token * dtype_bytes / 2


# What transformers 5.24 puts where a family's config is silent (head_dim 0: d_model / heads).
_HF_DEFAULTS = {
    "llama": {"intermediate_size": 11008, "head_dim": 0},
    "mistral": {"intermediate_size": 14336, "head_dim": 0},
    "qwen2": {"intermediate_size": 22016, "head_dim": 0},
    "qwen3": {"intermediate_size": 22016, "head_dim": 128},
}


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
