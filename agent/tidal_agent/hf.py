"""Hugging Face causal LMs as placement units: the model ``transformers`` builds from the job's
``model.huggingface.config``, cut at the same seams as the built-in GPT.

Units, in order: the token embedding, each decoder layer, and the final norm with the LM head.
Each unit holds the transformers modules themselves (``LlamaDecoderLayer``, ...), so the
numbers are the library's; what the model's own ``forward`` does between them, every unit that
needs it does for itself: a decoder layer takes the rotary position embeddings and the causal
(or sliding-window) mask from the positions, which are the same on every stage, computed once
per shape of the hidden state (:func:`_layer_inputs`).
Global parameter names map one to one onto the Hugging Face checkpoint's:
``embed.embed_tokens.*`` is ``model.embed_tokens.*``, ``blocks.{i}.layer.*`` is
``model.layers.{i}.*``, ``head.norm.*`` is ``model.norm.*`` and ``head.lm_head.*`` is
``lm_head.*`` (:func:`hf_name`).

Initial values are the library's ``_init_weights``, drawn unit by unit from a generator seeded
by (seed, unit) alone, so that every placement holds the same numbers. Tied input and output
embeddings are two parameters here, kept equal (:func:`tied`).
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tidal_api.spec import ModelSpec

from tidal_agent.model import Unit, UnitContext

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PretrainedConfig


@functools.lru_cache(maxsize=4)
def _skeleton(config_json: str) -> tuple[PretrainedConfig, PreTrainedModel]:
    """The whole model on the meta device (no memory, no values), once per config: the units
    take their modules from it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_json)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, model


def _key(spec: ModelSpec) -> str:
    return json.dumps(spec.huggingface.config, sort_keys=True)


_SKELETONS = threading.Lock()  # transformers' lazy imports are not safe across threads


def _model(spec: ModelSpec) -> tuple[PretrainedConfig, PreTrainedModel]:
    with _SKELETONS:
        return _skeleton(_key(spec))


@dataclass(frozen=True, slots=True)
class _Family:
    """Where a family's model keeps its parts: the inner model's attribute (``model`` or
    ``transformer``), the embedding's modules, the decoder layers' list and the final norm."""

    base: str = "model"
    embedding: tuple[str, ...] = ("embed_tokens",)
    layers: str = "layers"
    norm: str = "norm"
    rotary: bool = True


_FAMILIES = {"gpt2": _Family("transformer", ("wte", "wpe", "drop"), "h", "ln_f", rotary=False)}


def _family(spec: ModelSpec) -> _Family:
    return _FAMILIES.get(spec.huggingface.config["model_type"], _Family())


def embedding_name(spec: ModelSpec) -> str:
    """The global name of the token embedding, which a tied LM head copies."""
    return f"embed.{_family(spec).embedding[0]}.weight"


def hf_name(spec: ModelSpec, name: str) -> str:
    """The Hugging Face checkpoint's name of the global parameter ``name``."""
    family = _family(spec)
    unit, _, rest = name.partition(".")
    if unit == "embed":
        return f"{family.base}.{rest}"
    if unit == "blocks":
        index, _, inner = rest.partition(".")
        return f"{family.base}.{family.layers}.{index}." + inner.removeprefix("layer.")
    if rest.startswith("norm."):
        return f"{family.base}.{family.norm}." + rest.removeprefix("norm.")
    return rest  # lm_head.*


def construct_unit(spec: ModelSpec, unit: int) -> Unit:
    """Placement unit ``unit`` on the meta device, its values not drawn."""
    _, model = _model(spec)
    family = _family(spec)
    base = getattr(model, family.base)
    with torch.device("meta"):
        if unit == 0:
            return HFEmbedding(spec, unit, {name: _fresh(getattr(base, name))
                                            for name in family.embedding})
        if unit <= spec.layers:
            return HFDecoderLayer(spec, unit, _fresh(getattr(base, family.layers)[unit - 1]))
        return HFHead(spec, unit, _fresh(getattr(base, family.norm)), _fresh(model.lm_head))


