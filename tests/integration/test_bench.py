"""The benchmarks still run (on a toy model; their figures are for the closing notes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
