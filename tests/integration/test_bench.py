"""The benchmarks still run (on a toy model; their figures are for the closing notes).

Most run in the test's process (:func:`bench`): their workers come from its warm fork server,
not from a fresh interpreter and server per bench. The GPU bench compiles (its compile
workers and caches are not for a test process to keep) and the simulator's needs no torch:
those run as processes.
"""

import contextlib
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tidal_agent.sharing import sharing_copies

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def bench(script: str, *args: str) -> dict:
    """``python bench/SCRIPT ARGS`` in this process, a fresh import of the script as
    ``bench.<name>`` (what its worker processes import their functions from): the JSON it
    prints. Its environment changes are undone."""
    name = f"bench.{Path(script).stem}"
    out, argv, environ = io.StringIO(), sys.argv, dict(os.environ)
    try:
        sys.argv = [str(ROOT / "bench" / script), *args]
        sys.modules.pop(name, None)
        module = importlib.import_module(name)
        with contextlib.redirect_stdout(out):
            module.main()
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)
    return json.loads(out.getvalue())


@pytest.mark.parametrize(
    ("script", "args", "keys"),
    [
        ("pipeline.py", ["--pp", "2", "--steps", "2", "--warmup", "1"], {"ratio", "runs"}),
        ("pipeline.py", ["--pp", "2", "--steps", "2", "--warmup", "1", "--model", "llama"],
         {"ratio", "runs"}),
        # dynamo's eager backend: the compiled sides' plumbing without inductor's minute
        ("hf_step.py", ["--steps", "2", "--warmup", "1", "--compile-backend", "eager"],
         {"ratio", "compiled_ratio", "runs"}),
        ("strict_dp.py", ["--rounds", "1", "--steps", "1", "--dp", "2"],
         {"ratio", "runs", "logical_replicas"}),
        ("reshard.py", ["--rounds", "1"],
         {"ratio", "transfer_bound_ratio", "bytes_min", "release_ratio"}),
    ],
)
def test_bench_runs(script, args, keys):
    report = bench(script, "--tiny", *args)
    assert keys <= report.keys()
    assert report["ratio"] > 0


def test_straggler_bench_runs():
    report = bench("straggler.py", "--tiny", "--steps", "8", "--onset", "2", "--rounds", "1",
                   "--monitor-steps", "3")
    assert report["bits_equal"] is True  # re-planned or not, the same bits
    assert report["monitoring"]["ratio"] > 0 and "throughput_ratio" in report


def test_predictor_bench_runs(tmp_path):
    out = tmp_path / "predictor.json"
    report = bench("predictor.py", "--tiny", "--json", str(out))
    assert json.loads(out.read_text()) == report
    for key in ("median_abs_error", "max_abs_error", "choice_gap"):
        assert math.isfinite(report[key]) and report[key] >= 0
    assert len(report["layouts"]) == 3
    (profile,) = report["profiles"]  # one round
    probe = profile["sharing_probe"]  # the host's probe ran: copies of the pp=2 profiled run
    assert probe["copies"] == sharing_copies(2) and len(probe["steps"]) == probe["copies"]
    assert probe["step_s"] > 0 and profile["sharing"] >= 1.0
    for row in report["layouts"]:
        assert row["predicted_s"] > 0 and row["measured_s"] > 0
    # The memory model against what the trainer allocates: each layout without and with
    # activation checkpointing, every rank within the targets on the CPU.
    memory = report["memory"]
    assert [(r["layout"].removesuffix(" ac"), r["checkpointing"]) for r in memory["layouts"]] == [
        (row["layout"], ac) for row in report["layouts"] for ac in (False, True)]
    assert memory["max_abs_error"] <= memory["targets"]["max_abs_error"]
    assert memory["most_under"] >= memory["targets"]["most_under"]


