"""The model's counts (parameters, FLOPs, memory), the modeling-based predictor, devices."""

import dataclasses
import json
import math

import pytest

from tidal_api import ModelSpec
from tidal_plan.costmodel import Sharding, model_costs, predict, unit_costs
from tidal_plan.devices import (
    DEVICES,
    GIB,
    Device,
    DeviceError,
    gpu_description,
    load_device,
    write_device,
)
from tidal_plan.measured import measured_device
from tidal_plan.layout import build_layout
from tidal_plan.profiled import ProfileError
from tidal_plan.modelshape import (
    FLEXTRAIN,
    ModelShape,
    active_params,
    korthikanti_activation_bytes,
    total_params,
    unit_activation_bytes,
    unit_active_params,
    unit_backward_bytes,
    unit_output_grad_bytes,
    unit_saved_bytes,
    unit_flops,
    unit_params,
)

H100 = DEVICES["h100"]
SMALL = ModelShape(layers=3, d_model=16, heads=2, vocab=32, seq_len=8, mtp_heads=2)
# A 6.9B dense GPT: 110 GiB of bf16 + AdamW state, more than one H100 holds.
BIG = ModelShape(layers=32, d_model=4096, heads=32, vocab=50304, seq_len=2048)


def layout_for(shape, pp, *, m=16, mbs=1, dp=1, schedule="1f1b"):
    return build_layout(
        num_units=shape.num_units, workers=pp * dp, dp=dp, micro_batch_size=mbs,
        num_micro_batches=m * dp, schedule=schedule,
    )


# --- parameter counts ----------------------------------------------------------------------------


def test_dense_counts_by_hand():
    d, v, s = 16, 32, 8
    block = 12 * d * d + 13 * d  # qkv 3d^2+3d, proj d^2+d, fc1 4d^2+4d, fc2 4d^2+d, 2 LN 4d
    head = 2 * d + d * v  # LayerNorm + projection without bias
    expected = [v * d + s * d, block, block, block, head, head, head]
    assert [unit_params(SMALL, u) for u in range(SMALL.num_units)] == expected
    assert [unit_active_params(SMALL, u) for u in range(SMALL.num_units)] == expected


def test_dense_counts_match_the_real_model():
    pytest.importorskip("torch")
    from tidal_agent.model import global_parameters

    model = ModelSpec(layers=3, d_model=16, heads=2, vocab=32, seq_len=8, mtp_heads=2,
                      mlp_ratio=3)
    shape = ModelShape.of(model)
    per_unit = [0] * model.num_units
    for _, size, unit in global_parameters(model):
        per_unit[unit] += math.prod(size)
    assert [unit_params(shape, u) for u in range(shape.num_units)] == per_unit


def test_moe_counts_total_and_active():
    d, e, k, h, shared = 8, 4, 2, 6, 1
    shape = ModelShape(layers=1, d_model=d, heads=2, vocab=10, seq_len=4, experts=e, top_k=k,
                       expert_hidden=h, shared_experts=shared)
    expert = 2 * d * h + h + d
    base = 4 * d * d + 4 * d + 4 * d + d * e  # attention, 2 LayerNorms, router
    assert unit_params(shape, 1) == base + (e + shared) * expert
    assert unit_active_params(shape, 1) == base + (k + shared) * expert
    assert total_params(shape) - active_params(shape) == (e - k) * expert


@pytest.mark.parametrize("name", ["small", "medium", "large"])
def test_flextrain_presets_match_the_slides(name):
    active, total = {"small": (1e9, 7e9), "medium": (6e9, 60e9), "large": (30e9, 600e9)}[name]
    shape = FLEXTRAIN[name]
    assert active_params(shape) == pytest.approx(active, rel=0.1)
    assert total_params(shape) == pytest.approx(total, rel=0.1)
    assert shape.mtp_heads == 2
    assert shape.layers == {"small": 15, "medium": 29, "large": 61}[name]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"heads": 3}, "must divide d_model"),
        ({"layers": 0}, "layers (0) must be at least 1"),
        ({"top_k": 2}, "set experts > 0"),
        ({"experts": 4, "top_k": 5, "expert_hidden": 8}, "top_k (5) must be between 1"),
        ({"experts": 4, "top_k": 1}, "needs expert_hidden"),
    ],
)
def test_bad_shapes_say_how_to_fix(kwargs, message):
    base = dict(layers=2, d_model=16, heads=2, vocab=32, seq_len=8)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelShape(**{**base, **kwargs})


