"""The keeper rule (tidal_plan.keepers): who keeps whose peer snapshot, and when a shrink's
leavers may go at its boundary."""

from __future__ import annotations

from tidal_plan.keepers import keepers, keepers_stay


def test_each_member_is_kept_by_the_next_in_the_ring():
    assert keepers(("a", "b", "c")) == {"a": "b", "b": "c", "c": "a"}
    assert keepers(("a", "b")) == {"a": "b", "b": "a"}
    assert keepers(("a",)) == {"a": "a"}


def test_leavers_go_at_once_only_where_their_keepers_stay():
    members = ("a", "b", "c", "d")
    assert keepers_stay(members, ("d",)) and keepers_stay(members, ("b", "d"))
    assert keepers_stay(members, ())
    assert not keepers_stay(members, ("c", "d"))  # c's keeper d leaves too
    assert not keepers_stay(members, ("a", "d"))  # d's keeper a (the ring wraps) leaves too
