"""This checkout's code for a bench script that runs processes of its own: imported first, it
puts the checkout's sources (and the checkout, for ``tests``) on ``sys.path``, and its sources
on ``PYTHONPATH`` too: workers forked from a server (tidal_agent.runner.worker_processes,
tidal_local's pods) import from ``PYTHONPATH``, not from this ``sys.path`` (Python 3.11's
forkserver drops it), and without it, in a second checkout, they would train an installed
checkout's code."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [str(ROOT / root) for root in ("api", "agent", "operator", "doubles")]
sys.path[:0] = [*SOURCES, str(ROOT)]
os.environ["PYTHONPATH"] = os.pathsep.join([*SOURCES, os.environ.get("PYTHONPATH", "")]).rstrip(
    os.pathsep)
