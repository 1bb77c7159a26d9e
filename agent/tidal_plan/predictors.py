"""The two predictors the search prices layouts with, behind one protocol.

``ModeledPredictor`` counts FLOPs and bytes on a device description (``tidal_plan.costmodel``);
``ProfiledPredictor`` runs the costs measured online through the dry run
(``tidal_plan.profiled``). The search needs of either the per-unit costs its partitions
balance, a prediction, and a lower bound to order its candidates by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tidal_api.layout import Layout
from tidal_plan.bounds import estimate_lower_bound
from tidal_plan.costmodel import (
    NO_SHARDING,
    Prediction,
    Sharding,
    UnitCosts,
    model_unit_costs,
    predict,
    step_model,
)
from tidal_plan.devices import Device
from tidal_plan.modelshape import ModelShape
from tidal_plan.profiled import Profile, predict_profiled


class Predictor(Protocol):
    """What the search needs of a predictor."""

    name: str  # "profiled" or "modeled"
    num_units: int
    gpus_per_rank: int

    def units(self, micro_batch_size: int, dp: int, checkpointing: bool = False
              ) -> Sequence[UnitCosts]:
        """Per placement unit: seconds and bytes of one micro-batch on one GPU."""
        ...

    def check(self, dp: int) -> str | None:
        """Why ``dp`` replicas break a constraint of the model's sharding, or None."""
        ...

    def predict(self, layout: Layout) -> Prediction: ...

    def bound(self, layout: Layout) -> tuple[float, float]:
        """Lower bounds on ``predict``'s step seconds and on its fullest GPU's peak bytes."""
        ...


@dataclass(frozen=True)
class ModeledPredictor:
    """The modeling-based predictor: FLOPs and bytes over a device description."""

    shape: ModelShape
    device: Device
    sharding: Sharding = NO_SHARDING
    name: str = "modeled"

    @property
    def num_units(self) -> int:
        return self.shape.num_units

    @property
    def gpus_per_rank(self) -> int:
        return self.sharding.gpus_per_rank

    def units(self, micro_batch_size: int, dp: int, checkpointing: bool = False
              ) -> Sequence[UnitCosts]:
        return model_unit_costs(self.shape, micro_batch_size, self.device, dp, self.sharding,
                                checkpointing)

    def check(self, dp: int) -> str | None:
        try:
            self.sharding.check(self.shape, dp)
        except ValueError as err:
            return str(err)
        return None

    def predict(self, layout: Layout) -> Prediction:
        return predict(self.shape, layout, self.device, self.sharding)

    def bound(self, layout: Layout) -> tuple[float, float]:
        model = step_model(self.shape, layout, self.device, self.sharding)
        step, peak = estimate_lower_bound(layout, model.costs)
        memory = max(state + held for state, held in zip(model.state_bytes, peak, strict=True))
        # The bounds are sums of the very terms the dry run adds, in another order: shave
        # off what rounding could put on top.
        return (step + model.after_pipeline_s) * (1 - 1e-9), memory * (1 - 1e-9)


@dataclass(frozen=True)
class ProfiledPredictor:
    """The profiling-based predictor: the costs measured online, through the dry run."""

    profile: Profile
    seq_len: int
    name: str = "profiled"
    gpus_per_rank: int = 1

    @property
    def num_units(self) -> int:
        return len(self.profile.units)

    def units(self, micro_batch_size: int, dp: int, checkpointing: bool = False
              ) -> Sequence[UnitCosts]:
        # The search offers only the profile's own checkpointing (job_space).
        scale = micro_batch_size / self.profile.micro_batch_size
        return [
            UnitCosts(
                forward_s=u.forward_s * scale,
                input_grad_s=u.input_grad_s * scale,
                weight_grad_s=u.weight_grad_s * scale,
                activation_bytes=u.activation_bytes * scale,
                state_bytes=4 * u.param_bytes,  # fp32 parameters, gradients, two moments
                allreduce_bytes=0.0,
            )
            for u in self.profile.units
        ]

    def check(self, dp: int) -> str | None:
        return None

    def predict(self, layout: Layout) -> Prediction:
        return predict_profiled(self.profile, layout, self.seq_len)

    def bound(self, layout: Layout) -> tuple[float, float]:
        # The profiled costs settle core sharing over up to a dozen dry runs: a bound from them
        # would cost what the prediction costs. No bound: every candidate is priced (the
        # profiled models are the small ones this machine runs).
        return 0.0, 0.0


DRIFT_MARGIN = 0.25  # measured over predicted step seconds beyond 1 +- this: drifting
DRIFT_STEPS = 5  # consecutive drifting steps that call for a new profile


class Drift:
    """Whether measured step times have left the profiled prediction for good: ``steps``
    consecutive steps more than ``margin`` away from it (either side) call for a new
    profile. Disarmed until the next prediction (``expect``), so that one drift asks once."""

    def __init__(self, *, margin: float = DRIFT_MARGIN, steps: int = DRIFT_STEPS) -> None:
        self.margin, self.steps = margin, steps
        self.predicted: float | None = None
        self._run = 0

    def expect(self, predicted_s: float | None) -> None:
        self.predicted, self._run = predicted_s, 0

    def observe(self, seconds: float) -> bool:
        if self.predicted is None:
            return False
        drifting = abs(seconds / self.predicted - 1) > self.margin
        self._run = self._run + 1 if drifting else 0
        if self._run < self.steps:
            return False
        self.predicted = None
        return True

