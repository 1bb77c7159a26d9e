"""Straggler detection and the speed-weighted re-partition (tidal_plan.stragglers)."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal_plan.layout import build_layout
from tidal_plan.partition import balanced_partition
from tidal_plan.stragglers import (StragglerDetector, drop_beats_keeping, fill_shares,
                                   rank_seconds, replan_layout, replan_partition, step_seconds)


def _feed(detector, first, times, steps):
    changes = []
    for step in range(first, first + steps):
        changes += detector.observe(step, dict(zip("abc", times, strict=False)))
    return changes


def test_a_rank_slower_for_the_window_is_flagged_once_and_cleared_once():
    d = StragglerDetector(factor=1.25, steps=4)
    assert _feed(d, 0, [1.0, 1.02, 0.99], 10) == []
    changes = _feed(d, 10, [1.0, 2.0, 1.0], 6)
    assert [(c.member, c.step, c.flagged) for c in changes] == [("b", 13, True)]
    assert changes[0].slowdown == pytest.approx(2.0)
    assert d.flagged == {"b"}
    assert d.speed("b") == pytest.approx(0.5) and d.speed("a") == pytest.approx(1.0)
    assert d.speed("c") == pytest.approx(1.0)
    changes = _feed(d, 16, [1.0, 1.01, 1.0], 6)
    assert [(c.member, c.step, c.flagged) for c in changes] == [("b", 19, False)]
    assert d.flagged == frozenset()


def test_a_slow_step_now_and_then_is_no_straggler():
    d = StragglerDetector(factor=1.25, steps=3)
    for step in range(30):
        slow = 1.6 if step % 3 == 0 else 1.0  # two slow steps never follow each other
        assert d.observe(step, {"a": 1.0, "b": slow}) == []
    assert d.flagged == frozenset()


def test_members_without_layers_are_not_judged():
    d = StragglerDetector(factor=1.2, steps=1)
    assert [c.member for c in d.observe(0, {"a": None, "b": 1.0, "c": 3.0})] == ["c"]
    assert "a" not in d.slowdowns and d.speed("a") == 1.0
    assert d.observe(1, {"a": None, "b": None, "c": 3.0}) == []  # alone: nobody to compare


def test_a_flag_follows_the_member_not_its_rank():
    d = StragglerDetector(factor=1.25, steps=2)
    _feed(d, 0, [1.0, 2.0], 2)
    assert d.flagged == {"b"}
    assert d.observe(2, {"b": 2.0, "c": 1.0, "a": 1.0}) == []  # renumbered: still flagged


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="exceed 1"):
        StragglerDetector(factor=1.0)
    with pytest.raises(ValueError, match="at least one step"):
        StragglerDetector(steps=0)


def test_speeds_move_units_off_the_slow_rank():
    lay = build_layout(num_units=18, workers=2, micro_batch_size=1, num_micro_batches=8)
    assert lay.partition == (9, 9)
    seconds = [0.1] + [1.0] * 16 + [0.5]
    plan = replan_partition(lay, seconds, [1.0, 0.5])
    assert plan.partition == (12, 6)  # 11.1 s against 5.5 / 0.5 = 11 s
    assert plan.was_s == pytest.approx(2 * 8.5)
    assert plan.gain == pytest.approx(17 / 11.1 - 1)
    same = replan_partition(lay, seconds, [1.0, 1.0])
    assert same.partition == (9, 9) and same.gain == pytest.approx(0)


def test_every_stage_keeps_a_decoder_layer():
    lay = build_layout(num_units=10, workers=2, micro_batch_size=1, num_micro_batches=8)
    seconds = [0.1] + [1.0] * 8 + [0.5]
    assert replan_partition(lay, seconds, [1.0, 0.05]).partition == (9, 1)  # the head alone
    assert replan_partition(lay, seconds, [1.0, 0.05], range(1, 9)).partition == (8, 2)


def test_interleaved_stages_take_their_ranks_speed():
    lay = build_layout(num_units=16, workers=2, micro_batch_size=1, num_micro_batches=4,
                       schedule="interleaved", virtual_stages=2)
    plan = replan_partition(lay, [1.0] * 16, [1.0, 0.5])
    assert plan.partition == (5, 2, 6, 3)  # stages 5, 4, 6, 6 s; (8,8,...) had 8, 16
    assert rank_seconds(lay, plan.partition, [1.0] * 16, [1.0, 0.5]) == [11.0, 10.0]
    assert plan.was_s == 16.0


@settings(max_examples=80, deadline=None)
@given(seconds=st.lists(st.floats(0.01, 10), min_size=3, max_size=24),
       speeds=st.lists(st.floats(0.2, 1.0), min_size=2, max_size=3))
def test_the_weighted_partition_is_the_best_contiguous_one(seconds, speeds):
    stages = len(speeds)
    if stages > len(seconds):
        return
    found = balanced_partition(seconds, stages, speeds=speeds)

    def slowest(partition):
        start, out = 0, 0.0
        for count, speed in zip(partition, speeds, strict=True):
            out = max(out, sum(seconds[start:start + count]) / speed)
            start += count
        return out

    n = len(seconds)
    if stages == 2:
        every = [(a, n - a) for a in range(1, n)]
    else:
        every = [(a, b, n - a - b) for a in range(1, n) for b in range(1, n - a)]
    assert sum(found) == n and min(found) >= 1
    assert slowest(found) <= min(slowest(p) for p in every) * (1 + 1e-5)


def test_dropping_a_very_slow_rank_beats_keeping_it():
    lay = build_layout(num_units=18, workers=3, micro_batch_size=1, num_micro_batches=4)
    seconds = [1.0] * 18
    assert drop_beats_keeping(lay, seconds, [1.0, 1.0, 0.1], slow=2, min_gain=0.05)
    assert not drop_beats_keeping(lay, seconds, [1.0, 1.0, 0.8], slow=2, min_gain=0.05)


def test_drift_asks_for_a_profile_once_after_the_steps():
    from tidal_plan.predictors import Drift

    drift = Drift(margin=0.25, steps=3)
    assert not any(drift.observe(1.0) for _ in range(5))  # nothing predicted yet
    drift.expect(1.0)
    assert [drift.observe(s) for s in (1.2, 1.3, 1.3, 0.9, 1.4, 0.7, 1.5)] == [
        False, False, False, False, False, False, True]
    assert not drift.observe(1.5)  # disarmed until the next prediction


def test_a_slow_replica_gets_fewer_micro_batches():
    lay = build_layout(num_units=10, workers=2, dp=2, micro_batch_size=1, num_micro_batches=8)
    seconds = [0.1] + [1.0] * 8 + [0.5]
    assert fill_shares(lay, seconds, [1.0, 0.2]) == (7, 1)  # 7 x 8.6 s against 1 x 43 s
    assert fill_shares(lay, seconds, [1.0, 0.2], unit=2) == (6, 2)
    assert fill_shares(lay, seconds, [1.0, 1.0]) == (4, 4)
    plan = replan_layout(lay, seconds, [1.0, 0.2], range(1, 9), share_unit=1)
    assert plan.layout.shares == (7, 1) and plan.layout.partition == (10,)
    assert plan.was_s == pytest.approx(4 * 43) and plan.step_s == pytest.approx(7 * 8.6)
    assert replan_layout(lay, seconds, [1.0, 0.2], share_unit=0).layout == lay  # shares fixed
    back = replan_layout(plan.layout, seconds, [1.0, 1.0], share_unit=1)
    assert back.layout == lay and back.gain == pytest.approx(7 / 4 - 1)


def test_replicas_share_the_partition_and_the_faster_plan_wins():
    """dp 2 x pp 2 with the second replica's last rank at half speed: moving units off pipeline
    rank 1 (for both replicas) beats giving the slow replica fewer micro-batches."""
    lay = build_layout(num_units=10, workers=4, dp=2, micro_batch_size=1, num_micro_batches=16)
    seconds = [0.1] + [1.0] * 8 + [0.5]
    speeds = [1.0, 1.0, 1.0, 0.5]
    assert step_seconds(lay, seconds, speeds) == pytest.approx(9 * 9.0)
    plan = replan_layout(lay, seconds, speeds, range(1, 9), share_unit=2)
    assert plan.layout.partition == (7, 3) and plan.layout.shares == ()
    assert plan.step_s == pytest.approx(9 * 6.1)
    shared = replace(lay, shares=fill_shares(lay, seconds, speeds, unit=2))
    assert shared.shares == (12, 4) and step_seconds(shared, seconds, speeds) > plan.step_s