def test_sim_bench_runs_with_either_cluster_size(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    # a: a long 8-GPU job, elastic under --share 0.9; b and c arrive while it has grown
    (traces / "cluster04.csv").write_text("job_id,submission_time,duration,num_gpu\n"
                                          "a,0,100000,8\nb,5000,100,8\nc,6000,50,1\n")
    doc = tmp_path / "doc.md"
    doc.write_text("head\n<!-- sim:begin -->\nold\n<!-- sim:end -->\ntail\n")
    reports = {}
    for cluster in ("default", "elasticflow"):
        result = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "sim.py"), "--traces", str(traces),
             "--share", "0.9", "--cluster", cluster, "--doc", str(doc),
             "--tradeoff", "0.6,0.99", "--start-below", "0.5"],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
        )
        assert result.returncode == 0, result.stderr
        reports[cluster] = json.loads(result.stdout)
    # default: 4x the elastic job's one node; ElasticFlow simulates cluster04 on 128 nodes
    assert [r["nodes"] for r in reports["default"]["runs"]] == [4, 4]
    assert [r["nodes"] for r in reports["elasticflow"]["runs"]] == [128, 128]
    assert reports["elasticflow"]["cluster"] == "elasticflow"
    for report in reports.values():
        assert report["summary"]["dp-pp"]["tidal"]["jct_speedup_geomean"] > 1.0
        assert report["start_below"] == 0.5 and report["threshold"] == 0.99
        curve = report["summary"]["pp"]["tradeoff"]
        assert [p["threshold"] for p in curve] == [0.6, 0.99]
        assert all(p["jct_speedup_geomean"] > 0 for p in curve)
        # tidal's hot switch beats the restarts here: no peer beats it on both counts
        assert all(r["tidal_beaten_by"] == [] for r in report["runs"])
        assert report["summary"]["pp"]["tidal_beaten"] == {} and report["queue"] == "pods"
    text = doc.read_text()
    assert "| 0.99 | " in text  # the trade-off table
    assert text.startswith("head\n<!-- sim:begin -->\n#### PP-only") and text.endswith("tail\n")
    assert "| cluster04 | 128 (1024) | 1 of 3 |" in text
    assert "| none |" in text and "beaten on both counts by no peer" in text


def test_decide_bench_reports_each_size_against_the_target():
    report = bench("decide.py", "--tiny", "--repeat", "2", "--breakdown")
    (tiny,) = report["sizes"].values()
    for scenario in tiny["scenarios"].values():  # the pieces of one call add up to it
        pieces = dict(scenario["breakdown_ms"])
        total = pieces.pop("total")
        times = [ms for key, ms in pieces.items() if not key.endswith("_count")]
        assert pieces["tally"] > 0 and abs(sum(times) - total) <= 0.05 * total + 0.05, pieces
    assert tiny["size"]["nodes"] == 12 and tiny["target_ms"] == report["target_ms"] == 50.0
    assert set(tiny["scenarios"]) == {"scale_up", "scale_down"}
    assert report["median_ms"] == tiny["median_ms"] == max(
        s["median_ms"] for s in tiny["scenarios"].values())


def test_gpu_bench_tiny_runs_every_cpu_part_and_keeps_the_bits(tmp_path):
    out = tmp_path / "gpu.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--tiny",
                             "--out", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["errors"] == {}
    assert report["finished"] is True and json.loads(out.read_text()) == report
    assert {"device", "pp1", "strict", "pipeline", "snapshots", "switches", "predictor",
            "modeled", "null_reasons"} <= report.keys()
    # What needs CUDA is null, each with its reason
    for key in ("gpu", "nccl", "driver"):
        assert report["device"][key] is None and report["null_reasons"][f"device.{key}"]
    pp1 = report["pp1"]
    # The units compute the library's numbers (--tiny compiles with dynamo's eager backend,
    # whose kernels are eager ones), in relaxed and strict mode alike.
    assert len(set(pp1["first_step_losses"].values())) == 1, pp1["first_step_losses"]
    for name in ("tidal", "tidal_strict", "plain_eager", "plain_compiled"):
        assert pp1["sides"][name]["tokens_per_s"] > 0 and pp1["sides"][name]["mfu"] > 0
    assert pp1["sides"]["tidal_strict"]["determinism"]["torch._inductor.config.deterministic"]
    assert pp1["ratio"] > 0 and pp1["compiled_ratio"] > 0 and pp1["strict_compiled_ratio"] > 0
    # pp 2, 4 and the live switch 2 -> 3 -> 1 give pp=1's losses and parameters, bit for bit
    pipeline = report["pipeline"]
    assert pipeline["steps"] == 6 and len(set(pipeline["losses_hex"])) > 1
    assert [pipeline["runs"][name]["pp"] for name in ("pp1", "pp2", "pp4", "switch")] == [
        [1], [2], [4], [2, 3, 1]]
    for run in pipeline["runs"].values():
        assert run["losses_equal"] is True and run["params_equal"] is True
    assert pipeline["bitwise_equal"] is True
    strict = report["strict"]
    assert strict["steps"] == 3 and strict["runs"][0] == strict["runs"][1]
    assert strict["bitwise_equal"] is True
    snapshots = report["snapshots"]
    assert snapshots["snapshots"] > 0 and snapshots["ratio"] > 0
    assert snapshots["bitwise_equal"] is True
    assert [(s["from_pp"], s["to_pp"]) for s in report["switches"]] == [(2, 3), (3, 1)]
    assert all(s["pause_s"] > 0 and s["bytes_moved"] > 0 for s in report["switches"])
    # tidal_pp1, pp 1, 2 and 4, and the switch's three generations
    rows = report["predictor"]["rows"]
    assert [(r["run"], r["pp"]) for r in rows] == [
        ("tidal_pp1", 1), ("pp1", 1), ("pp2", 2), ("pp4", 4),
        ("switch", 2), ("switch", 3), ("switch", 1)]
    assert all(r["predicted_step_s"] > 0 and r["measured_step_s"] > 0 for r in rows)
    # The modeled predictor per micro-batch size, without and with checkpointing, on the
    # device the pp=1 run measured (on the CPU its memory is the tensors' bytes)
    modeled = report["modeled"]
    assert modeled["device"] == "cpu-measured" and 0 < modeled["mfu"] <= 1
    assert [(r["micro_batch_size"], r["checkpointing"]) for r in modeled["rows"]] == [
        (2, False), (2, True), (4, False), (4, True)]
    assert all(r["measured_peak_bytes"] > 0 and r["measured_step_s"] > 0
               for r in modeled["rows"])
    assert modeled["within_targets"]["memory"] is True


