"""Checkpoints reload into any layout and continue the static run bit for bit."""

import pytest

from tests.jobs import small_job
from tidal_agent import checkpoint
from tidal_agent.runner import run_local
from tidal_plan.layout import resolve_layout

pytestmark = pytest.mark.slow


def _job(root, every):
    return small_job(
        "c",
        model={"layers": 4, "dModel": 32, "heads": 4, "vocab": 64, "seqLen": 16, "mtpHeads": 1,
               "dropout": 0.1},
        training={"steps": 12, "globalBatchSize": 8, "microBatchSize": 2, "warmupSteps": 2,
                  "gradClip": 0.5, "seed": 3},
        checkpoint={"path": str(root), "everySteps": every},
    )


def test_resume_with_another_worker_count(tmp_path):
    job = _job(tmp_path / "ckpt", every=6)
    static = run_local(job, resolve_layout(job, workers=2), steps=12, timeout_s=60)
    saved = static["checkpoints"]
    assert [c["path"].rsplit("/", 1)[-1] for c in saved] == ["step-00000006", "step-00000012"]
    assert [c["step"] for c in saved] == [6, 12] and all(c["seconds"] > 0 for c in saved)
    assert checkpoint.latest(tmp_path / "ckpt")[0] == 12

    resumed_dir = checkpoint.step_dir(tmp_path / "ckpt", 6)
    other = _job(tmp_path / "ckpt2", every=0)
    layout = resolve_layout(other, workers=3, schedule="zb", partition=(3, 1, 3))
    resumed = run_local(other, layout, steps=12, timeout_s=60, resume_from=resumed_dir)

    assert [s["step"] for s in resumed["steps"]] == list(range(6, 12))
    assert resumed["startup_s"] > 0
    assert [s["loss_hex"] for s in resumed["steps"]] == [s["loss_hex"] for s in static["steps"][6:]]
    assert resumed["params_sha256"] == static["params_sha256"]


def test_incomplete_checkpoints_are_ignored(tmp_path):
    (tmp_path / "step-00000009").mkdir()  # no marker: a save that never finished
    assert checkpoint.latest(tmp_path) is None
    assert checkpoint.latest(tmp_path / "missing") is None


def test_replicas_write_their_shared_state_once_and_it_reloads(tmp_path):
    """Data-parallel replicas hold the same names: the checkpoint has each once (as a rescue's
    survivors' copies do), and a layout of another shape at the same dp goes on bit for bit."""
    from tidal_agent.switch import state_shapes
    from tidal_plan.layout import build_layout

    def layout(job, workers, partition=None):
        spec = job.spec
        return build_layout(num_units=spec.model.num_units, workers=workers, dp=2,
                            partition=partition, micro_batch_size=spec.training.micro_batch_size,
                            num_micro_batches=spec.training.num_micro_batches, schedule="1f1b")

    job = _job(tmp_path / "ckpt", every=6)
    static = run_local(job, layout(job, 2), steps=12, timeout_s=60)  # dp2 pp1
    shapes = state_shapes(job.spec.model)
    state_bytes = 4 * sum(shape.numel() for shape in shapes.values())
    written = sum(f.stat().st_size for f in checkpoint.step_dir(tmp_path / "ckpt", 6).rglob(
        "*.distcp"))
    # Once, not once per replica (twice would be over twice the state): the state and
    # torch.save's framing, 1,044,448 bytes here, as many as a dp1 save of this job writes.
    assert state_bytes <= written < 2 * state_bytes
    other = _job(tmp_path / "ckpt2", every=0)
    resumed = run_local(other, layout(other, 4, partition=(4, 3)), steps=12, timeout_s=60,
                        resume_from=checkpoint.step_dir(tmp_path / "ckpt", 6))  # dp2 pp2
    assert [s["loss_hex"] for s in resumed["steps"]] == [s["loss_hex"] for s in static["steps"][6:]]
    assert resumed["params_sha256"] == static["params_sha256"]