# --- FLOPs and memory ----------------------------------------------------------------------------


@pytest.mark.parametrize("unit", range(SMALL.num_units))
def test_flops_scale_linearly_with_tokens(unit):
    one, three = unit_flops(SMALL, unit, 100), unit_flops(SMALL, unit, 300)
    for field in ("forward", "input_grad", "weight_grad"):
        assert getattr(three, field) == pytest.approx(3 * getattr(one, field))


def test_flops_of_a_block_and_the_embedding():
    tokens = 10
    attention = 2 * SMALL.seq_len * SMALL.d_model * tokens  # causal QK^T + AV
    f = unit_flops(SMALL, 1, tokens)
    linear = 2 * unit_params(SMALL, 1) * tokens
    assert (f.forward, f.input_grad, f.weight_grad) == (
        linear + attention, linear + 2 * attention, linear
    )
    assert unit_flops(SMALL, 0, tokens).input_grad == 0


def test_moe_flops_follow_active_params():
    dense = ModelShape(layers=1, d_model=64, heads=4, vocab=10, seq_len=16)
    moe = ModelShape(layers=1, d_model=64, heads=4, vocab=10, seq_len=16, experts=8, top_k=1,
                     expert_hidden=256)
    # Eight experts of width 4d, one per token: about 6x the weights, the dense block's work
    # (plus a router).
    assert unit_params(moe, 1) > 5 * unit_params(dense, 1)
    ratio = unit_flops(moe, 1, 100).weight_grad / unit_flops(dense, 1, 100).weight_grad
    assert 1 < ratio < 1.02


def test_korthikanti_activation_bytes():
    shape = BIG
    per_layer = korthikanti_activation_bytes(shape, 1, 1, 2)
    assert per_layer == 2048 * 4096 * 34  # Korthikanti et al. with flash attention
    no_flash = korthikanti_activation_bytes(shape, 1, 1, 2, flash_attention=False)
    assert no_flash == 2048 * 4096 * (34 + 5 * 32 * 2048 / 4096)
    assert korthikanti_activation_bytes(shape, 1, 2, 4) == 4 * per_layer  # twice the batch, fp32
    head = korthikanti_activation_bytes(shape, shape.layers + 1, 1, 2)
    assert head >= 2048 * 50304 * 2  # the logits


def test_tidals_activation_bytes_tensor_by_tensor():
    """The built-in GPT's block, per token: two fp32 residual tensors (8d), LayerNorm
    statistics (2 x 8), the matmuls' inputs, q, k, v and attention's output (6ad), GELU's
    input and output (2 x 4ad), log-sum-exp (4 heads); under bf16 autocast also its weights'
    bf16 copies (2 x 12 d^2). tests/unit/test_measure.py checks the counts against the bytes
    the trainer's units allocate."""
    d, tokens = BIG.d_model, BIG.seq_len
    for a in (2, 4):
        per_token = 8 * d + 16 + 6 * a * d + 2 * a * 4 * d + 4 * BIG.heads
        assert unit_saved_bytes(BIG, 1, 1, a) == tokens * per_token
    copies = 2 * 12 * d * d
    assert unit_activation_bytes(BIG, 1, 1, 2) == unit_saved_bytes(BIG, 1, 1, 2) + copies
    assert unit_activation_bytes(BIG, 1, 1, 4) == unit_saved_bytes(BIG, 1, 1, 4)
    # The loss head keeps the fp32 log-softmax of its logits whatever the precision; the
    # model's last unit passes no output on.
    head = BIG.layers + 1
    assert unit_saved_bytes(BIG, head, 1, 2) == tokens * (8 + 2 * d + 4 * BIG.vocab + 8)
    # Its backward holds two fp32 gradients of the logits, or its weight's bf16 gradient and
    # that one's fp32 copy, whichever is more; a block's, two of GELU's width.
    assert unit_backward_bytes(BIG, head, tokens, 2) == max(tokens * 8 * BIG.vocab,
                                                            6 * d * BIG.vocab)
    assert unit_backward_bytes(BIG, head, 8 * tokens, 2) == 8 * tokens * 8 * BIG.vocab
    assert unit_backward_bytes(BIG, 1, tokens, 4) == tokens * 2 * 4 * 4 * d
    assert unit_output_grad_bytes(BIG, 0, tokens, 2) == 0.0  # the embedding's is all W