def test_gpu_bench_reads_the_gpu_figures_where_the_runner_reports_them():
    """Peak GPU memory and determinism, from a report that has them (a GPU run's)."""
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    gpu = sys.modules["bench_gpu"] = importlib.util.module_from_spec(spec)  # its dataclasses
    spec.loader.exec_module(gpu)

    def run(pp: int, peak: int, steps: list[str], **extra) -> dict:
        return {"steps": [{"step": i, "seconds": 1.0, "loss_hex": h, "layout": {"pp": pp},
                           "snapshot_s": None} for i, h in enumerate(steps)],
                "params_sha256": "p", "startup_s": 1.0, "peak_gpu_bytes": {"worker-0": peak},
                **extra}

    found = gpu.Findings()
    hexes = ["0x1p+0", "0x1p+1", "0x1p+2"]
    switch = run(2, 0, hexes, reconfigurations=[
        {"at_step": 1, "from": {"pp": 2}, "to": {"pp": 1}, "pause_s": 0.5, "bytes_moved": 8,
         "peak_gpu_bytes": 300}])
    runs = {"pp1": run(1, 100, hexes), "pp2": run(2, 200, hexes), "pp4": None,
            "switch": switch, "pp1_again": run(1, 100, hexes, determinism={"threads": 1}),
            "pp2_snapshots": None}
    (change,) = gpu.switch_part(runs, found)
    assert change["peak_gpu_bytes"] == 300 and change["peak_over_steady"] == 1.5
    strict = gpu.strict_part(runs, gpu.SCALES["tiny"], found)
    assert strict["bitwise_equal"] is True and strict["determinism"] == {"threads": 1}
    runs["pp1_again"]["steps"][2]["loss_hex"] = "0x1p+3"
    assert gpu.strict_part(runs, gpu.SCALES["tiny"], found)["bitwise_equal"] is False
    placement = {"devices": gpu.Devices(transport="host", gpus=1)}
    assert gpu.pipeline_part(runs, {}, placement, found)["bitwise_equal"] is True
    runs["pp2"]["params_sha256"] = "q"  # the same losses, other parameters
    pipeline = gpu.pipeline_part(runs, {}, placement, found)
    assert pipeline["runs"]["pp2"]["losses_equal"] is True
    assert pipeline["bitwise_equal"] is False
    assert set(found.null_reasons) == {"pipeline.device", "pipeline.backend",
                                       "pipeline.runs.pp4"}
    # pp=1's run failed (as calibration did on CUDA with torch 2.11): the others are still
    # compared with one another, and the snapshots' bits are unknown, not unequal.
    runs.update(pp1=None, pp2=run(2, 200, hexes), pp2_snapshots=run(2, 200, hexes))
    pipeline = gpu.pipeline_part(runs, {}, placement, found)
    assert pipeline["baseline"] == "pp2" and pipeline["runs"]["pp1"] is None
    assert pipeline["bitwise_equal"] is True
    runs["switch"]["steps"][1]["loss_hex"] = "0x1p+5"
    assert gpu.pipeline_part(runs, {}, placement, found)["bitwise_equal"] is False
    assert gpu.snapshot_part(runs, found)["bitwise_equal"] is None
    assert found.null_reasons["snapshots.bitwise_equal"] == "the pp=1 run failed (errors)"
