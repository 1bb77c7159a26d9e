"""Shared fixtures: a Kubernetes API emulator on a local port, with a kubeconfig for it, and a
client of it that knows the ElasticTrainingJob CRD."""

from __future__ import annotations

import pytest

from tests.integration.agents import crd_client
from tidal_kube.serving import EmulatorThread


@pytest.fixture
def emulator(tmp_path):
    """A running :class:`~tidal_kube.emulator.EmulatorThread`: ``.url``, ``.kubeconfig``
    (a file for lightkube, kopf or kubectl), ``.emulator`` and ``.call(fn, *args)``. Fails the
    test if the emulator itself failed (an API error answered to a client is not a failure)."""
    with EmulatorThread(kubeconfig=tmp_path / "kubeconfig") as cluster:
        yield cluster
    assert not cluster.emulator.failures, f"the emulator failed: {cluster.emulator.failures!r}"


@pytest.fixture
def api(emulator):
    """A lightkube client of ``emulator``, with the ElasticTrainingJob CRD installed."""
    client = crd_client(emulator)
    yield client
    client.close()