def test_a_pipeline_keeps_its_messages_and_a_split_backward_what_its_w_needs():
    one, two = layout_for(SMALL, 1), layout_for(SMALL, 2)
    message = SMALL.seq_len * SMALL.d_model * 4  # one sample's hidden state, fp32
    units = [unit_costs(SMALL, u, 1, H100) for u in range(SMALL.num_units)]
    assert model_costs(SMALL, one, H100).retained_bytes == (0.0,)
    costs = model_costs(SMALL, two, H100)
    assert costs.retained_bytes == (message, message)  # its sent output; its input gradient
    # The second stage also keeps the input it received.
    assert costs.activation_bytes[1] == pytest.approx(
        sum(units[u].activation_bytes for u in two.stage_units(1)) + message)
    assert costs.held_for_weight_bytes[0] == 0.0  # a first stage's backward is all W
    zb = layout_for(SMALL, 2, schedule="zb")
    assert predict(SMALL, zb, H100).peak_memory_bytes[1] > predict(
        SMALL, two, H100).peak_memory_bytes[1]
    megatron = model_costs(SMALL, two, H100, Sharding(megatron=True))
    assert megatron.retained_bytes == (0.0, 0.0) and megatron.held_for_weight_bytes == (0.0, 0.0)


def test_state_is_sixteen_bytes_per_parameter():
    for device in (H100, DEVICES["cpu"]):
        assert unit_costs(SMALL, 1, 1, device).state_bytes == 16 * unit_params(SMALL, 1)


def test_model_costs_sum_the_stage_units():
    layout = build_layout(num_units=SMALL.num_units, workers=2, micro_batch_size=2,
                          num_micro_batches=4, partition=(3, 4))
    costs = model_costs(SMALL, layout, H100)
    tokens = 2 * SMALL.seq_len
    first = sum(unit_flops(SMALL, u, tokens).forward for u in range(3)) / H100.matmul_flops
    assert costs.forward[0] == pytest.approx(first)
    assert costs.comm == pytest.approx(
        tokens * SMALL.d_model * 2 / H100.p2p_bandwidth + H100.p2p_latency_s
    )
    with pytest.raises(ValueError, match="num_units=7"):
        model_costs(SMALL, build_layout(num_units=8, workers=2, micro_batch_size=1,
                                        num_micro_batches=2), H100)


# --- predictions ---------------------------------------------------------------------------------


def test_more_stages_are_faster_until_bubbles_dominate():
    steps = {pp: predict(BIG, layout_for(BIG, pp), H100) for pp in (1, 2, 4, 8, 16)}
    times = [steps[pp].step_seconds for pp in sorted(steps)]
    assert times == sorted(times, reverse=True) and len(set(times)) == len(times)
    bubbles = [steps[pp].bubble_fraction for pp in sorted(steps)]
    assert bubbles == sorted(bubbles)
    # Each doubling gains less: efficiency per device falls as the bubble grows.
    speedups = [a / b for a, b in zip(times, times[1:])]
    assert speedups == sorted(speedups, reverse=True) and speedups[-1] < 1.6
    # With one micro-batch a pipeline only adds messages: its makespan grows with pp.
    single = [predict(BIG, layout_for(BIG, pp, m=1), H100).pipeline_seconds for pp in (1, 4, 16)]
    assert single == sorted(single)


def test_memory_per_rank_drops_with_pp_and_a_big_model_fits_only_when_split():
    peaks = {pp: max(predict(BIG, layout_for(BIG, pp), H100).peak_memory_bytes)
             for pp in (1, 2, 4, 8)}
    assert [peaks[pp] for pp in sorted(peaks)] == sorted(peaks.values(), reverse=True)
    assert not predict(BIG, layout_for(BIG, 1), H100).fits
    assert peaks[1] > H100.memory_bytes
    assert predict(BIG, layout_for(BIG, 4), H100).fits


def test_data_parallel_adds_an_allreduce_and_counts_all_replicas():
    one = predict(BIG, layout_for(BIG, 4), H100)
    two = predict(BIG, layout_for(BIG, 4, dp=2), H100)
    assert one.allreduce_seconds == 0 and two.allreduce_seconds > 0
    assert two.step_seconds == pytest.approx(one.step_seconds + two.allreduce_seconds)
    assert two.tokens_per_second == pytest.approx(
        2 * 16 * BIG.seq_len / two.step_seconds
    )
    assert two.peak_memory_bytes == one.peak_memory_bytes


