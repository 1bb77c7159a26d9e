"""The planner: partitions, predictors, the search, scale tables and the presets."""

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tidal_api import ScaleTable, parse_job
from tidal_api.layout import Layout, ScheduleKind
from tidal_plan.costmodel import Sharding, predict, unit_costs
from tidal_plan.devices import DEVICES, Device
from tidal_plan.layout import build_layout
from tidal_plan.modelshape import FLEXTRAIN, ModelShape
from tidal_plan.partition import StageMemory, _pack, balanced_partition
from tidal_plan.planner import (
    FLEXTRAIN_RUNS,
    LayoutPlanner,
    flextrain_space,
    job_space,
    plan_flextrain,
    plan_job,
)
from tidal_plan.predictors import ModeledPredictor
from tidal_plan.search import (
    SPLIT_RECOMPUTE,
    Choice,
    Dropped,
    SearchSpace,
    candidates,
    choose,
    scale_table,
    search,
)

ROOT = Path(__file__).resolve().parents[2]
H100, CPU = DEVICES["h100"], DEVICES["cpu"]


# --- partitions ----------------------------------------------------------------------------------


def _compositions(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        yield tuple(b - a for a, b in itertools.pairwise(edges))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=9), st.data())
def test_balanced_partition_minimises_the_slowest_stage(seconds, data):
    stages = data.draw(st.integers(1, len(seconds)))
    found = balanced_partition(seconds, stages)
    assert found is not None and sum(found) == len(seconds) and len(found) == stages

    def slowest(partition):
        edges = list(itertools.accumulate(partition, initial=0))
        return max(sum(seconds[a:b]) for a, b in itertools.pairwise(edges))

    best = min(slowest(p) for p in _compositions(len(seconds), stages))
    assert slowest(found) <= best * (1 + 1e-5)


def test_memory_cap_moves_units_off_the_stage_that_holds_most_micro_batches():
    seconds = [1.0] * 6
    # Stage 0 keeps three micro-batches in flight, stage 1 one: a unit costs it 3 bytes, not 1.
    memory = StageMemory(state=[0.0] * 6, activation=[1.0] * 6, in_flight=[3, 1])
    assert balanced_partition(seconds, 2) == (3, 3)
    assert balanced_partition(seconds, 2, memory, memory_cap=6.0) == (2, 4)
    assert balanced_partition(seconds, 2, memory, memory_cap=2.0) is None


def bisect_packing_every_limit(seconds, stages, memory, cap):
    """balanced_partition's bisection as it reads, packing at every limit it tries."""
    hi = sum(seconds) + 1e-30
    best = _pack(seconds, memory, stages, hi, cap)[0]
    if best is None:
        return None
    lo = max(seconds)
    for _ in range(40):
        mid = (lo + hi) / 2
        found = _pack(seconds, memory, stages, mid, cap)[0]
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
        if hi - lo <= 1e-6 * hi:
            break
    return best


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0.05, 0.5, 1.0, 1.0, 1.0, 2.0, 3.5]) | st.floats(0.01, 5.0),
                min_size=1, max_size=40),
       st.data())
def test_balanced_partition_packs_only_where_the_answer_is_unknown(seconds, data):
    # A pack answers for a range of limits (packed: down to its slowest stage; not: up to the
    # least sum a stage stopped short of); skipping the limits in those ranges must not change
    # the bisection's answer, with or without a memory cap.
    stages = data.draw(st.integers(1, len(seconds)))
    memory, cap = None, float("inf")
    if data.draw(st.booleans()):
        n = len(seconds)
        memory = StageMemory(
            state=data.draw(st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n)),
            activation=data.draw(st.lists(st.floats(0.0, 2.0), min_size=n, max_size=n)),
            in_flight=data.draw(st.lists(st.sampled_from([1, 2, 3, 4.5]), min_size=stages,
                                         max_size=stages)))
        cap = data.draw(st.floats(1.0, 40.0))
    assert balanced_partition(seconds, stages, memory, cap) == (
        bisect_packing_every_limit(seconds, stages, memory, cap))


def test_heads_get_stages_of_their_own():
    # FlexTrain's No-Op insertion: a 129k-vocabulary LM or MTP head outweighs several blocks.
    shape = FLEXTRAIN["small"]
    seconds = [unit_costs(shape, u, 1, H100).seconds for u in range(shape.num_units)]
    partition = balanced_partition(seconds, 8)
    assert partition[-3:] == (1, 1, 1) and partition[0] > 1


# --- the search ----------------------------------------------------------------------------------

SHAPE = ModelShape(layers=6, d_model=256, heads=4, vocab=4096, seq_len=128, mtp_heads=1)


