"""Shared fixtures: a Kubernetes API emulator on a local port, with a kubeconfig for it."""

from __future__ import annotations

import pytest

from tidal_kube.serving import EmulatorThread


@pytest.fixture
def emulator(tmp_path):
    """A running :class:`~tidal_kube.emulator.EmulatorThread`: ``.url``, ``.kubeconfig``
    (a file for lightkube, kopf or kubectl), ``.emulator`` and ``.call(fn, *args)``. Fails the
    test if the emulator itself failed (an API error answered to a client is not a failure)."""
    with EmulatorThread(kubeconfig=tmp_path / "kubeconfig") as cluster:
        yield cluster
    assert not cluster.emulator.failures, f"the emulator failed: {cluster.emulator.failures!r}"