def test_zero_bubble_beats_1f1b():
    ofob = predict(BIG, layout_for(BIG, 8), H100)
    zb = predict(BIG, layout_for(BIG, 8, schedule="zb"), H100)
    assert zb.step_seconds < ofob.step_seconds


def test_the_large_preset_is_planned_without_running_it():
    shape = FLEXTRAIN["large"]
    result = predict(shape, layout_for(shape, 8, m=8), H100)
    assert math.isfinite(result.step_seconds) and result.tokens_per_second > 0
    assert not result.fits  # 600B parameters without expert parallelism: 1.2 TB per rank


# --- devices -------------------------------------------------------------------------------------


def test_builtin_devices_are_the_datasheets():
    assert load_device("h100") is H100
    assert H100.memory_bytes == 80 * GIB and H100.dtype_bytes == 2
    assert (H100.peak_flops, H100.memory_bandwidth) == (989.4e12, 3.35e12)  # dense bf16
    assert 2 * H100.nvlink_bandwidth == 900e9  # NVLink 4, both directions together
    assert load_device("cpu").dtype_bytes == 4
    h200 = load_device("h200")  # an H100's compute, more and faster memory
    assert h200.peak_flops == H100.peak_flops and h200.memory_bytes == 141 * GIB
    assert h200.memory_bandwidth == 4.8e12 > H100.memory_bandwidth
    assert h200.nvlink_bandwidth == H100.nvlink_bandwidth


@pytest.mark.parametrize(("gpu", "description"), [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", None), ("Tesla T4", None),
])
def test_a_gpu_is_described_by_its_name(gpu, description):
    assert gpu_description(gpu) == description


def test_device_from_json(tmp_path):
    path = tmp_path / "a100.json"
    fields = dict(name="a100", peak_flops=312e12, memory_bytes=80 * GIB,
                  memory_bandwidth=2.0e12, p2p_bandwidth=25e9, p2p_latency_s=1e-5)
    path.write_text(json.dumps(fields))
    assert load_device(path) == Device(**fields)
    assert load_device(str(path)).mfu == 0.5


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"name": "x", "peak_flops": 1.0}, r"missing field\(s\) \['memory_bandwidth'"),
        ({"name": "x", "peak_flop": 1.0}, r"unknown field\(s\) \['peak_flop'\]"),
        ([1, 2], "must hold a JSON object"),
    ],
)
def test_bad_device_files_say_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(content))
    with pytest.raises(DeviceError, match=message):
        load_device(path)


def test_unknown_device_name_lists_the_builtins():
    with pytest.raises(DeviceError, match=r"use one of \['cpu', 'h100', 'h200'\]"):
        load_device("tpu")


def test_a_written_device_loads_as_it_was(tmp_path):
    measured = dataclasses.replace(H100, name="h100-measured", mfu=0.31,
                                   memory_overhead_bytes=2.5 * GIB)
    assert load_device(write_device(measured, tmp_path / "d" / "h100.json")) == measured


def _profile(shape, layout, device, *, mfu, peaks=None):
    """A profile of ``layout`` whose units took what the model says at ``mfu``, the ranks'
    peaks ``peaks`` (None: a CPU's)."""
    at_peak = dataclasses.replace(device, mfu=1.0)
    units = {str(u): {"forward_s": c.forward_s / mfu, "input_grad_s": c.input_grad_s / mfu,
                      "weight_grad_s": c.weight_grad_s / mfu}
             for u, c in enumerate(unit_costs(shape, u, layout.micro_batch_size, at_peak)
                                   for u in range(shape.num_units))}
    ranks = {str(r): {"pp_rank": r, "peak_gpu_bytes": None if peaks is None else peaks[r]}
             for r in range(layout.pp)}
    return {"layout": layout.to_dict(), "units": units, "ranks": ranks}