def space(**kwargs):
    base = dict(min_workers=1, max_workers=6, global_batch_size=16, micro_batch_sizes=(1, 2),
                memory_bytes=CPU.memory_bytes, dp=None, min_gain=0.0)
    return SearchSpace(**{**base, **kwargs})


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 6])
def test_branch_and_bound_finds_the_exhaustive_best(workers):
    predictor = ModeledPredictor(SHAPE, CPU)
    sp = space()
    layouts = [c for c in candidates(predictor, sp, workers) if isinstance(c, Layout)]
    exhaustive = min(predictor.predict(lay).step_seconds for lay in layouts)
    found = choose(predictor, sp, workers)
    assert isinstance(found, Choice)
    assert found.prediction.step_seconds == pytest.approx(exhaustive, rel=1e-12)
    assert found.priced <= found.considered == len(layouts)


def test_candidates_cover_dp_micro_batches_schedules_and_partitions():
    layouts = [c for c in candidates(ModeledPredictor(SHAPE, CPU), space(), 4)
               if isinstance(c, Layout)]
    assert {lay.dp for lay in layouts} == {1, 2, 4}
    assert {lay.micro_batch_size for lay in layouts} == {1, 2}
    assert {lay.schedule for lay in layouts} == set(ScheduleKind)
    assert any(len(set(lay.partition)) > 1 for lay in layouts)  # uneven ones too
    for lay in layouts:
        assert lay.dp * lay.num_micro_batches * lay.micro_batch_size == 16


def test_dropped_rows_say_why():
    predictor = ModeledPredictor(SHAPE, CPU)
    # 9 units: 10 workers cannot all be pipeline ranks with dp fixed at 1.
    result = search(predictor, space(min_workers=9, max_workers=10, dp=1))
    assert result.dropped[10].reason == "hyperparameters"
    assert "exceeds the model's 9 placement units" in result.dropped[10].detail
    # A cap below the parameters alone.
    tight = search(predictor, space(max_workers=2, memory_bytes=1e6))
    assert {d.reason for d in tight.dropped.values()} == {"memory"}
    assert "exceed 0.0 GiB per GPU" in tight.dropped[1].detail
    # Demanding a 10x gain per extra worker keeps only the first row.
    greedy = search(predictor, space(max_workers=3, min_gain=9.0))
    assert list(greedy.choices) == [1]
    assert {greedy.dropped[w].reason for w in (2, 3)} == {"gain"}


def test_rows_the_predictors_disagree_on_are_dropped():
    # A second opinion from a device whose messages cost a second: pipelines stop paying off.
    slow_links = dataclasses.replace(CPU, name="slow-links", p2p_latency_s=1.0)
    chooser = ModeledPredictor(SHAPE, CPU)
    other = ModeledPredictor(SHAPE, slow_links)
    result = search(chooser, space(max_workers=3, dp=1, micro_batch_sizes=(2,)), other=other)
    assert result.dropped[2].reason == "disagreement"
    assert "modeled" in result.dropped[2].detail and "more than 25% apart" in result.dropped[2].detail
    agree = search(chooser, space(max_workers=3, dp=1, micro_batch_sizes=(2,)), other=chooser)
    assert not any(d.reason == "disagreement" for d in agree.dropped.values())


def test_scale_table_round_trips_and_refuses_gaps():
    sp = space(max_workers=4, dp=1, micro_batch_sizes=(2,))
    result = search(ModeledPredictor(SHAPE, CPU), sp)
    table = scale_table(result, sp, job="t", device="cpu", seq_len=SHAPE.seq_len)
    wire = json.loads(table.model_dump_json(by_alias=True))
    assert {"minWorkers", "maxWorkers", "rows", "dropped"} <= set(wire)
    assert {"stepSeconds", "tokensPerSecond", "peakMemoryBytes", "layout"} <= set(wire["rows"][0])
    assert {"dp", "pp", "microBatchSize", "numMicroBatches"} <= set(wire["rows"][0]["layout"])
    assert [r.layout for r in table.rows] == [result.choices[r.workers].layout for r in table.rows]
    assert ScaleTable.model_validate(wire) == table
    assert table.rows[0].speedup == 1.0
    assert table.best_within(100) == table.rows[-1] and table.best_within(0) is None
    wire["rows"] = wire["rows"][1:]
    with pytest.raises(ValidationError, match="one row or dropped entry per worker count"):
        ScaleTable.model_validate(wire)


# --- jobs and presets ----------------------------------------------------------------------------


