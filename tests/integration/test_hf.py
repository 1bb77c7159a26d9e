"""Hugging Face causal LMs (issue 24): the transformers model's own numbers, cut into placement
units, and the determinism contract over them: any pipeline degree, partition, schedule and
live switch gives the float.hex losses and parameter digest of one process."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import yaml

from tests.jobs import NCCL_MODEL, small_job
from tidal_agent.hf import WeightsError, hf_name
from tidal_agent.model import StageModule, UnitContext
from tidal_agent.runner import run_elastic, run_local
from tidal_agent.trainer import batch_source
from tidal_api import parse_job
from tidal_plan.elastic import elastic_plan
from tidal_plan.gpus import Devices
from tidal_plan.layout import resolve_layout

pytestmark = pytest.mark.slow

STEPS = 6
SIZES = {"layers": 4, "dModel": 64, "heads": 4, "vocab": 256, "seqLen": 32}
TRAINING = {"steps": STEPS, "globalBatchSize": 8, "microBatchSize": 2, "lr": 3e-3,
            "warmupSteps": 2, "gradClip": 0.5, "seed": 3}


GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 4, "n_head": 4,
        "n_positions": 64, "embd_pdrop": 0, "resid_pdrop": 0, "attn_pdrop": 0,
        "bos_token_id": 0, "eos_token_id": 0}  # its own names


def _config(model_type: str, **extra) -> dict:
    if model_type == "gpt2":
        return {**GPT2, **extra}
    return {"model_type": model_type, "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64, **extra}


def _job(model_type: str, training: dict | None = None, **extra):
    return small_job("hf", model={**SIZES, "huggingface": {"config": _config(model_type, **extra)}},
                     training={**TRAINING, **(training or {})})


def _bits(report):
    assert len(report["steps"]) == STEPS
    return [s["loss_hex"] for s in report["steps"]], report["params_sha256"]


def _run(job, workers, schedule="1f1b", partition=None, devices=Devices()):
    layout = resolve_layout(job, workers=workers, schedule=schedule, partition=partition)
    return _bits(run_local(job, layout, steps=STEPS, timeout_s=120, devices=devices))


@pytest.fixture(scope="module")
def llama():
    return _job("llama")


@pytest.fixture(scope="module")
def reference(llama):
    return _run(llama, 1)


@pytest.mark.parametrize(
    ("workers", "schedule", "partition"),
    [
        (2, "gpipe", None),
        (3, "1f1b", (1, 4, 1)),  # uneven: the decoder layers on one stage
        (4, "1f1b", None),
        (3, "zb", (2, 2, 2)),
        (2, "interleaved", None),
    ],
)
def test_llama_has_the_bits_of_one_process(llama, reference, workers, schedule, partition):
    assert _run(llama, workers, schedule, partition) == reference


def test_llama_switching_live_has_the_bits_of_one_process(llama, reference):
    gens, layouts = elastic_plan(llama, [(0, 1), (2, 3), (4, 2)])
    report = run_elastic(llama, gens, layouts, steps=STEPS, timeout_s=120)
    assert [c["at_step"] for c in report["reconfigurations"]] == [2, 4]
    assert _bits(report) == reference
    # every worker, the one the shrink let go too, says how much memory it took at most
    peaks = report["peak_rss_bytes"]
    assert set(peaks) == {"worker-0", "worker-1", "worker-2"}
    assert all(100 * 2**20 < peak < 8 * 2**30 for peak in peaks.values())


def test_the_loss_moves(reference):
    losses, _ = reference
    values = [float.fromhex(h) for h in losses]
    assert values[-1] < values[0]


def test_a_config_directory_is_read_where_the_job_runs(tmp_path):
    """``huggingface.path``: the operator takes it as it is; where the job runs, config.json
    replaces it and is checked like an inline config."""
    import json

    from tidal_agent.cli import load_job
    from tidal_api import JobSpecError

    inline = _job("llama")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(_config("llama")))
    doc = inline.model_dump(by_alias=True, exclude_none=True)
    doc["spec"]["model"]["huggingface"] = {"path": str(tmp_path / "model")}
    assert parse_job(doc).spec.model.huggingface.config is None  # the operator's view
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    assert load_job(manifest).spec == inline.spec
    doc["spec"]["model"]["layers"] = 3
    manifest.write_text(yaml.safe_dump(doc))
    with pytest.raises(JobSpecError, match="model.layers is 3, num_hidden_layers 4$"):
        load_job(manifest)
    doc["spec"]["model"]["huggingface"]["path"] = str(tmp_path / "nowhere")
    manifest.write_text(yaml.safe_dump(doc))
    with pytest.raises(JobSpecError, match=r"nowhere/config.json does not exist$"):
        load_job(manifest)


VARIANTS = {"bf16": {"precision": "bf16"}, "checkpointing": {"activationCheckpointing": "layers"}}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_bf16_and_checkpointing_keep_the_bits_of_one_process(model_type, variant, llama,
                                                             reference):
    """bf16 autocast and activation checkpointing: pp 1-4, an uneven partition, the four
    schedules and a live grow/shrink switch that turns checkpointing on and off give one
    process's bits (3 steps: bf16 steps of tiny models are slow on CPU). bf16 changes the
    numbers; recomputing the forward does not."""
    job, steps = _job(model_type, training=VARIANTS[variant]), 3

    def run(workers, schedule="1f1b", partition=None):
        layout = resolve_layout(job, workers=workers, schedule=schedule, partition=partition)
        report = run_local(job, layout, steps=steps, timeout_s=120)
        return [s["loss_hex"] for s in report["steps"]], report["params_sha256"]

    alone = run(1)
    for workers, schedule, partition in [(2, "gpipe", None), (3, "1f1b", (1, 4, 1)),
                                         (4, "zb", None), (2, "interleaved", None)]:
        assert run(workers, schedule, partition) == alone, (workers, schedule)
    gens, layouts = elastic_plan(job, [(0, 1), (1, 3), (2, 2)])
    toggled = [dataclasses.replace(lay, activation_checkpointing=not lay.activation_checkpointing)
               if i == 1 else lay for i, lay in enumerate(layouts)]
    assert [lay.activation_checkpointing for lay in toggled] == (
        [True, False, True] if variant == "checkpointing" else [False, True, False])
    report = run_elastic(job, gens, toggled, steps=steps, timeout_s=120)
    assert ([s["loss_hex"] for s in report["steps"]], report["params_sha256"]) == alone
    if model_type == "llama":
        assert (alone[0] == reference[0][:steps]) is (variant == "checkpointing")


def test_checkpointing_keeps_only_each_layers_input():
    """What the forward saves for the backward: with checkpointing, a decoder layer keeps its
    input alone (the pack hook sees the checkpoint's inputs, not the layer's activations),
    besides the positions and rotary embeddings every layer shares (one copy, counted once)."""
    job = _job("llama")
    spec = job.spec.model
    tokens = batch_source(job.spec).micro_batch(0, 0)
    ctx = UnitContext(seed=0, step=0, mb=0, device=torch.device("cpu"), load=lambda: tokens)

    def saved_by_layers(**kwargs) -> int:
        stage = StageModule(spec, range(1, spec.layers + 1), seed=0, **kwargs)
        total, seen = [0], set()

        def pack(t):
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total[0] += t.untyped_storage().nbytes()
            return t

        h = torch.zeros(tokens.shape[0], spec.seq_len, spec.d_model, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stage(h, ctx)
        return total[0]

    plain, kept = saved_by_layers(), saved_by_layers(checkpointing=True)
    hidden = tokens.shape[0] * spec.seq_len * spec.d_model * 4
    positions, _, (cos, sin) = StageModule(spec, range(1, 2), seed=0).blocks["0"].inputs(
        torch.zeros(tokens.shape[0], spec.seq_len, spec.d_model), ctx)
    shared = sum(t.untyped_storage().nbytes() for t in (positions, cos, sin))
    assert kept <= spec.layers * hidden + shared < plain / 4
    assert saved_by_layers(precision="bf16") < plain  # bf16 activations take half the bytes


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral"])
def test_other_families_have_the_bits_of_one_process(model_type):
    job = _job(model_type)
    assert _run(job, 3, "1f1b", (2, 3, 1)) == _run(job, 1)


@pytest.mark.parametrize(("model_type", "extra"), [
    ("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {}),
    ("qwen2", {"tie_word_embeddings": True}), ("gpt2", {}),
], ids=["llama", "qwen2", "qwen3", "mistral", "qwen2-tied", "gpt2-tied"])
def test_the_units_compute_what_the_transformers_model_computes(model_type, extra):
    """Tidal's units, their parameters loaded into the library's own model under the
    checkpoint's names: the same logits' loss on a micro-batch, bit for bit in fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    job = _job(model_type, **extra)
    spec = job.spec.model
    stage = StageModule(spec, range(spec.num_units), seed=11)
    fields = _config(model_type, **extra)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "sdpa"
    reference = AutoModelForCausalLM.from_config(config)
    loaded = reference.load_state_dict(
        {hf_name(spec, name): p for name, p in stage.named_parameters()}, strict=False)
    assert not loaded.unexpected_keys
    assert set(loaded.missing_keys) <= {"model.rotary_emb.inv_freq"}

    tokens = batch_source(job.spec).micro_batch(0, 0)
    ctx = UnitContext(seed=0, step=0, mb=0, device=torch.device("cpu"), load=lambda: tokens)
    with torch.no_grad():
        _, (ours,) = stage(None, ctx)
        logits = reference(input_ids=tokens[:, :spec.seq_len]).logits
        theirs = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                 tokens[:, 1:1 + spec.seq_len].reshape(-1))
    assert ours.item().hex() == theirs.item().hex()


