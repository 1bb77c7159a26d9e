"""The live switch: worker counts change between steps, the bits do not."""

import json

import pytest

from tests.commands import TINY, tidal_here

pytestmark = pytest.mark.slow

RECONFIG_KEYS = {"at_step", "from", "to", "pause_s", "world_s", "transfer_s", "rebuild_s",
                 "bytes_moved", "bytes_min", "released_at_once", "peak_gpu_bytes"}


def _report(tmp_path, name, *args):
    path = tmp_path / f"{name}.json"
    result = tidal_here("run", TINY, "--steps", "16", "--report", path, *args)
    assert result.returncode == 0, result.stderr
    return json.loads(path.read_text()), result.stderr


def test_schedule_up_and_down_is_bitwise_static(tmp_path):
    static, _ = _report(tmp_path, "static", "--workers", "2")
    elastic, log = _report(tmp_path, "elastic", "--workers-schedule", "0:2,4:3,8:4,12:2")
    assert [s["loss_hex"] for s in elastic["steps"]] == [s["loss_hex"] for s in static["steps"]]
    assert elastic["params_sha256"] == static["params_sha256"]
    assert [s["layout"]["pp"] for s in elastic["steps"]] == [2] * 4 + [3] * 4 + [4] * 4 + [2] * 4

    changes = elastic["reconfigurations"]
    assert [c["at_step"] for c in changes] == [4, 8, 12]
    assert [(c["from"]["pp"], c["to"]["pp"]) for c in changes] == [(2, 3), (3, 4), (4, 2)]
    for change in changes:
        assert RECONFIG_KEYS <= change.keys()
        assert change["bytes_moved"] == change["bytes_min"] > 0
        assert 0 < change["pause_s"] < 30
        assert change["peak_gpu_bytes"] is None  # a CPU has no GPU memory to report
    assert set(elastic["peak_gpu_bytes"]) == {f"worker-{i}" for i in range(4)}
    assert all(peak is None for peak in elastic["peak_gpu_bytes"].values())
    assert "switch at step 12: 4 -> 2 workers" in log


def test_zero_bubble_schedule_switches_too(tmp_path):
    static, _ = _report(tmp_path, "static", "--workers", "3", "--schedule", "zb")
    elastic, _ = _report(tmp_path, "elastic", "--schedule", "zb", "--workers-schedule", "0:3,5:1,9:4")
    assert [s["loss_hex"] for s in elastic["steps"]] == [s["loss_hex"] for s in static["steps"]]
    assert elastic["params_sha256"] == static["params_sha256"]


def test_relaxed_dp_scaling_reports_its_divergence(tmp_path):
    import yaml

    doc = yaml.safe_load(TINY.read_text())
    doc["spec"]["parallelism"].update(elastic="dp-pp", consistency="relaxed")
    job = tmp_path / "relaxed.yaml"
    job.write_text(yaml.safe_dump(doc))
    path = tmp_path / "relaxed.json"
    result = tidal_here("run", job, "--steps", "12", "--report", path,
                   "--workers-schedule", "0:3,4:4,8:2")
    assert result.returncode == 0, result.stderr
    report = json.loads(path.read_text())
    # The planner's dp at every count, not only at multiples of the first (issue 25, item 2).
    assert [(s["layout"]["dp"], s["layout"]["pp"]) for s in report["steps"]] == (
        [(1, 3)] * 4 + [(4, 1)] * 4 + [(2, 1)] * 4
    )
    d = report["divergence"]
    assert d["static_workers"] == 3
    assert not d["bitwise_equal"]  # dp changed the reduction order: relaxed, and it shows
    assert 0 < d["max_abs_loss_diff"] < 1e-3
    assert "relaxed: dp changed" in result.stderr


def test_from_one_worker_to_one_per_unit_and_back(tmp_path):
    # The extremes of [1, number of units]; a 1 MiB cap forces several buckets per switch.
    static, _ = _report(tmp_path, "static", "--workers", "1")
    elastic, _ = _report(tmp_path, "elastic", "--workers-schedule", "0:1,5:8,10:1",
                         "--reshard-bucket-mib", "1")
    assert [s["layout"]["pp"] for s in elastic["steps"]] == [1] * 5 + [8] * 5 + [1] * 6
    assert [s["loss_hex"] for s in elastic["steps"]] == [s["loss_hex"] for s in static["steps"]]
    assert elastic["params_sha256"] == static["params_sha256"]
    assert all(c["buckets"] > 1 for c in elastic["reconfigurations"])


def test_with_peer_snapshots_leavers_go_at_once_where_their_keepers_stay(tmp_path):
    # 3 -> 2 lets worker-2 go, whose copy its keeper worker-0 holds: it leaves at the boundary
    # and worker-0 sends its state. 4 -> 2 lets worker-3 and worker-4 go, next to each other in
    # the ring (worker-3's keeper leaves too): they send their state themselves.
    import yaml

    from tidal_agent.runner import run_elastic, run_local
    from tidal_api import parse_job
    from tidal_plan.elastic import elastic_plan
    from tidal_plan.layout import resolve_layout

    doc = yaml.safe_load(TINY.read_text())
    # A snapshot at every boundary: a shrink uses the one of its own boundary, if taken.
    doc["spec"].setdefault("checkpoint", {})["snapshotEverySteps"] = 1
    job = parse_job(doc)
    gens, layouts = elastic_plan(job, [(0, 3), (4, 2), (8, 4), (12, 2)])
    elastic = run_elastic(job, gens, layouts, steps=16, timeout_s=120, peer_snapshots=True)
    static = run_local(job, resolve_layout(job, workers=2), steps=16, timeout_s=120)
    changes = elastic["reconfigurations"]
    assert [(c["workers"], c["released_at_once"]) for c in changes] == [
        ([3, 2], True), ([2, 4], False), ([4, 2], False)]
    assert [s["loss_hex"] for s in elastic["steps"]] == [s["loss_hex"] for s in static["steps"]]
    assert elastic["params_sha256"] == static["params_sha256"]
    # Each worker's snapshots in host memory: at most four copies of the largest state it held
    # (at 2 workers, about half the model's), none pinned off a GPU.
    from tidal_agent.switch import state_metadata

    state = sum(m.numel * m.itemsize for m in state_metadata(job.spec.model))
    for worker, held in elastic["snapshot_bytes"].items():
        assert held["pinned"] == 0 and 0 < held["pageable"] <= 4 * 0.6 * state, worker
