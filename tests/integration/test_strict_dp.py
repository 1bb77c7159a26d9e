"""Strict data parallelism (issue 25): the global batch is L logical replicas whose gradients
are summed in one fixed tree, so any (dp, pp) layout, any sequence of them switched live, a lost
worker and a checkpoint moved between dp degrees give the float.hex losses and the parameter
digest of one process."""

import dataclasses
import multiprocessing as mp
import os
import signal

import pytest

from tests.jobs import NCCL_MODEL, small_job
from tidal_agent import checkpoint
from tidal_agent.runner import RunError, run_elastic, run_local
from tidal_plan.elastic import Generation, logical_replicas
from tidal_plan.layout import build_layout

pytestmark = pytest.mark.slow

STEPS = 6
MODEL = {"layers": 4, "dModel": 32, "heads": 4, "vocab": 64, "seqLen": 16, "dropout": 0.1}
TRAINING = {"steps": STEPS, "globalBatchSize": 16, "microBatchSize": 2, "seed": 1,
            "warmupSteps": 1, "gradClip": 0.5}


def _job(**sections):
    return small_job("sdp", model=MODEL, training=TRAINING,
                     parallelism={"elastic": "dp-pp", "consistency": "strict"}, **sections)


def _layout(dp, pp, schedule="1f1b"):
    return build_layout(num_units=MODEL["layers"] + 2, workers=dp * pp, dp=dp,
                        micro_batch_size=2, num_micro_batches=8, schedule=schedule)


def _bits(report):
    assert len(report["steps"]) == STEPS - (report["steps"][0]["step"] if report["steps"] else 0)
    return [s["loss_hex"] for s in report["steps"]], report["params_sha256"]


@pytest.fixture(scope="module")
def alone():
    job = _job()
    assert logical_replicas(job.spec) == 8  # workers.max 8, 8 micro-batches
    return _bits(run_local(job, _layout(1, 1), steps=STEPS, timeout_s=60))


@pytest.mark.parametrize(("dp", "pp", "schedule"), [
    (1, 4, "1f1b"), (2, 2, "zb"), (4, 1, "1f1b"), (2, 3, "gpipe"), (8, 1, "1f1b"),
])
def test_every_dp_pp_layout_has_the_bits_of_one_process(alone, dp, pp, schedule):
    assert _bits(run_local(_job(), _layout(dp, pp, schedule), steps=STEPS, timeout_s=60)) == alone


@pytest.mark.parametrize(("dp", "pp", "shares"), [(2, 2, (6, 2)), (4, 1, (1, 3, 2, 2))])
def test_uneven_shares_of_the_micro_batches_have_the_bits_of_one_process(alone, dp, pp, shares):
    """A slow replica's smaller share (the straggler re-plan's): each replica's block of logical
    replicas ends as several subtrees of the tree, completed across the replicas."""
    layout = dataclasses.replace(_layout(dp, pp), shares=shares)
    assert _bits(run_local(_job(), layout, steps=STEPS, timeout_s=60)) == alone


def test_switching_dp_and_pp_live_has_the_bits_and_moves_the_minimum(alone):
    """(1,4) -> (2,2) -> (4,1) -> (2,3) -> (1,4): the same members change layout, then two
    join, then they leave; each switch moves only what the new positions lack. Under NCCL's
    rules (nccl-model): the reshard's buckets and the strict tree's pairs as NCCL runs them."""
    workers = tuple(f"worker-{i}" for i in range(6))
    members = [workers[:4], workers[:4], workers[:4], workers, workers[:4]]
    gens = [Generation(index=i, at_step=i, members=m) for i, m in enumerate(members)]
    layouts = [_layout(1, 4), _layout(2, 2), _layout(4, 1), _layout(2, 3), _layout(1, 4)]
    report = run_elastic(_job(), gens, layouts, steps=STEPS, timeout_s=60,
                         devices=NCCL_MODEL)
    switches = report["reconfigurations"]
    assert [c["at_step"] for c in switches] == [1, 2, 3, 4]
    assert all(c["bytes_moved"] == c["bytes_min"] > 0 for c in switches)
    assert _bits(report) == alone


def test_a_lost_worker_in_a_dp_layout_resumes_at_another_dp_with_the_bits(tmp_path, alone):
    """A worker of a dp 2 x pp 2 run is SIGKILLed after step 3; the checkpoint of step 2 loads
    into dp 4 x pp 1 and the run ends with one process's bits."""
    saving = _job(checkpoint={"path": str(tmp_path), "everySteps": 2})

    def kill(event):
        if event["step"] == 3:
            (victim,) = [p for p in mp.active_children() if p.name == "tidal-worker-3"]
            os.kill(victim.pid, signal.SIGKILL)

    with pytest.raises(RunError, match=r"worker-3 exited with code -9"):
        run_local(saving, _layout(2, 2), steps=STEPS, timeout_s=20, on_step=kill)
    done, latest = checkpoint.latest(tmp_path)
    assert done in (2, 4)
    resumed = run_local(_job(), _layout(4, 1), steps=STEPS, timeout_s=60, resume_from=latest)
    losses, digest = alone
    assert [s["loss_hex"] for s in resumed["steps"]] == losses[done:]
    assert resumed["params_sha256"] == digest


def test_relaxed_dp_takes_the_backends_all_reduce():
    """Relaxed consistency keeps the faster path: it trains, and its losses are its own."""
    relaxed = small_job("sdp", model=MODEL, training=TRAINING,
                        parallelism={"elastic": "dp-pp", "consistency": "relaxed"})
    assert logical_replicas(relaxed.spec) == 1
    for layout in _layout(2, 2), dataclasses.replace(_layout(2, 2), shares=(3, 5)):
        report = run_local(relaxed, layout, steps=STEPS, timeout_s=60)
        values = [s["loss"] for s in report["steps"]]
        assert values[-1] < values[0]
