"""Peer snapshots: the leader's choice of the cut the survivors of a fault rebuild from, and
when snapshots are taken."""

from __future__ import annotations

from tidal_agent.snapshot import choose_cut
from tidal_plan.layout import build_layout


def _layout(workers: int) -> dict:
    return build_layout(num_units=8, workers=workers, micro_batch_size=1,
                        num_micro_batches=4).to_dict()


def _copy(members: list[str], step: int, of: str, generation: int = 0) -> dict:
    return {"generation": generation, "members": members, "layout": _layout(len(members)),
            "step": step, "of": of}


def _ring(members: list[str], steps: dict[str, list[int]], generation: int = 0) -> dict:
    """Each member's summary: own copies at ``steps[member]``, and its ward's (the member
    before it in the ring) at the steps both hold, as a completed exchange leaves them."""
    out = {}
    for i, me in enumerate(members):
        ward = members[i - 1]
        out[me] = {"own": [_copy(members, s, me, generation) for s in steps[me]],
                   "ward": [_copy(members, s, ward, generation)
                            for s in steps[me] if s in steps[ward]]}
    return out


def test_a_lost_member_is_sent_by_its_keeper_at_the_newest_whole_boundary():
    members = ["w0", "w1", "w2", "w3"]
    held = _ring(members, {m: [6, 7] for m in members})
    del held["w3"]  # lost: w0 (the next in the ring) keeps its copy
    cut = choose_cut(held)
    assert cut.step == 7 and cut.members == tuple(members)
    assert dict(cut.senders) == {"w3": "w0"}
    assert cut.layout.pp == 4


def test_a_lost_member_a_boundary_behind_takes_everyone_back_to_its_copy():
    # w1 died before sending its copy of step 8; w0 and w3 finished step 7 and took step 8.
    members = ["w0", "w1", "w2", "w3"]
    held = _ring(members, {"w0": [7, 8], "w1": [6, 7], "w2": [7, 8], "w3": [7, 8]})
    held["w2"]["ward"] = [c for c in held["w2"]["ward"] if c["step"] == 7]
    del held["w1"]
    cut = choose_cut(held)
    assert cut.step == 7 and dict(cut.senders) == {"w1": "w2"}


def test_no_cut_when_a_lost_member_and_its_keeper_are_both_gone():
    members = ["w0", "w1", "w2", "w3"]
    held = _ring(members, {m: [4, 5] for m in members})
    del held["w1"], held["w2"]  # w2 kept w1's copy
    assert choose_cut(held) is None
    held = _ring(members, {m: [4, 5] for m in members})
    del held["w1"], held["w3"]  # not neighbours: each has a keeper left
    assert dict(choose_cut(held).senders) == {"w1": "w2", "w3": "w0"}


def test_every_survivor_of_the_cut_needs_its_own_copy():
    members = ["w0", "w1", "w2"]
    held = _ring(members, {"w0": [3, 4], "w1": [3, 4], "w2": [3, 4]})
    held["w0"]["own"] = held["w0"]["own"][:1]  # w0 lost its copy of step 4 (say, overwritten)
    del held["w2"]
    assert choose_cut(held).step == 3


def test_at_a_switch_boundary_the_newer_generation_wins_and_leavers_count_as_lost():
    old, new = ["w0", "w1", "w2"], ["w0", "w1"]  # w2 left at the scale-down at step 10
    held = _ring(old, {m: [9, 10] for m in old})
    for pod, summary in _ring(new, {m: [10] for m in new}, generation=1).items():
        held[pod]["own"] += summary["own"]
        held[pod]["ward"] += summary["ward"]
    del held["w2"]
    cut = choose_cut(held)
    assert (cut.generation, cut.step, cut.members, dict(cut.senders)) == (1, 10, ("w0", "w1"), {})
    # Without the new world's copies, the old world's at the same step: w2's part from w0.
    for summary in held.values():
        summary["own"] = [c for c in summary["own"] if c["generation"] == 0]
    cut = choose_cut(held)
    assert (cut.generation, cut.step, dict(cut.senders)) == (0, 10, {"w2": "w0"})


