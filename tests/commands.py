"""The ``tidal`` command for the tests, two ways: as a process, what a user runs (the tests of
the command itself; forked from the test process's warmed fork server rather than a fresh
interpreter), or in the test's own process through click's runner, the same command line
without a process and worker server per run (the tests of what a run computes).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from click.testing import CliRunner

from tidal_local.processes import fork

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny.yaml"


def tidal(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """``tidal ARGS`` as a process from the repository root: a fork of this process's warmed
    fork server (:func:`tidal_local.processes.fork`, torch imported), not a fresh
    interpreter, with its own standard output and error."""
    return tidal_forked("tidal_cli", [str(a) for a in args], env=dict(os.environ),
                        timeout=timeout)


def tidal_forked(main: str, argv: list[str], *, env: dict[str, str],
                 timeout: float) -> subprocess.CompletedProcess:
    """:func:`tidal` of the click ``main`` of module ``main``, in environment ``env``."""
    with tempfile.TemporaryDirectory(prefix="tidal-command-") as scratch:
        out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
        proc = fork(main, argv, env=env, log_path=out, stderr_path=err, cwd=ROOT,
                    daemon=False)
        try:
            code = proc.wait(timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return subprocess.CompletedProcess(["tidal", *argv], code, out.read_text(),
                                           err.read_text())


def tidal_here(*args) -> subprocess.CompletedProcess:
    """``tidal ARGS`` in this process, as :func:`tidal` reports it. An exception that is not
    the command's exit is raised, with its traceback, rather than turned into an exit code."""
    from tidal_cli import main

    result = CliRunner().invoke(main, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["tidal", *map(str, args)], result.exit_code,
                                       result.stdout, result.stderr)