def _fresh(module: nn.Module) -> nn.Module:
    """A copy of a skeleton's module: units do not share parameters."""
    return copy.deepcopy(module)


LM_HEAD = "head.lm_head.weight"


def tied(spec: ModelSpec) -> bool:
    """Whether the config ties the LM head to the input embedding (GPT-2, small Qwen models).

    Tidal keeps two parameters, :func:`embedding_name` on the first stage and ``LM_HEAD`` on
    the last, equal from the start and given the same gradient every step (the trainer sums
    the two halves in that order), so that they stay equal through any optimizer."""
    config, _ = _model(spec)
    return bool(config.tie_word_embeddings)


@torch.no_grad()
def initialise(module: Unit, spec: ModelSpec, seed: int) -> None:
    """``module``'s initial values: from ``model.huggingface.weights`` where given, else the
    library's random ones, drawn from (seed, unit) alone; a tied LM head takes the embedding's."""
    from tidal_agent.seeding import derive_seed

    _, model = _model(spec)
    module.to_empty(device="cpu")  # built on the meta device
    if spec.huggingface.weights:
        _load_weights(module, spec)
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "init", module.index))
        for sub in module.modules():
            if not isinstance(sub, _UNIT_TYPES):
                model._init_weights(sub)
    if isinstance(module, HFHead) and tied(spec):
        embedding = construct_unit(spec, 0)
        initialise(embedding, spec, seed)
        module.lm_head.weight.copy_(embedding.get_parameter(
            embedding_name(spec).removeprefix("embed.")))


class WeightsError(ValueError):
    """Weights that cannot be loaded into the job's model; the message is one line."""


def _load_weights(module: Unit, spec: ModelSpec) -> None:
    """Copy the unit's tensors, by their checkpoint names, from the safetensors files."""
    from safetensors import safe_open

    from tidal_agent.model import unit_name

    where = Path(spec.huggingface.weights)
    files = _weight_files(where)
    prefix = unit_name(spec, module.index)
    by_file: dict[Path, list[tuple[str, nn.Parameter]]] = {}
    for name, param in module.named_parameters():
        key = hf_name(spec, f"{prefix}.{name}")
        if f"{prefix}.{name}" == LM_HEAD and key not in files and tied(spec):
            key = hf_name(spec, embedding_name(spec))  # a tied checkpoint: the embedding alone
        if key not in files:
            raise WeightsError(f"{where}: no tensor {key}: the weights are not this config's")
        by_file.setdefault(files[key], []).append((key, param))
    for file, wanted in by_file.items():  # each shard opened once
        with safe_open(file, framework="pt") as shard:
            for key, param in wanted:
                tensor = shard.get_tensor(key)
                if tensor.shape != param.shape:
                    raise WeightsError(f"{where}: {key} has shape {list(tensor.shape)}; the "
                                       f"config's is {list(param.shape)}: the weights are not "
                                       "this config's")
                param.copy_(tensor)