def test_a_measured_device_takes_its_efficiency_from_the_profile():
    layout = layout_for(BIG, 2, m=4)
    cpu_like = _profile(BIG, layout, H100, mfu=0.3)
    measured = measured_device(cpu_like, BIG, H100)
    assert measured.name == "h100-measured" and measured.mfu == pytest.approx(0.3)
    assert measured.peak_flops == H100.peak_flops and measured.memory_overhead_bytes == 0.0
    # The step priced on it: its compute slower by 0.45 / 0.3
    assert predict(BIG, layout, measured).pipeline_seconds > predict(
        BIG, layout, H100).pipeline_seconds * 1.4
    # GPU peaks: the fullest rank's excess over the model becomes the device's overhead.
    model = predict(BIG, layout, measured).peak_memory_bytes
    on_gpu = _profile(BIG, layout, H100, mfu=0.3, peaks=[model[0] + GIB, model[1] + 2 * GIB])
    measured = measured_device(on_gpu, BIG, H100)
    assert measured.memory_overhead_bytes == pytest.approx(2 * GIB)
    assert predict(BIG, layout, measured).peak_memory_bytes == pytest.approx(
        tuple(p + 2 * GIB for p in model))
    # A model that counts more than was held keeps its count.
    under = _profile(BIG, layout, H100, mfu=0.3, peaks=[model[0] / 2, model[1] / 2])
    assert measured_device(under, BIG, H100).memory_overhead_bytes == 0.0


def test_a_run_faster_than_the_peak_raises_the_peak():
    layout = layout_for(SMALL, 1, m=2)
    fast = measured_device(_profile(SMALL, layout, H100, mfu=2.0), SMALL, H100, name="fast")
    assert fast.name == "fast" and fast.mfu == 1.0
    assert fast.matmul_flops == pytest.approx(2 * H100.peak_flops)


def test_a_profile_that_cannot_measure_a_device_says_why():
    layout = layout_for(SMALL, 1, m=2)
    with pytest.raises(ProfileError, match="profile lacks 'units'"):
        measured_device({"layout": layout.to_dict()}, SMALL, H100)
    with pytest.raises(ProfileError, match="has 7 units; the model 34"):
        measured_device(_profile(SMALL, layout, H100, mfu=0.5), BIG, H100)


def test_bad_device_values():
    with pytest.raises(DeviceError, match=r"mfu \(1.5\)"):
        Device(name="x", peak_flops=1, memory_bytes=1, memory_bandwidth=1, p2p_bandwidth=1,
               p2p_latency_s=0, mfu=1.5)


# --- activation checkpointing --------------------------------------------------------------------


def test_a_checkpointed_layer_keeps_its_input_and_runs_its_forward_again():
    plain = [unit_costs(BIG, u, 2, H100) for u in range(BIG.num_units)]
    ac = [unit_costs(BIG, u, 2, H100, checkpointing=True) for u in range(BIG.num_units)]
    hidden = 2 * BIG.seq_len * BIG.d_model * 4  # fp32, as the agent hands it between units
    for unit, (p, c) in enumerate(zip(plain, ac, strict=True)):
        if BIG.unit_kind(unit) != "block":  # embedding and head are never checkpointed
            assert c == p
            continue
        assert c.activation_bytes == hidden < p.activation_bytes
        assert c.recompute_bytes == p.activation_bytes
        assert c.input_grad_s == pytest.approx(p.input_grad_s + p.forward_s)
        assert (c.forward_s, c.weight_grad_s, c.state_bytes) == (
            p.forward_s, p.weight_grad_s, p.state_bytes)


def test_checkpointing_trades_step_time_for_memory_counting_one_recompute():
    plain = layout_for(BIG, 4, m=8)
    ac = dataclasses.replace(plain, activation_checkpointing=True)
    p, c = predict(BIG, plain, H100), predict(BIG, ac, H100)
    assert c.step_seconds > p.step_seconds
    state = sum(unit_costs(BIG, u, 1, H100).state_bytes for u in plain.stage_units(0))
    assert c.peak_memory_bytes[0] - state < (p.peak_memory_bytes[0] - state) / 2
    # Rank 0 holds its state, the layers' inputs in flight, and one layer's recomputed
    # activations at a time: more than the state and one layer's activations.
    assert c.peak_memory_bytes[0] > state + unit_costs(BIG, 1, 1, H100).activation_bytes


def test_the_jobs_precision_sets_the_bytes_the_planner_counts():
    from tidal_api import parse_job
    from tidal_plan.planner import job_device

    def job(precision):
        return parse_job({"apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob",
                          "metadata": {"name": "j"},
                          "spec": {"workers": {"min": 1, "max": 2},
                                   "model": {"layers": 2, "dModel": 64, "heads": 4},
                                   "training": {"precision": precision}}}).spec

    assert job_device(job("bf16"), DEVICES["cpu"]).dtype_bytes == 2
    assert job_device(job("fp32"), H100).dtype_bytes == 4
