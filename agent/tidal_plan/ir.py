"""The pipeline IR: actions of one training step on one pipeline rank.

An action is (stage, kind, micro-batch) with a compact string form that round-trips:
``"2F0"`` is the forward of stage 2 on micro-batch 0, ``"1SEND_B3"`` stage 1 sending the input
gradient of micro-batch 3 to stage 0. Compute kinds: F (forward), B (full backward), I (input
gradient only) and W (weight gradient only; B = I + W). Communication kinds name the stage that
owns the action: SEND_F/SEND_B are posted by the producing stage, RECV_F/RECV_B by the
consuming stage.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple


class Kind(str, Enum):
    F = "F"
    I = "I"  # noqa: E741 - the conventional name of the input-gradient action
    W = "W"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return not self.is_compute


_COMPUTE = frozenset({Kind.F, Kind.I, Kind.W, Kind.B})
_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|I|W|B)(\d+)$")


class Action(NamedTuple):
    # A NamedTuple rather than a dataclass: the planner hashes millions of actions, and a
    # tuple's hash and equality run in C.
    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.mb}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(f"not an action: {text!r} (expected e.g. '2F0' or '1SEND_B3')")
        stage, kind, mb = match.groups()
        return cls(int(stage), Kind(kind), int(mb))


def parse_actions(text: str) -> list[Action]:
    """Parse a whitespace- or comma-separated list of actions."""
    return [Action.parse(tok) for tok in re.split(r"[\s,]+", text.strip()) if tok]


def format_actions(actions: list[Action]) -> str:
    return " ".join(str(a) for a in actions)
