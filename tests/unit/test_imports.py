"""DESIGN.md's package boundaries, checked with import-linter."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
    "ini_options"]["pythonpath"]


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": ":".join(str(ROOT / root) for root in SOURCE_ROOTS),
             "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower() or "0 broken" in result.stdout.lower()
