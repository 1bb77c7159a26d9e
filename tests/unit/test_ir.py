"""The action IR round-trips through its string form and rejects what is not an action."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidal_plan.ir import Action, Kind, format_actions, parse_actions


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("2F0", Action(2, Kind.F, 0)),
        ("0I3", Action(0, Kind.I, 3)),
        ("1W12", Action(1, Kind.W, 12)),
        ("3B1", Action(3, Kind.B, 1)),
        ("1SEND_F0", Action(1, Kind.SEND_F, 0)),
        ("2RECV_F0", Action(2, Kind.RECV_F, 0)),
        ("1SEND_B3", Action(1, Kind.SEND_B, 3)),
        ("0RECV_B3", Action(0, Kind.RECV_B, 3)),
    ],
)
def test_every_kind_round_trips(text: str, action: Action) -> None:
    assert Action.parse(text) == action
    assert str(action) == text


def test_every_kind_is_covered_above() -> None:
    # Guards the table above: a new kind must get a round-trip case.
    names = {"F", "I", "W", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    assert {kind.value for kind in Kind} == names


@given(
    stage=st.integers(min_value=0, max_value=10_000),
    kind=st.sampled_from(Kind),
    mb=st.integers(min_value=0, max_value=10_000),
)
def test_string_form_round_trips(stage: int, kind: Kind, mb: int) -> None:
    action = Action(stage, kind, mb)
    assert Action.parse(str(action)) == action


@given(st.lists(st.builds(Action, st.integers(0, 99), st.sampled_from(Kind), st.integers(0, 99))))
def test_lists_round_trip(actions: list[Action]) -> None:
    assert parse_actions(format_actions(actions)) == actions


def test_parse_actions_accepts_commas_and_newlines() -> None:
    assert parse_actions(" 0F0,0SEND_F0\n1RECV_F0  1F0 ") == [
        Action(0, Kind.F, 0),
        Action(0, Kind.SEND_F, 0),
        Action(1, Kind.RECV_F, 0),
        Action(1, Kind.F, 0),
    ]


def test_compute_and_comm_kinds() -> None:
    assert {k for k in Kind if k.is_compute} == {Kind.F, Kind.I, Kind.W, Kind.B}
    assert all(k.is_comm for k in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B))


@pytest.mark.parametrize(
    "text", ["", "F0", "2F", "2X0", "2f0", "-1F0", "2F-1", "2SEND0", "2F0x", "2 F 0", "2SEND_F_0"]
)
def test_parse_rejects_non_actions(text: str) -> None:
    with pytest.raises(ValueError, match="not an action"):
        Action.parse(text)
