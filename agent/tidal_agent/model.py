"""A GPT-style decoder as an ordered list of placement units, built from the job's ModelSpec.

Units, in order: the embedding, ``layers`` transformer blocks, the final norm + LM head, and
``mtp_heads`` multi-token-prediction heads. Every unit maps a hidden state to a hidden state;
loss units (LM head, MTP heads) also return a loss and pass the hidden state on through an
identity op of their own, so that autograd sums the gradient contributions of the loss heads
pairwise in unit order whatever the stage boundaries are.

Each unit initialises from a generator seeded by (seed, unit index), and parameter names stay
global (``blocks.5.mlp.fc1.weight``) on every stage, so every placement holds the same numbers
under the same names.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tidal_agent import compiled
from tidal_agent.measure import Clock, Mark, Span
from tidal_agent.seeding import derive_seed
from tidal_api.spec import ModelSpec

MTP_LOSS_WEIGHT = 0.3  # DeepSeek-V3's lambda, shared by the MTP heads


def unit_name(model: ModelSpec, unit: int) -> str:
    """The global name of placement unit ``unit``: its parameters' prefix on every stage."""
    if unit == 0:
        return "embed"
    if unit <= model.layers:
        return f"blocks.{unit - 1}"
    if unit == model.layers + 1:
        return "head"
    return f"mtp.{unit - model.layers - 2}"


class UnitContext:
    """What a unit needs besides its input: the tokens and the keys of its randomness.

    Tokens are loaded on first use: only the embedding and the loss heads read them.
    """

    __slots__ = ("seed", "step", "mb", "device", "_load", "_tokens")

    def __init__(
        self, *, seed: int, step: int, mb: int, device: torch.device,
        load: Callable[[], torch.Tensor],
    ) -> None:
        self.seed, self.step, self.mb, self.device = seed, step, mb, device
        self._load, self._tokens = load, None

    @property
    def tokens(self) -> torch.Tensor:
        """The micro-batch's samples, (micro-batch size, sample_len) int64."""
        if self._tokens is None:
            self._tokens = self._load()
        return self._tokens


def _keep_mask(shape: tuple[int, ...], p: float,
               generator: torch.Generator | None) -> torch.Tensor | None:
    # Our own mask, from a generator keyed by (seed, step, micro-batch, unit): the same mask
    # whichever rank computes the unit. Drawn outside ``Unit.compute``, so that a compiled
    # unit draws exactly what an eager one does.
    if p == 0.0 or generator is None:
        return None
    return torch.empty(shape, device=generator.device).bernoulli_(1.0 - p, generator=generator)


def _dropout(x: torch.Tensor, p: float, keep: torch.Tensor | None) -> torch.Tensor:
    return x if keep is None else x * keep / (1.0 - p)


class Unit(nn.Module):
    """A placement unit; ``forward`` returns the next hidden state and an optional loss.

    A forward is two parts: ``inputs`` gathers, eagerly, what the unit reads besides the
    hidden state and its parameters (tokens, targets, dropout masks, position embeddings),
    and ``compute`` is a function of tensors alone, which ``tidal_agent.compiled`` compiles.
    """

    index: int
    model: ModelSpec

    def forward(self, h: torch.Tensor | None, ctx: UnitContext):
        return self.compute(h, *self.inputs(h, ctx))

    def inputs(self, h: torch.Tensor | None, ctx: UnitContext) -> tuple:
        raise NotImplementedError

    def compute(self, h: torch.Tensor | None, *inputs):
        raise NotImplementedError

    def _generator(self, ctx: UnitContext) -> torch.Generator | None:
        if self.model.dropout == 0.0:
            return None
        gen = torch.Generator(device=ctx.device)
        gen.manual_seed(derive_seed(ctx.seed, "dropout", ctx.step, ctx.mb, self.index))
        return gen


