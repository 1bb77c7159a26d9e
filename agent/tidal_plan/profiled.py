"""Profiling-based predictor: a layout's step from the costs measured online.

The profile (written by ``tidal run --profile``) holds, per placement unit, the measured
forward, input-gradient and weight-gradient seconds and the bytes it keeps for its backward,
plus the one-way P2P time of an activation and the optimizer's seconds per parameter byte.
A candidate layout sums its stages' unit costs, scales them linearly to its micro-batch size,
and runs its lowered schedule through the dry-run simulator.

On a machine where ranks share cores (the CPU runner), compute slows by the oversubscription
``ranks x threads / cores``; the profile records the cores it was taken on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal_plan.costmodel import Prediction
from tidal_plan.layout import Layout
from tidal_plan.simulate import Costs, plan_step, simulate


class ProfileError(ValueError):
    """A profile that cannot be used; the message says why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitCost:
    forward_s: float
    input_grad_s: float
    weight_grad_s: float
    activation_bytes: int
    param_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    units: tuple[UnitCost, ...]  # by placement unit
    micro_batch_size: int
    seq_tokens: int  # tokens per sample the profile ran with
    p2p_seconds: float
    optimizer_s_per_byte: float
    cores: int
    threads: int

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        try:
            units = data["units"]
            costs = tuple(
                UnitCost(**{k: units[str(u)][k] for k in UnitCost.__slots__})
                for u in range(len(units))
            )
            return cls(
                units=costs,
                micro_batch_size=data["micro_batch_size"],
                seq_tokens=data.get("seq_tokens", 0),
                p2p_seconds=data["p2p"]["seconds"],
                optimizer_s_per_byte=data.get("optimizer_s_per_param_byte", 0.0),
                cores=data.get("cores", 0),
                threads=data.get("threads", 1),
            )
        except KeyError as err:
            raise ProfileError(f"profile lacks {err}: write it with tidal run --profile") from None


def load_profile(path: str | Path) -> Profile:
    try:
        return Profile.from_dict(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError) as err:
        raise ProfileError(f"{path}: {err}") from None


def _contention(profile: Profile, layout: Layout) -> float:
    if not profile.cores:
        return 1.0
    return max(1.0, layout.world_size * profile.threads / profile.cores)


def profiled_costs(profile: Profile, layout: Layout) -> Costs:
    """Per-stage simulator costs of ``layout`` from the profile."""
    if layout.num_units != len(profile.units):
        raise ProfileError(
            f"the profile has {len(profile.units)} units; the layout {layout.num_units}"
        )
    scale = layout.micro_batch_size / profile.micro_batch_size
    slow = scale * _contention(profile, layout)

    def per_stage(field: str, factor: float) -> tuple[float, ...]:
        return tuple(
            factor * sum(getattr(profile.units[u], field) for u in layout.stage_units(s))
            for s in range(layout.num_stages)
        )

    return Costs(
        forward=per_stage("forward_s", slow),
        input_grad=per_stage("input_grad_s", slow),
        weight_grad=per_stage("weight_grad_s", slow),
        comm=profile.p2p_seconds * scale,
        activation_bytes=per_stage("activation_bytes", scale),
    )


def predict_profiled(profile: Profile, layout: Layout, seq_len: int) -> Prediction:
    """Step time and per-rank peak memory of ``layout`` from measured costs."""
    sim = simulate(layout, plan_step(layout), profiled_costs(profile, layout)).raise_on_deadlock()
    rank_params = [
        sum(profile.units[u].param_bytes for s in layout.rank_stages(r) for u in layout.stage_units(s))
        for r in range(layout.pp)
    ]
    optimizer = profile.optimizer_s_per_byte * max(rank_params) * _contention(profile, layout)
    step = sim.makespan + optimizer
    tokens = layout.dp * layout.num_micro_batches * layout.micro_batch_size * seq_len
    # State: parameters, gradients and two AdamW moments, all fp32 on this runner.
    peak = tuple(4 * p + a for p, a in zip(rank_params, sim.peak_memory, strict=True))
    return Prediction(
        step_seconds=step,
        tokens_per_second=tokens / step,
        pipeline_seconds=sim.makespan,
        optimizer_seconds=optimizer,
        allreduce_seconds=0.0,
        bubble_fraction=sim.bubble_fraction,
        peak_memory_bytes=peak,
        fits=True,
    )
