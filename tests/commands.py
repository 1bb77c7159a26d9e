"""The ``tidal`` command for the tests, two ways: as a process, what a user runs (the tests of
the command itself), or in the test's own process through click's runner, the same command
line without a fresh interpreter and worker server per run (the tests of what a run computes).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
TIDAL = Path(sys.executable).with_name("tidal")
TINY = ROOT / "examples" / "tiny.yaml"


def tidal(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """``tidal ARGS`` as a process from the repository root."""
    return subprocess.run([str(TIDAL), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def tidal_here(*args) -> subprocess.CompletedProcess:
    """``tidal ARGS`` in this process, as :func:`tidal` reports it. An exception that is not
    the command's exit is raised, with its traceback, rather than turned into an exit code."""
    from tidal_cli import main

    result = CliRunner().invoke(main, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["tidal", *map(str, args)], result.exit_code,
                                       result.stdout, result.stderr)