def test_nothing_held_is_no_cut():
    assert choose_cut({}) is None
    assert choose_cut({"w0": {}, "w1": {"own": [], "ward": []}}) is None


# ---- when snapshots are taken (Cadence) ----------------------------------------------------------

def _world(generation: int = 0, name: str = "train"):
    """A one-member world on a real gloo group (its CPU group the same): the cadence's
    reduction runs, over one member."""
    from datetime import timedelta

    import torch.distributed as dist

    import torch

    from tidal_agent.transport import Transport
    from tidal_agent.world import Rendezvous, World

    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    return World(generation=generation, members=("w0",), rank=0,
                 transport=Transport(pg, torch.device("cpu"), 10.0), store=dist.HashStore(),
                 rendezvous=Rendezvous(host="127.0.0.1", port=0, prefix="t/"), name=name, cpu=pg)


def _due(cadence, world, steps) -> list[int]:
    """The steps of ``steps`` at which ``cadence`` takes a snapshot (each step 1 s; the step
    after a snapshot ``overlapped`` s, a snapshot holding training for ``held`` s)."""
    taken = []
    for step in steps:
        if cadence.due(world, step):
            taken.append(step)
            cadence.taken(world, step, held_s=0.1)
            cadence.stepped(1.2)
        else:
            cadence.stepped(1.0)
    return taken


def test_a_fixed_interval_counts_from_each_world_s_first_boundary():
    from tidal_agent.snapshot import Cadence

    cadence = Cadence(3)
    first, second = _world(0), _world(1, "recovery1")
    assert _due(cadence, first, range(0, 8)) == [0, 3, 6]
    assert _due(cadence, second, range(7, 12)) == [7, 10]  # a new world: at once


def test_the_default_interval_keeps_the_measured_cost_within_the_budget():
    from tidal_agent.snapshot import BUDGET, Cadence

    cadence = Cadence(0)
    world = _world()
    # Two steps while a figure is missing; then the cost, 0.1 s held plus the 0.2 s the step
    # beside the swap took over a plain one, within BUDGET of 1 s steps: 0.3 / 0.05 = 6.
    assert _due(cadence, world, range(0, 16)) == [0, 2, 8, 14]
    assert cadence.interval == round(0.3 / (BUDGET * 1.0)) == 6
    # Another world (a switch, a recovery): other step times, measured afresh.
    assert _due(cadence, _world(1), range(16, 19)) == [16, 18]


def test_a_negative_interval_is_refused_with_the_fix():
    import pytest

    from tidal_agent.snapshot import Cadence

    with pytest.raises(ValueError, match="at least 1 step, or 0"):
        Cadence(-1)


def test_a_one_member_snapshot_copies_the_state_into_host_memory():
    import torch

    from tidal_agent.snapshot import PeerSnapshots
    from tidal_plan.reshard import TensorMeta

    metas = [TensorMeta(name="a", numel=3, unit=None, itemsize=4),
             TensorMeta(name="b", numel=2, unit=None, itemsize=4)]
    snapshots = PeerSnapshots(metas, torch.device("cpu"), every=1)
    world = _world()
    layout = build_layout(num_units=2, workers=1, micro_batch_size=1, num_micro_batches=1)
    state = {"a": torch.arange(3.0), "b": torch.ones(2)}
    snapshots.take(world, 0, layout, 5, state)
    state["a"].add_(1.0)  # training goes on; the copy stays
    assert snapshots.holds(world, 5) and not snapshots.holds(world, 6)
    own = snapshots.own[-1].views()
    assert own["a"].tolist() == [0.0, 1.0, 2.0] and own["b"].tolist() == [1.0, 1.0]
    assert not snapshots.swapping and snapshots.ward == []
