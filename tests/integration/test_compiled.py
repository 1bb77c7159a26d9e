"""Compiled units (``training.compile: on``): each placement unit's computation compiled on its
own by inductor keeps the determinism contract (any PP degree, partition, schedule and live
switch gives one compiled process's bits), and a switch to shapes a process compiled before
compiles nothing."""

import dataclasses

import pytest

from tests.jobs import small_job
from tidal_agent.runner import run_elastic, run_local
from tidal_plan.elastic import elastic_plan
from tidal_plan.layout import resolve_layout

pytestmark = pytest.mark.slow

STEPS = 6


def _bits(report):
    assert len(report["steps"]) == STEPS
    return [s["loss_hex"] for s in report["steps"]], report["params_sha256"]


def _run(job, workers, schedule="1f1b", partition=None):
    layout = resolve_layout(job, workers=workers, schedule=schedule, partition=partition)
    return run_local(job, layout, steps=STEPS, timeout_s=300)


def _gpt(compile_: str):
    # test_bitwise's model: dropout on (masks drawn outside the compiled region), two MTP heads
    # (loss heads of two weights), clipping always active.
    return small_job(
        "c",
        model={"layers": 6, "dModel": 32, "heads": 4, "vocab": 64, "seqLen": 16, "mtpHeads": 2,
               "dropout": 0.1},
        training={"steps": STEPS, "globalBatchSize": 8, "microBatchSize": 2, "lr": 3e-3,
                  "warmupSteps": 3, "gradClip": 0.5, "seed": 7, "compile": compile_},
    )


def test_compiled_gpt_keeps_one_process_bits_through_layouts_and_switches():
    job = _gpt("on")
    alone = _run(job, 1)
    reference = _bits(alone)
    eager = _run(_gpt("off"), 1)
    assert reference[0] != _bits(eager)[0]  # compiled kernels round otherwise: they ran
    assert eager["steps"][0]["compiled_graphs"] is None
    # zero-bubble: the split backward (I, then W) through compiled graphs; an uneven cut.
    assert _bits(_run(job, 3, "zb", (4, 4, 2))) == reference
    # pp 1 -> 2 -> 1, live: the leader compiled every unit kind at pp 1, so neither switch
    # compiles anything on it.
    gens, layouts = elastic_plan(job, [(0, 1), (2, 2), (4, 1)])
    switched = run_elastic(job, gens, layouts, steps=STEPS, timeout_s=300)
    assert [c["at_step"] for c in switched["reconfigurations"]] == [2, 4]
    assert _bits(switched) == reference
    graphs = [s["compiled_graphs"] for s in switched["steps"]]
    assert graphs[0] > 0 and len(set(graphs)) == 1, graphs
    assert alone["steps"][-1]["compiled_graphs"] == graphs[0]


def test_compiled_llama_in_bf16_with_checkpointing_keeps_the_bits():
    """bf16 autocast around compiled decoder layers, and a live switch that turns activation
    checkpointing (a checkpoint around the compiled layer) off and on again."""
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64}
    job = small_job(
        "hfc",
        model={"layers": 4, "dModel": 64, "heads": 4, "vocab": 256, "seqLen": 32,
               "huggingface": {"config": config}},
        training={"steps": STEPS, "globalBatchSize": 8, "microBatchSize": 2, "lr": 3e-3,
                  "warmupSteps": 2, "gradClip": 0.5, "seed": 3, "precision": "bf16",
                  "activationCheckpointing": "layers", "compile": "on"},
    )
    reference = _bits(_run(job, 1))
    gens, layouts = elastic_plan(job, [(0, 1), (2, 2), (4, 1)])
    toggled = [dataclasses.replace(lay, activation_checkpointing=not lay.activation_checkpointing)
               if i == 1 else lay for i, lay in enumerate(layouts)]
    assert [lay.activation_checkpointing for lay in toggled] == [True, False, True]
    assert _bits(run_elastic(job, gens, toggled, steps=STEPS, timeout_s=300)) == reference
