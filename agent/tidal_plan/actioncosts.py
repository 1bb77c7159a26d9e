"""What each action of a pipeline step costs: the input of the dry run, the estimate and the bounds.

``Costs`` gives a compute action its seconds (a number for every stage, or one per stage) and a
forward the activation bytes it keeps until its backward frees them; a message costs ``comm``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tidal_plan.ir import Action, Kind

PerStage = float | tuple[float, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Costs:
    """Per-action costs: a number for every stage, or a tuple with one entry per stage.

    A full backward B costs ``input_grad + weight_grad``. ``comm`` is the latency of one
    message; ``activation_bytes`` what one micro-batch's forward keeps alive on a stage until
    its B (or W) frees it; ``held_for_weight_bytes`` what a split backward's I keeps for its W
    (the gradients at the stage's matmul outputs); ``retained_bytes`` what a micro-batch's
    backward leaves on its stage until the step's end (the runtime's sent messages).
    """

    forward: PerStage = 1.0
    input_grad: PerStage = 1.0
    weight_grad: PerStage = 1.0
    comm: float = 0.0
    activation_bytes: PerStage = 1.0
    held_for_weight_bytes: PerStage = 0.0
    retained_bytes: PerStage = 0.0

    def __post_init__(self) -> None:
        for name in _PER_STAGE:
            value = getattr(self, name)
            values = tuple(value) if isinstance(value, Sequence) else (value,)
            if not values or any(v < 0 for v in values):
                raise ValueError(f"Costs.{name} must be non-negative, one number or per stage")
            if isinstance(value, Sequence):
                object.__setattr__(self, name, tuple(map(float, values)))
        if self.comm < 0:
            raise ValueError(f"Costs.comm ({self.comm}) must be non-negative")

    def check(self, num_stages: int) -> None:
        """Raise ``ValueError`` unless every per-stage tuple has ``num_stages`` entries."""
        for name in _PER_STAGE:
            value = getattr(self, name)
            if isinstance(value, tuple) and len(value) != num_stages:
                raise ValueError(
                    f"Costs.{name} has {len(value)} entries but the layout has {num_stages} "
                    f"stages: give one per stage or a single number"
                )

    def time(self, action: Action) -> float:
        """Compute time of ``action``; communication actions take none of a rank's time."""
        stage = action.stage
        if action.kind is Kind.F:
            return _at(self.forward, stage)
        if action.kind is Kind.I:
            return _at(self.input_grad, stage)
        if action.kind is Kind.W:
            return _at(self.weight_grad, stage)
        if action.kind is Kind.B:
            return _at(self.input_grad, stage) + _at(self.weight_grad, stage)
        return 0.0

    def activation(self, stage: int) -> float:
        return _at(self.activation_bytes, stage)

    def memory_change(self, kind: Kind, stage: int) -> float:
        """What ``kind`` on ``stage`` adds to its rank's memory (negative: frees): F keeps its
        activations, I what W needs, B and W free them and leave what stays to the step's end.
        One expression per kind, so that every simulation adds the same numbers to the bit."""
        if kind is Kind.F:
            return _at(self.activation_bytes, stage)
        if kind is Kind.I:
            return _at(self.held_for_weight_bytes, stage)
        if kind is Kind.B:
            return _at(self.retained_bytes, stage) - _at(self.activation_bytes, stage)
        if kind is Kind.W:
            return (_at(self.retained_bytes, stage) - _at(self.activation_bytes, stage)
                    - _at(self.held_for_weight_bytes, stage))
        return 0.0


_PER_STAGE = ("forward", "input_grad", "weight_grad", "activation_bytes",
              "held_for_weight_bytes", "retained_bytes")


def _at(value: PerStage, stage: int) -> float:
    return value[stage] if isinstance(value, tuple) else float(value)


def per_stage(value: PerStage, stages: int) -> list[float]:
    """``value`` as one number per stage, for ``stages`` stages."""
    return list(value) if isinstance(value, tuple) else [float(value)] * stages
