"""A Hugging Face causal LM in the spec: its config.json (inline, or read from a local directory
where the job runs), the families Tidal builds, and the sizes the manifest must share with it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from tidal_api.schema import JobSpecError, Spec, cel_rule, cel_rules

HF_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")  # decoder-only causal LMs
# The manifest's sizes and the config.json fields that must agree with them.
HF_SIZES = (("layers", "num_hidden_layers"), ("d_model", "hidden_size"),
             ("heads", "num_attention_heads"), ("vocab", "vocab_size"))
# GPT-2's config.json names of the sizes.
HF_ALIASES = {"num_hidden_layers": "n_layer", "hidden_size": "n_embd",
               "num_attention_heads": "n_head", "max_position_embeddings": "n_positions"}
# Dropout in the library's modules draws from torch's global generator, which differs with the
# layout: these must be 0. GPT-2's default to 0.1, so its config states them.
GPT2_DROPOUTS = ("embd_pdrop", "resid_pdrop", "attn_pdrop")
# The CEL rules' messages, which parse_job's begin with (then the particulars).
HF_KIND = ("model.huggingface.config: model_type must be one of " + ", ".join(HF_MODEL_TYPES)
            + ", with no dropout (attention_dropout 0; GPT-2: " + ", ".join(GPT2_DROPOUTS)
            + " given as 0)")


def hf_size(config: dict[str, Any], key: str) -> Any:
    return config.get(key, config.get(HF_ALIASES.get(key, key)))
HF_SIZES_MESSAGE = ("model.huggingface: layers, dModel, heads and vocab must be the config's "
                     "num_hidden_layers, hidden_size, num_attention_heads and vocab_size, seqLen "
                     "at most its max_position_embeddings, with no mtpHeads or dropout")


def cel_size(key: str, missing: int = -1) -> str:
    """CEL for the config's ``key`` (or GPT-2's name of it), ``missing`` where neither is."""
    config = "self.huggingface.config"
    alias = HF_ALIASES.get(key, key)
    return (f"(has({config}.{key}) ? int({config}.{key}) : has({config}.{alias}) ? "
            f"int({config}.{alias}) : {missing})")


HF_SOURCE = "model.huggingface: give config (config.json's fields) or path, not both"


class HuggingFaceSpec(Spec):
    """A Hugging Face causal LM, built with ``transformers`` from its config.json fields, given
    inline or read from a local directory."""

    model_config = cel_rules(cel_rule("has(self.config) != has(self.path)", HF_SOURCE), cel_rule(
        "!has(self.config) || has(self.config.model_type) && self.config.model_type in "
        + str(list(HF_MODEL_TYPES)).replace(" ", "")
        + " && (!has(self.config.attention_dropout) || double(self.config.attention_dropout)"
          " == 0.0) && (self.config.model_type != 'gpt2' || ("
        + " && ".join(f"has(self.config.{k}) && double(self.config.{k}) == 0.0"
                      for k in GPT2_DROPOUTS) + "))",
        HF_KIND,
    ))

    config: dict[str, Any] | None = Field(
        None, description="config.json's fields, model_type included: one of "
        + ", ".join(HF_MODEL_TYPES) + ". Nothing is downloaded."
    )
    path: str | None = Field(
        None, description="Instead of config: a local directory holding config.json, on every "
        "worker's disk (the agent reads it; the manifest's sizes must be the config's)."
    )
    weights: str | None = Field(
        None, description="A local directory of safetensors weights as save_pretrained writes "
        "them (model.safetensors, or shards listed by model.safetensors.index.json), on every "
        "worker's disk: the initial values. Without it, the library's random initial values."
    )

    @model_validator(mode="after")
    def _supported(self) -> HuggingFaceSpec:
        if (self.config is None) == (self.path is None):
            raise ValueError(HF_SOURCE)
        if self.config is None:  # checked where the directory is: parse_job(local_files=True)
            return self
        kind = self.config.get("model_type")
        if kind not in HF_MODEL_TYPES:
            raise ValueError(f"{HF_KIND}: model_type {kind!r} is not supported")
        for key in ("attention_dropout", *(GPT2_DROPOUTS if kind == "gpt2" else ())):
            if self.config.get(key, 0.1 if key in GPT2_DROPOUTS else 0.0) != 0:
                raise ValueError(f"{HF_KIND}: {key} is {self.config.get(key, 'left out')}")
        return self


def read_config_file(document: dict[str, Any], source: str) -> dict[str, Any]:
    model = (document.get("spec") or {}).get("model") or {}
    hf = model.get("huggingface") if isinstance(model, dict) else None
    if not isinstance(hf, dict) or not isinstance(hf.get("path"), str) or "config" in hf:
        return document
    file = Path(hf["path"]) / "config.json"
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise JobSpecError(f"{source}: model.huggingface.path: {file} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise JobSpecError(f"{source}: model.huggingface.path: cannot read {file}: "
                           f"{getattr(err, 'strerror', None) or err}") from None
    if not isinstance(config, dict):
        raise JobSpecError(f"{source}: model.huggingface.path: {file} is not a JSON object")
    read = copy.deepcopy(document)
    read["spec"]["model"]["huggingface"] = {**{k: v for k, v in hf.items() if k != "path"},
                                            "config": config}
    return read
