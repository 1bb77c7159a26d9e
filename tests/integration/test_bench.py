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
        ("reshard.py", ["--rounds", "1"], {"ratio", "transfer_bound_ratio", "bytes_min"}),
    ],
)
def test_bench_runs(script, args, keys):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--tiny", *args],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert keys <= report.keys()
    assert report["ratio"] > 0


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