@functools.lru_cache(maxsize=4)
def _weight_files(where: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, for a save_pretrained directory."""
    from safetensors import safe_open

    index = where / "model.safetensors.index.json"
    if index.is_file():
        shards = json.loads(index.read_text())["weight_map"]
        return {name: where / file for name, file in shards.items()}
    single = where / "model.safetensors"
    if not single.is_file():
        raise WeightsError(f"{where}: no model.safetensors or model.safetensors.index.json "
                           "(model.huggingface.weights)")
    with safe_open(single, framework="pt") as shard:
        return dict.fromkeys(shard.keys(), single)


def export(spec: ModelSpec, parameters: dict[str, torch.Tensor], out: str | Path) -> Path:
    """Write ``parameters`` (every global name) as a Hugging Face directory: config.json and
    safetensors, as the library's ``save_pretrained`` writes them."""
    from transformers import AutoModelForCausalLM

    config, _ = _model(spec)
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(
        {hf_name(spec, name): tensor for name, tensor in parameters.items()}, strict=False)
    if unexpected or set(missing) - {"model.rotary_emb.inv_freq"}:
        raise WeightsError(f"the parameters are not this config's: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    model.save_pretrained(out)
    return Path(out)


class HFEmbedding(Unit):
    """The token embedding; GPT-2's adds learned positions (and its dropout, which is 0)."""

    def __init__(self, spec: ModelSpec, index: int, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        self.model, self.index = spec, index
        for name, module in parts.items():
            self.add_module(name, module)

    def inputs(self, h: torch.Tensor | None, ctx: UnitContext) -> tuple:
        return (ctx.tokens[:, : self.model.seq_len],)

    def compute(self, h: torch.Tensor | None, tokens: torch.Tensor):
        if not hasattr(self, "wte"):
            return self.embed_tokens(tokens), None
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        return self.drop(self.wte(tokens) + self.wpe(positions)), None


class HFDecoderLayer(Unit):
    def __init__(self, spec: ModelSpec, index: int, layer: nn.Module) -> None:
        super().__init__()
        self.model, self.index = spec, index
        self.layer = layer
        # What every forward needs, looked up once: the config's key, and the layer's kind.
        config, _ = _model(spec)
        self.key, self.rotary = _key(spec), _family(spec).rotary
        layer_types = getattr(config, "layer_types", None)
        self.sliding = (layer_types[index - 1] == "sliding_attention" if layer_types
                        else getattr(config, "sliding_window", None) is not None)

    def inputs(self, h: torch.Tensor, ctx: UnitContext) -> tuple:
        return _layer_inputs(self.key, self.rotary, self.sliding, h.shape, h.dtype, h.device)

    def compute(self, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                embeddings: tuple[torch.Tensor, torch.Tensor] | None):
        extra = {} if embeddings is None else {"position_embeddings": embeddings}
        out = self.layer(h, attention_mask=mask, position_ids=positions, **extra)
        return (out[0] if isinstance(out, tuple) else out), None


class HFHead(Unit):
    """The final norm and the LM head, predicting the next token."""

    def __init__(self, spec: ModelSpec, index: int, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.model, self.index = spec, index
        self.norm, self.lm_head = norm, lm_head

    def inputs(self, h: torch.Tensor, ctx: UnitContext) -> tuple:
        return (ctx.tokens[:, 1 : 1 + self.model.seq_len],)

    def compute(self, h: torch.Tensor, targets: torch.Tensor):
        logits = self.lm_head(self.norm(h))
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return h.clone(), loss  # a copy, not a view: see tidal_agent.model.LossHead


_UNIT_TYPES = (HFEmbedding, HFDecoderLayer, HFHead)


@functools.lru_cache(maxsize=16)
def _layer_inputs(key: str, rotary: bool, sliding: bool, shape: torch.Size, dtype: torch.dtype,
                  device: torch.device):
    """A decoder layer's inputs besides a hidden state of ``shape``: the positions, the
    attention mask (None where sdpa's causal flag does) and, for rotary families, the position
    embeddings (cos, sin).

    They depend on nothing but the shape, dtype and device, so every layer, micro-batch and step
    shares one copy: computed per layer, they cost as much as a small layer's forward on CPU,
    and the library's search for packed sequences syncs with the device. Nothing writes to
    them; they are made outside inference mode, so that a training forward may save them."""
    from transformers.masking_utils import (create_causal_mask,
                                            create_sliding_window_causal_mask)

    config, model = _skeleton(key)
    with torch.inference_mode(False), torch.device(device):
        h = torch.empty((), dtype=dtype).expand(shape)  # read for its shape, dtype and device
        positions = torch.arange(shape[1]).unsqueeze(0)
        make = create_sliding_window_causal_mask if sliding else create_causal_mask
        # No position_ids: positions are 0..T-1 in every sample, never packed sequences.
        mask = make(config=config, inputs_embeds=h, attention_mask=None, cache=None)
        # The skeleton's rotary embedding is on the meta device, where its buffers hold nothing.
        embeddings = type(model.model.rotary_emb)(config=config)(h, positions) if rotary else None
    return positions, mask, embeddings