def _job(**parallelism):
    return parse_job({"apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob",
                      "metadata": {"name": "j"},
                      "spec": {"workers": {"min": 1, "max": 4},
                               "model": {"layers": 6, "dModel": 64, "heads": 4},
                               "training": {"globalBatchSize": 16, "microBatchSize": 2},
                               "parallelism": parallelism}})


def test_strict_jobs_keep_what_fixes_the_bits():
    strict = job_space(_job().spec, CPU)
    assert strict.dp == 1 and strict.micro_batch_sizes == (2,)
    relaxed = job_space(_job(elastic="dp-pp", consistency="relaxed").spec, CPU)
    assert relaxed.dp is None and relaxed.micro_batch_sizes == (1, 2, 4)
    pinned = job_space(_job(schedule="zb").spec, CPU)
    assert pinned.schedules == (ScheduleKind.ZERO_BUBBLE,)


def test_zero_bubble_is_not_planned_with_checkpointing():
    """Its W recomputes each checkpointed layer again, which the cost model does not price."""
    layers = dataclasses.replace(job_space(_job(schedule="zb").spec, CPU), checkpointing=(True,))
    found = choose(ModeledPredictor(ModelShape.of(_job().spec.model), CPU), layers, 2)
    assert isinstance(found, Dropped) and found.detail == SPLIT_RECOMPUTE
    auto = dataclasses.replace(layers, checkpointing=(False, True))
    found = choose(ModeledPredictor(ModelShape.of(_job().spec.model), CPU), auto, 2)
    assert isinstance(found, Choice) and not found.layout.activation_checkpointing


def test_plan_job_covers_every_worker_count():
    table, _ = plan_job(_job(), CPU)
    assert table.min_workers == 1 and table.max_workers == 4 and table.source == "modeled"
    assert len(table.rows) + len(table.dropped) == 4
    assert all(r.layout.dp == 1 and r.layout.micro_batch_size == 2 for r in table.rows)


def test_the_runner_planner_honours_the_given_dp():
    planner = LayoutPlanner(_job(elastic="dp-pp", consistency="relaxed"), CPU)
    layout, prediction = planner.layout(4, dp=2)
    assert layout.dp == 2 and layout.pp == 2 and layout.micro_batch_size == 2
    assert prediction.step_seconds == planner.predict(layout).step_seconds


def test_sharding_splits_tokens_and_experts():
    shape = FLEXTRAIN["small"]
    whole = unit_costs(shape, 1, 1, H100, sharding=Sharding(megatron=True))
    cp8 = unit_costs(shape, 1, 1, H100, sharding=Sharding(cp=8, megatron=True))
    assert cp8.activation_bytes == pytest.approx(whole.activation_bytes / 8)
    assert cp8.weight_grad_s == pytest.approx(whole.weight_grad_s / 8)
    ep8 = unit_costs(shape, 1, 1, H100, dp=1, sharding=Sharding(cp=8, ep=8))
    assert ep8.state_bytes < whole.state_bytes / 4  # the experts are most of a block
    zero = unit_costs(shape, 1, 1, H100, dp=1,
                      sharding=Sharding(cp=8, ep=8, distributed_optimizer=True))
    assert zero.state_bytes < ep8.state_bytes
    with pytest.raises(ValueError, match=r"ep \(16\) must divide dp x cp \(1 x 8\)"):
        Sharding(cp=8, ep=16).check(FLEXTRAIN["large"], dp=1)
    with pytest.raises(ValueError, match="needs an MoE model"):
        Sharding(ep=2).check(SHAPE, dp=2)


def test_the_devices_nvlink_serves_groups_within_a_node():
    assert H100.bandwidth(8) == H100.nvlink_bandwidth > H100.bandwidth(16) == H100.p2p_bandwidth
    plain = Device(name="x", peak_flops=1e12, memory_bytes=1e9, memory_bandwidth=1e9,
                   p2p_bandwidth=1e9, p2p_latency_s=0)
    assert plain.bandwidth(2) == plain.p2p_bandwidth


@pytest.mark.parametrize("name", sorted(FLEXTRAIN_RUNS))
def test_flextrain_initial_layouts_are_the_slides_and_fit(name):
    run = FLEXTRAIN_RUNS[name]
    shape, sharding, sp = flextrain_space(name, H100)
    workers = run.gpus[0] // sharding.gpus_per_rank
    found = choose(ModeledPredictor(shape, H100, sharding), sp, workers)
    assert isinstance(found, Choice), found
    assert (found.layout.dp, found.layout.pp) == (run.dp, run.pp)
    assert max(found.prediction.peak_memory_bytes) <= H100.memory_bytes