class Embedding(Unit):
    def __init__(self, model: ModelSpec, index: int) -> None:
        super().__init__()
        self.model, self.index = model, index
        self.wte = nn.Embedding(model.vocab, model.d_model)
        self.wpe = nn.Embedding(model.seq_len, model.d_model)
        self.p = model.dropout

    def inputs(self, h: torch.Tensor | None, ctx: UnitContext) -> tuple:
        idx = ctx.tokens[:, : self.model.seq_len]
        return idx, _keep_mask((*idx.shape, self.model.d_model), self.p, self._generator(ctx))

    def compute(self, h: torch.Tensor | None, idx: torch.Tensor, keep: torch.Tensor | None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return _dropout(self.wte(idx) + self.wpe(pos), self.p, keep), None


class Attention(nn.Module):
    def __init__(self, model: ModelSpec) -> None:
        super().__init__()
        self.heads = model.heads
        self.qkv = nn.Linear(model.d_model, 3 * model.d_model)
        self.proj = nn.Linear(model.d_model, model.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, model: ModelSpec) -> None:
        super().__init__()
        self.fc1 = nn.Linear(model.d_model, model.mlp_ratio * model.d_model)
        self.fc2 = nn.Linear(model.mlp_ratio * model.d_model, model.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(Unit):
    def __init__(self, model: ModelSpec, index: int) -> None:
        super().__init__()
        self.model, self.index = model, index
        self.ln1 = nn.LayerNorm(model.d_model)
        self.attn = Attention(model)
        self.ln2 = nn.LayerNorm(model.d_model)
        self.mlp = MLP(model)
        self.p = model.dropout

    def inputs(self, h: torch.Tensor, ctx: UnitContext) -> tuple:
        gen = self._generator(ctx)  # the attention's mask, then the MLP's
        return _keep_mask(h.shape, self.p, gen), _keep_mask(h.shape, self.p, gen)

    def compute(self, h: torch.Tensor, attn_keep: torch.Tensor | None,
                mlp_keep: torch.Tensor | None):
        h = h + _dropout(self.attn(self.ln1(h)), self.p, attn_keep)
        h = h + _dropout(self.mlp(self.ln2(h)), self.p, mlp_keep)
        return h, None


class LossHead(Unit):
    """Final norm + projection to the vocabulary, predicting the token ``offset`` ahead.

    The LM head has offset 1; MTP head ``k`` (0-based) has offset ``k + 2``.
    """

    def __init__(self, model: ModelSpec, index: int, offset: int, weight: float) -> None:
        super().__init__()
        self.model, self.index = model, index
        self.offset, self.weight = offset, weight
        self.norm = nn.LayerNorm(model.d_model)
        self.proj = nn.Linear(model.d_model, model.vocab, bias=False)

    def inputs(self, h: torch.Tensor, ctx: UnitContext) -> tuple:
        return (ctx.tokens[:, self.offset : self.offset + self.model.seq_len],)

    def compute(self, h: torch.Tensor, targets: torch.Tensor):
        logits = self.proj(self.norm(h))
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        # The hidden state goes on through a copy, not a view: a stage output that is a view
        # cannot be detached in place, which the split (I/W) backward does.
        return h.clone(), loss * self.weight


def build_unit(model: ModelSpec, unit: int, seed: int) -> Unit:
    """Build placement unit ``unit`` with initial values drawn from (seed, unit) alone."""
    module = _construct_unit(model, unit)
    if model.huggingface is not None:  # a tied LM head draws the embedding's values too
        from tidal_agent import hf

        hf.initialise(module, model, seed)
    else:
        _initialise(module, model, derive_seed(seed, "init", unit))
    return module


def _construct_unit(model: ModelSpec, unit: int) -> Unit:
    if not 0 <= unit < model.num_units:
        raise ValueError(f"unit {unit} is outside the model's {model.num_units} units")
    if model.huggingface is not None:  # transformers loads only for such a model
        from tidal_agent import hf

        return hf.construct_unit(model, unit)
    if unit == 0:
        module: Unit = Embedding(model, unit)
    elif unit <= model.layers:
        module = Block(model, unit)
    elif unit == model.layers + 1:
        module = LossHead(model, unit, offset=1, weight=1.0)
    else:
        k = unit - model.layers - 2
        module = LossHead(model, unit, offset=k + 2, weight=MTP_LOSS_WEIGHT / model.mtp_heads)
    return module


@torch.no_grad()
def _initialise(module: Unit, model: ModelSpec, seed: int) -> None:
    # GPT-2 initialisation, drawn in parameter-name order from the unit's own generator.
    gen = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.layers)
    for name, param in module.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:  # LayerNorm scale
            param.fill_(1.0)
        else:
            std = residual_std if name.endswith(("attn.proj.weight", "fc2.weight")) else 0.02
            param.copy_(torch.randn(param.shape, generator=gen) * std)


class LayerClock:
    """Seconds of a stage's decoder-layer forwards: the same computation on every rank, so
    the seconds per layer compare ranks whatever the partition (tidal_plan.stragglers).

    A forward is a span between two marks of ``clock`` (tidal_agent.measure: the device's
    time, CUDA events on a GPU), read by ``take`` after the step rather than when marked.
    ``slowdown`` is a test's deterministic straggler: each layer forward then lasts that many
    times as long (the host sleeps for the rest, the device idle behind it; it reads the
    forward's time at once). Real slowdowns come from contention (bench/straggler.py).
    """

    __slots__ = ("clock", "spans", "slowdown", "on")

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or Clock(torch.device("cpu"))
        self.spans: list[Span] = []
        self.slowdown = 1.0
        self.on = True  # off: nobody reads the times (the straggler watch is off), keep none

    @property
    def running(self) -> bool:
        return self.on or self.slowdown > 1

    def timed(self, started: Mark) -> None:
        """A decoder-layer forward begun at ``started`` was issued."""
        ended = self.clock.mark()
        if self.slowdown > 1:
            time.sleep(self.clock.seconds(started, ended) * (self.slowdown - 1))
            ended = self.clock.mark()
        if self.on:
            self.spans.append((started, ended))

    def take(self) -> list[float]:
        """The seconds of the forwards timed since the last call; the clock starts again."""
        spans, self.spans = self.spans, []
        return [self.clock.seconds(*span) for span in spans]


class StageModule(nn.Module):
    """The placement units of one pipeline stage, under their global names.

    With ``precision="bf16"`` each unit runs under autocast (parameters, their gradients and
    the hidden state between units stay fp32); with ``checkpointing`` each decoder layer keeps
    only its input and recomputes its forward in the backward; with ``compile`` each unit's
    computation runs compiled (tidal_agent.compiled). All act unit by unit, so the numbers do
    not depend on where the stage boundaries are.
    """

    def __init__(
        self, model: ModelSpec, units: range, seed: int, *, initialise: bool = True,
        precision: str = "fp32", checkpointing: bool = False, compile: bool = False,
        empty_on: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.model, self.units = model, units
        self.precision, self.checkpointing, self.compile = precision, checkpointing, compile
        if initialise:
            built = {u: build_unit(model, u, seed) for u in units}
        else:  # values arrive from a checkpoint or a reshard: skip drawing them
            with torch.device("meta"):
                built = {u: _construct_unit(model, u) for u in units}
        blocks = {str(u - 1): m for u, m in built.items() if 1 <= u <= model.layers}
        mtp = {str(u - model.layers - 2): m for u, m in built.items() if u > model.layers + 1}
        if 0 in built:
            self.embed = built[0]
        if blocks:
            self.blocks = nn.ModuleDict(blocks)
        if model.layers + 1 in built:
            self.head = built[model.layers + 1]
        if mtp:
            self.mtp = nn.ModuleDict(mtp)
        self._ordered = [built[u] for u in units]
        if not initialise:  # "meta": no memory, for a caller that gives the tensors
            self.to_empty(device=empty_on)
        self.layer_clock = LayerClock()

    def forward(self, h: torch.Tensor | None, ctx: UnitContext):
        losses: list[torch.Tensor] = []
        clock, layers = self.layer_clock, self.model.layers
        for unit in self._ordered:
            if 1 <= unit.index <= layers and clock.running:
                started = clock.clock.mark()
                h, loss = self.run_unit(unit, h, ctx)
                clock.timed(started)
            else:
                h, loss = self.run_unit(unit, h, ctx)
            if loss is not None:
                losses.append(loss)
        return h, losses

    def run_unit(self, unit: Unit, h: torch.Tensor | None, ctx: UnitContext):
        """``unit``'s forward under the stage's precision, checkpointing and compilation."""
        compute = compiled.compute(type(unit)) if self.compile else type(unit).compute
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16,
                            enabled=self.precision == "bf16"):
            inputs = unit.inputs(h, ctx)
            if self.checkpointing and 1 <= unit.index <= self.model.layers:
                h, loss = checkpoint(compute, unit, h, *inputs, use_reentrant=False)
            else:
                h, loss = compute(unit, h, *inputs)
        return h.float(), loss  # the hidden state between units is fp32 whatever the layout

    @property
    def ordered_units(self) -> list[Unit]:
        return self._ordered

    @property
    def num_losses(self) -> int:
        return sum(u.index > self.model.layers for u in self._ordered)


def loss_units(model: ModelSpec) -> list[int]:
    """Placement units that produce a loss, in unit order."""
    return list(range(model.layers + 1, model.num_units))


def global_parameters(model: ModelSpec) -> list[tuple[str, torch.Size, int]]:
    """(name, shape, unit) of every parameter, in global order (unit order, then module order)."""
    out = []
    for unit in range(model.num_units):
        with torch.device("meta"):
            module = _construct_unit(model, unit)
        out.extend(
            (f"{unit_name(model, unit)}.{n}", p.shape, unit) for n, p in module.named_parameters()
        )
    return out


def global_parameter_names(model: ModelSpec) -> list[str]:
    """Every parameter name of the whole model, in global order."""
    return [name for name, _, _ in global_parameters(model)]
