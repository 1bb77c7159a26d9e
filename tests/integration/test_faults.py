"""A lost worker stops the job promptly, by name, and the job resumes with who is left."""

import multiprocessing as mp
import os
import signal
import time

import pytest

from tidal_agent import checkpoint
from tidal_agent.runner import RunError, elastic_plan, resolve_layout, run_elastic, run_local
from tidal_api import parse_job

pytestmark = pytest.mark.slow
TIMEOUT_S = 20


def _job(root):
    return parse_job({
        "apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob", "metadata": {"name": "f"},
        "spec": {
            "workers": {"min": 2, "max": 8},
            "model": {"layers": 4, "dModel": 32, "heads": 4, "vocab": 64, "seqLen": 16},
            "training": {"steps": 12, "globalBatchSize": 8, "microBatchSize": 2, "gradClip": 0.5},
            "checkpoint": {"path": str(root), "everySteps": 4},
        },
    })


def _kill(name):
    def on_step(event):
        if event["step"] == 5:
            (victim,) = [p for p in mp.active_children() if p.name == f"tidal-{name}"]
            os.kill(victim.pid, signal.SIGKILL)
    return on_step


def test_lost_worker_stops_the_job_and_it_resumes_with_the_rest(tmp_path):
    job = _job(tmp_path / "ckpt")
    started = time.monotonic()
    with pytest.raises(RunError, match=r"worker-1 exited with code -9"):
        run_local(job, resolve_layout(job, workers=3), steps=12, timeout_s=TIMEOUT_S,
                  on_step=_kill("worker-1"))
    assert time.monotonic() - started < 60  # start-up plus a few steps, not a hang
    assert not [p for p in mp.active_children() if p.name.startswith("tidal-")]

    steps_done, latest = checkpoint.latest(tmp_path / "ckpt")
    assert steps_done == 4
    resumed = run_local(_job(tmp_path / "ckpt2"), resolve_layout(job, workers=2), steps=12,
                        timeout_s=TIMEOUT_S, resume_from=latest)
    static = run_local(_job(tmp_path / "ckpt3"), resolve_layout(job, workers=3), steps=12,
                       timeout_s=TIMEOUT_S)
    assert [s["loss_hex"] for s in resumed["steps"]] == [s["loss_hex"] for s in static["steps"][4:]]
    assert resumed["params_sha256"] == static["params_sha256"]


def test_lost_joiner_stops_a_switch(tmp_path):
    job = _job(tmp_path / "ckpt")
    gens, layouts = elastic_plan(job, [(0, 2), (8, 3)])
    with pytest.raises(RunError, match=r"worker-2 exited with code -9"):
        run_elastic(job, gens, layouts, steps=12, timeout_s=TIMEOUT_S, on_step=_kill("worker-2"))
    assert not [p for p in mp.active_children() if p.name.startswith("tidal-")]
