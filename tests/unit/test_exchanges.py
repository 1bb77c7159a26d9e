"""Posting under NCCL's rules: every built-in schedule's plan runs, the old one-by-one posting
of 1F1B does not, and the check sees both a deadlock and messages met out of order."""

import pytest
from hypothesis import given, settings

from tests.unit.test_schedules import LAY_2x2, all_layouts, layouts, two_ranks
from tidal_api.layout import Layout
from tidal_plan.dryrun import dry_run, plan_step
from tidal_plan.exchanges import exchange_plan, nccl_deadlock, nccl_order
from tidal_plan.ir import Action, Kind, format_actions
from tidal_plan.lowering import fifo_consistent


def _plans(lay: Layout, lowered, grouped: bool = True):
    return {r: exchange_plan(a, grouped=grouped) for r, a in lowered.items()}


@pytest.mark.parametrize("lay", [lay for lay in all_layouts() if lay.pp > 1],
                         ids=Layout.describe)
def test_every_built_in_schedule_runs_under_nccl_rules(lay: Layout) -> None:
    lowered = nccl_order(lay, plan_step(lay))
    assert fifo_consistent(lowered)
    assert not dry_run(lay, lowered).deadlock
    assert nccl_deadlock(lay, _plans(lay, lowered)) is None


@settings(max_examples=80, deadline=None)
@given(lay=layouts())
def test_ordering_only_moves_receives_earlier(lay: Layout) -> None:
    lowered = plan_step(lay)
    ordered = nccl_order(lay, lowered)
    for rank, actions in lowered.items():
        moved = ordered[rank]
        assert sorted(moved) == sorted(actions)
        receives = {Kind.RECV_F, Kind.RECV_B}
        assert [a for a in moved if a.kind not in receives] == [
            a for a in actions if a.kind not in receives]
        for action in actions:
            if action.kind in receives:
                assert moved.index(action) <= actions.index(action) + sum(
                    1 for a in actions[:actions.index(action)] if a.kind in receives)
    assert nccl_deadlock(lay, _plans(lay, ordered)) is None


def test_one_by_one_posting_of_1f1b_deadlocks() -> None:
    # The lowering's order, each action posted alone: in the steady state both ranks post a
    # send before the receive that would meet the other's.
    stuck = nccl_deadlock(LAY_2x2, _plans(LAY_2x2, plan_step(LAY_2x2), grouped=False))
    assert stuck is not None and stuck.startswith("deadlock under NCCL's rules")
    assert "0SEND_F1 with rank 1" in stuck and "1SEND_B0 with rank 0" in stuck
    # Each run of sends and receives as one group: the two ends' groups meet.
    assert nccl_deadlock(LAY_2x2, _plans(LAY_2x2, plan_step(LAY_2x2))) is None


def test_groups_are_runs_of_communication() -> None:
    actions = [Action.parse(a) for a in "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0".split()]
    plan = exchange_plan(actions)
    assert [format_actions(list(s)) if not isinstance(s, Action) else str(s) for s in plan] == [
        "0F0", "0SEND_F0", "0F1", "0SEND_F1 0RECV_B0", "0B0"]


def test_messages_met_out_of_order_are_reported() -> None:
    crossed = two_ranks(
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F1 1RECV_F0 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
    )
    stuck = nccl_deadlock(LAY_2x2, _plans(LAY_2x2, crossed))
    assert stuck is not None and "out of order" in stuck
