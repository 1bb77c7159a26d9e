"""The benchmarks still run (on a toy model; their figures are for the closing notes)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tidal_agent.sharing import sharing_copies

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("script", "args", "keys"),
    [
        ("pipeline.py", ["--pp", "2", "--steps", "2", "--warmup", "1"], {"ratio", "runs"}),
        ("pipeline.py", ["--pp", "2", "--steps", "2", "--warmup", "1", "--model", "llama"],
         {"ratio", "runs"}),
        ("hf_step.py", ["--steps", "2", "--warmup", "1"], {"ratio", "runs"}),
        ("strict_dp.py", ["--rounds", "1", "--steps", "1", "--dp", "2"],
         {"ratio", "runs", "logical_replicas"}),
        ("reshard.py", ["--rounds", "1"],
         {"ratio", "transfer_bound_ratio", "bytes_min", "release_ratio"}),
    ],
)
def test_bench_runs(script, args, keys):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--tiny", *args],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert keys <= report.keys()
    assert report["ratio"] > 0


def test_straggler_bench_runs():
    args = ["--steps", "8", "--onset", "2", "--rounds", "1", "--monitor-steps", "3"]
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "straggler.py"), "--tiny",
                             *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["bits_equal"] is True  # re-planned or not, the same bits
    assert report["monitoring"]["ratio"] > 0 and "throughput_ratio" in report


def test_predictor_bench_runs(tmp_path):
    out = tmp_path / "predictor.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "predictor.py"), "--tiny", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
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
    text = doc.read_text()
    assert "| 0.99 | " in text  # the trade-off table
    assert text.startswith("head\n<!-- sim:begin -->\n#### PP-only") and text.endswith("tail\n")
    assert "| cluster04 | 128 (1024) | 1 of 3 |" in text


def test_decide_bench_reports_each_size_against_the_target():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "decide.py"), "--tiny",
                             "--repeat", "2"], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    (tiny,) = report["sizes"].values()
    assert tiny["size"]["nodes"] == 12 and tiny["target_ms"] == report["target_ms"] == 50.0
    assert set(tiny["scenarios"]) == {"scale_up", "scale_down"}
    assert report["median_ms"] == tiny["median_ms"] == max(
        s["median_ms"] for s in tiny["scenarios"].values())