def test_the_large_preset_needs_its_sharding_to_fit():
    shape = FLEXTRAIN["large"]
    lay = build_layout(num_units=shape.num_units, workers=32, dp=4, micro_batch_size=1,
                       num_micro_batches=768)
    assert not predict(shape, lay, H100).fits
    assert predict(shape, lay, H100, Sharding(cp=8, ep=16, distributed_optimizer=True,
                                              megatron=True)).fits


def test_flextrain_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown FlexTrain configuration 'huge'"):
        flextrain_space("huge", H100)
    with pytest.raises(ValueError, match="elastic must be pp or dp-pp"):
        flextrain_space("small", H100, elastic="tp")


@pytest.mark.parametrize(
    "name", ["small", "medium", pytest.param("large", marks=pytest.mark.slow)]
)
def test_checked_in_tables_are_what_the_planner_builds(name):
    # Large takes seconds: its DP+PP rows simulate steps of up to 64 ranks x 384 micro-batches.
    for elastic in ("pp", "dp-pp"):
        table, _ = plan_flextrain(name, H100, elastic=elastic)
        path = ROOT / "examples" / "scale-tables" / f"flextrain-{name}-{elastic}.json"
        assert json.loads(path.read_text()) == json.loads(table.model_dump_json(by_alias=True))


def test_a_dropped_count_is_not_a_choice():
    found = choose(ModeledPredictor(SHAPE, CPU), space(dp=1), 11)
    assert isinstance(found, Dropped) and found.reason == "hyperparameters"


def test_auto_checkpointing_turns_on_only_where_a_layout_would_not_fit():
    """With activationCheckpointing auto the search prices layouts both ways; the slower,
    checkpointed one wins only where the other runs out of memory."""
    def job(setting):
        return parse_job({"apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob",
                          "metadata": {"name": "j"},
                          "spec": {"workers": {"min": 1, "max": 3},
                                   "model": {"layers": 6, "dModel": 256, "heads": 4,
                                             "seqLen": 512},
                                   "training": {"globalBatchSize": 16, "microBatchSize": 4,
                                                "activationCheckpointing": setting},
                                   # ZB-H1 keeps more than 1F1B (what its I leaves for W)
                                   "parallelism": {"schedule": "1f1b"}}})

    off, _ = plan_job(job("off"), CPU)
    # Room for the plain layout of 3 workers, not for one worker's (a longer 1F1B warm-up).
    peaks = {r.workers: r.peak_memory_bytes for r in off.rows}
    assert peaks[1] > peaks[3] * 1.05
    tight = dataclasses.replace(CPU, memory_bytes=peaks[3] * 1.005)
    auto, _ = plan_job(job("auto"), tight)
    rows = {r.workers: r.layout.activation_checkpointing for r in auto.rows}
    assert rows[1] is True and rows[3] is False
    off, _ = plan_job(job("off"), tight)
    assert 1 not in {r.workers for r in off.rows}
    assert [d.reason for d in off.dropped if d.workers == 1] == ["memory"]
    always, _ = plan_job(job("layers"), CPU)
    assert all(r.layout.activation_checkpointing for r in always.rows)


def test_strict_dp_pp_lets_dp_vary_over_the_divisors_of_the_logical_replicas():
    def job(**parallelism):
        return parse_job({"apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob",
                          "metadata": {"name": "j"},
                          "spec": {"workers": {"min": 1, "max": 6},
                                   "model": {"layers": 6, "dModel": 64, "heads": 4},
                                   "training": {"globalBatchSize": 24, "microBatchSize": 1},
                                   "parallelism": {"elastic": "dp-pp", **parallelism}}})

    strict = job_space(job().spec, CPU)
    assert strict.dp is None and strict.micro_batch_sizes == (1,)
    assert strict.logical_replicas == 8  # the smallest power of two >= 6 dividing 24
    four = job(logicalReplicas=4)
    assert job_space(four.spec, CPU).logical_replicas == 4
    table, result = plan_job(four, CPU)
    assert {r.layout.dp for r in table.rows} <= {1, 2, 4}
    reasons = [r for r in candidates(ModeledPredictor(ModelShape.of(four.spec.model), CPU),
                                     job_space(four.spec, CPU), 6) if isinstance(r, str)]
    assert "dp=3 does not divide the 4 logical replicas (strict data parallelism)" in reasons
    assert job(logicalReplicas=16).spec.contradiction() == (
        "parallelism.logicalReplicas (16) must divide the 24 micro-batches of a step "
        "(globalBatchSize / microBatchSize)")
    relaxed = job_space(job(consistency="relaxed").spec, CPU)
    assert relaxed.dp is None and relaxed.logical_replicas == 0