def test_unsupported_and_inconsistent_configs_get_one_clear_line():
    from tidal_api import JobSpecError

    with pytest.raises(JobSpecError, match="model_type 'bert' is not supported$"):
        _job("bert")
    config = {k: v for k, v in GPT2.items() if k != "resid_pdrop"}  # GPT-2's default: 0.1
    with pytest.raises(JobSpecError, match="resid_pdrop is left out$"):
        small_job("hf", model={**SIZES, "huggingface": {"config": config}}, training=TRAINING)
    with pytest.raises(JobSpecError, match="model.layers is 4, num_hidden_layers 6$"):
        _job("llama", num_hidden_layers=6)
    with pytest.raises(JobSpecError, match="model.seqLen is 32, max_position_embeddings 16$"):
        _job("llama", max_position_embeddings=16)


@pytest.mark.parametrize(("model_type", "extra"), [
    ("qwen2", {"tie_word_embeddings": True}), ("gpt2", {}),
], ids=["qwen2-tied", "gpt2"])
def test_tied_embeddings_are_two_copies_that_stay_equal_in_every_layout(tmp_path, model_type,
                                                                        extra):
    """A tied LM head (GPT-2, small Qwen) is the embedding's copy on the last stage: equal at
    the start, given the sum of both gradients in one order, equal after training; any pipeline
    degree, schedule and live switch gives one process's bits, under NCCL's rules too (the
    nccl-model transport: the copies' gradients cross in one group)."""
    from tidal_agent import checkpoint
    from tidal_agent.hf import LM_HEAD, embedding_name

    job = _job(model_type, **extra)
    EMBEDDING = embedding_name(job.spec.model)  # noqa: N806
    reference = _run(job, 1)
    assert _run(job, 3, "1f1b", (2, 3, 1)) == reference
    assert _run(job, 2, "interleaved", devices=NCCL_MODEL) == reference
    assert _run(job, 4, "zb", devices=NCCL_MODEL) == reference
    assert _run(job, 2, "gpipe") == reference
    gens, layouts = elastic_plan(job, [(0, 2), (2, 3), (4, 2)])
    doc = job.model_dump(by_alias=True, exclude_none=True)
    doc["spec"]["checkpoint"] = {"path": str(tmp_path), "everySteps": STEPS}
    saved = parse_job(doc)
    assert _bits(run_elastic(saved, gens, layouts, steps=STEPS, timeout_s=120,
                             devices=NCCL_MODEL)) == reference
    final = checkpoint.load_parameters(job.spec.model, tmp_path / f"step-{STEPS:08d}")
    start = StageModule(job.spec.model, range(job.spec.model.num_units), seed=TRAINING["seed"])
    assert torch.equal(start.state_dict()[EMBEDDING], start.state_dict()[LM_HEAD])
    assert torch.equal(final[EMBEDDING], final[LM_HEAD])
    assert not torch.equal(final[EMBEDDING], start.state_dict()[EMBEDDING])  # it trained


