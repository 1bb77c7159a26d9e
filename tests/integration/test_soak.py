"""The fault soak's short version (bench/soak.py runs the long one): 20 workers lost to SIGKILL
in one run, at random moments, during switches and as snapshots are exchanged, and the run
ends with the bits of one that lost none."""

from __future__ import annotations

import pytest

from tests.integration.soak import FaultKind, FaultSoak, SoakConfig, SwitchMoment


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_twenty_lost_workers_end_bitwise_as_a_static_run(emulator, api, tmp_path):
    # Every kind, the switch faults at every moment.
    config = SoakConfig(faults=20, seed=1)
    run = FaultSoak(config, api=api, kubeconfig=str(emulator.kubeconfig), workdir=tmp_path).run()

    assert len(run.faults) == 20
    assert {f.kind for f in run.faults} == set(FaultKind)
    switches = [f for f in run.faults if f.kind is FaultKind.SWITCH]
    assert {f.moment for f in switches} == set(SwitchMoment)
    assert any(f.in_switch for f in switches)
    # Each recovery lost its fault's victim and rebuilt a boundary from the peer snapshots.
    assert all(f.recovery["snapshot"] and f.recovery["lost"] == [f.victim] for f in run.faults)
    # With a snapshot at every boundary, two steps at most are done again: the leader fails at
    # step s having done step s-1, and a step needs every member, so each had taken its
    # snapshot of boundary s-1 and none has done step s. The victim's copy of s-1 is whole at
    # its keeper unless the victim died while that swap, in the background, was under way;
    # then its copy of s-2 is (the swap of s-2 was settled before s-1's began), and every
    # survivor keeps its own two newest.
    assert all(0 <= f.replayed <= 2 for f in run.faults), [f.record() for f in run.faults]
    assert run.differs is None, run.differs