def _logits(stage: StageModule, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of Tidal's units: every unit but the head's loss, then its norm and LM head."""
    ctx = UnitContext(seed=0, step=0, mb=0, device=torch.device("cpu"), load=lambda: tokens)
    h = None
    for unit in stage.ordered_units[:-1]:
        h, _ = unit(h, ctx)
    head = stage.ordered_units[-1]
    return head.lm_head(head.norm(h))


def test_export_loads_in_transformers_and_weights_load_back(tmp_path):
    """A checkpoint exported with ``tidal export`` is a directory from_pretrained loads, with
    Tidal's logits bit for bit in fp32; as ``model.huggingface.weights`` it is a job's initial
    values, which every layout trains to the same bits."""
    from transformers import AutoModelForCausalLM

    from tests.commands import tidal_here
    from tidal_agent import checkpoint

    job = _job("llama")
    doc = job.model_dump(by_alias=True, exclude_none=True)
    doc["spec"]["checkpoint"] = {"path": str(tmp_path / "ckpt"), "everySteps": 3}
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    saved = parse_job(doc)
    run_local(saved, resolve_layout(saved, workers=2), steps=3, timeout_s=120)

    out = tmp_path / "exported"
    result = tidal_here("export", manifest, out)
    assert result.returncode == 0, result.stderr
    spec = job.spec.model
    stage = StageModule(spec, range(spec.num_units), seed=0, initialise=False)
    stage.load_state_dict(checkpoint.load_parameters(spec, tmp_path / "ckpt" / "step-00000003"))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    tokens = batch_source(job.spec).micro_batch(3, 0)
    with torch.no_grad():
        ours = _logits(stage, tokens)
        theirs = loaded(input_ids=tokens[:, :spec.seq_len]).logits
    assert torch.equal(ours, theirs)

    sharded = tmp_path / "sharded"  # as large checkpoints come: shards and their index
    loaded.save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    doc["spec"]["model"]["huggingface"]["weights"] = str(sharded)
    del doc["spec"]["checkpoint"]
    warm = parse_job(doc)
    started = StageModule(warm.spec.model, range(spec.num_units), seed=0)
    assert all(torch.equal(started.state_dict()[k], v) for k, v in stage.state_dict().items())
    assert _run(warm, 3, "1f1b", (2, 3, 1)) == _run(warm, 1)


def test_export_and_weights_say_what_is_wrong_in_one_line(tmp_path):
    from tests.commands import tidal_here

    doc = _job("llama").model_dump(by_alias=True, exclude_none=True)
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    result = tidal_here("export", manifest, tmp_path / "out", "--checkpoint", tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().endswith("--checkpoint " + str(tmp_path) + ": not a complete "
                                          "Tidal checkpoint directory")
    doc["spec"]["model"]["huggingface"]["weights"] = str(tmp_path)
    with pytest.raises(WeightsError, match="no model.safetensors or model.safetensors.index"):
        StageModule(parse_job(doc).spec.model, range(2), seed=0)


@pytest.mark.parametrize(("model_type", "extra"), [
    ("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True, "head_dim": 32}),
    ("qwen2", {}), ("qwen3", {}), ("mistral", {"num_key_value_heads": 1}),
    ("qwen2", {"tie_word_embeddings": True}), ("gpt2", {"n_inner": 96}), ("gpt2", {}),
])
def test_the_planner_counts_the_parameters_each_unit_has(model_type, extra):
    """The cost model reads a Hugging Face model's shape from its config (grouped-query
    attention, head size, FFN width, gated MLP, norms, biases, positions): its count of every
    unit's parameters is what the units built by transformers hold."""
    from tidal_agent.model import build_unit
    from tidal_plan.modelshape import ModelShape, unit_params

    spec = _job(model_type, **extra).spec.model
    shape = ModelShape.of(spec)
    built = [sum(p.numel() for p in build_unit(spec, u, seed=0).parameters())
             for u in range(spec.num_units)]
    assert [unit_params(shape, u) for u in range(spec.num_units)] == built
