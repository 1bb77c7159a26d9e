"""Profiling-based predictor: a layout's step from the costs measured online.

The profile (written by ``tidal run --profile``) comes from one run in one layout and predicts
any other layout of the same model on the same machine. What it holds and how it is used:

- per placement unit, the seconds of a forward (F), a fused backward (B), an input-gradient (I)
  and a weight-gradient (W) action and of the unit's share of the post-pipeline work (gradient
  norms, clip, AdamW, zero_grad), each as ``fixed + per_sample x micro-batch size``: copies of
  the units were timed at the run's micro-batch size and at twice it. On a CPU a unit's cost is
  far from proportional to its samples (Python, dispatch and the autograd engine are a fixed
  part), so both parts are needed to predict another micro-batch size;
- a fixed overhead per action kind (one autograd-engine call per backward, whatever its units),
  measured as the difference between a stage's units timed alone and together;
- what the run's own actions took in its plain profiled steps: the ratio of the run's F/B/I/W
  seconds to the calibrated ones (``in_run``: the runtime's bookkeeping, caches), and the
  seconds of posting a SEND and a RECV;
- what a message between pipeline neighbours costs, timed in the profiled world: its latency
  when the receiver already waits (half a ping-pong), its delay when the RECV is posted after
  the SEND (``rendezvous_s``), and the CPU seconds each end costs its process, the transport's
  threads included (``message_work_s``). Two ranks doing nothing else time the delays shorter
  than a running pipeline sees them, so both are stretched by one factor (at least 1) with
  which the dry run of the profiled layout takes as long as its plain profiled steps did;
- the step's two all-reduces (gradient norms and step loss), timed in the profiled world;
- on a CPU host, what time-shared cores cost a step beyond processor sharing (``sharing``):
  ``tidal_agent.sharing`` runs copies of the profiled run at once, two ranks per core, and
  their median step over the dry run of the same copies is the factor, for layouts with
  more ranks than cores.

A stage action costs its kind's overhead plus its units' costs, times ``in_run``; posting
sends and receives is added to the compute action they follow or precede. The lowered schedule
runs through the dry run (``tidal_plan.dryrun``) on a ``Machine`` with the host's cores
(``cores / threads`` ranks compute at full speed at once; more share them), the rendezvous
delay and the message work, which competes for the cores while the transport handles the
message; the step adds the slowest rank's post-pipeline work, both slowed by ``sharing`` in
proportion to the cores that two ranks share (``min(1, ranks / cores - 1)``), and the two
all-reduces, which grow with the ranks taking part (``(W - 1) / (W_profiled - 1)``, the steps
of a ring).

Why those message costs: gloo sends a message only once the receiver has posted its RECV. A
receiver that lags behind its sender (GPipe's forwards, any rank slower than the one before
it) posts after the SEND, and the data then waits for the sender's side to answer, about a
millisecond or more on a small shared host against a few tenths for a receiver that waits
(traced in the runtime's own steps). The transport's threads burn CPU for every message,
nothing where cores are idle but a share of two cores under four ranks. The calibration ran
on every rank of the profiled world at once; its costs are divided by that world's
oversubscription.

Not modelled: other load on the host (the profile should be taken, and the layouts run, on a
quiet one) and the scheduler's time slices, which the processor sharing only averages.

Profiles written before the calibration existed (no ``calibration`` key) still predict, the
old way: unit costs scaled linearly by micro-batch size and by ``ranks x threads / cores``.

Reading a profile and predicting from it stay in one module (a little over 400 lines, an eighth
of them this docstring): the reader fits the message delays and the sharing factor by running
the predictor's own dry run of the profiled layout (``_profiled_dry_run``, ``_post_pipeline``),
so apart they would only export each other's internals.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal_api.layout import Layout
from tidal_plan.actioncosts import Costs
from tidal_plan.costmodel import Prediction
from tidal_plan.dryrun import DryRun, Machine, dry_run, plan_step
from tidal_plan.ir import Action, Kind

ACTION_KINDS = ("forward", "backward", "input_grad", "weight_grad")
_KIND_KEYS = {"forward": "F", "backward": "B", "input_grad": "I", "weight_grad": "W"}


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
class Affine:
    """Seconds of one action on ``m`` samples: ``fixed_s + per_sample_s * m``, never below 0."""

    fixed_s: float
    per_sample_s: float

    def at(self, m: int) -> float:
        return max(0.0, self.fixed_s + self.per_sample_s * m)


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """The measurements that predict other layouts; see the module docstring."""

    units: tuple[Mapping[str, Affine], ...]  # per unit: ACTION_KINDS and "post"
    action_overhead: Mapping[str, float]  # per ACTION_KINDS and "post"
    world_size: int  # ranks that calibrated at once
    in_run: float = 1.0
    send_s: Mapping[str, float] = field(default_factory=dict)  # "F"/"B": posting, seconds
    recv_s: Mapping[str, float] = field(default_factory=dict)
    collectives_s: float = 0.0

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.in_run <= 0:
            raise ProfileError(
                f"calibration world_size ({self.world_size}) and in_run ({self.in_run}) must be "
                "positive: write the profile again with tidal run --profile"
            )

    def stage(self, kind: str, units: range, m: int) -> float:
        """Seconds of one ``kind`` action of a stage of ``units`` on ``m`` samples."""
        return self.action_overhead[kind] + sum(self.units[u][kind].at(m) for u in units)


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    units: tuple[UnitCost, ...]  # by placement unit
    micro_batch_size: int
    seq_tokens: int  # tokens per sample the profile ran with
    p2p_seconds: float
    optimizer_s_per_byte: float
    cores: int
    threads: int
    calibration: Calibration | None = None
    rendezvous_s: float = 0.0  # a message's delay when its RECV is posted after its SEND
    message_work_s: float = 0.0  # CPU seconds one end of a message costs its process
    sharing: float = 1.0  # a step on cores shared by two ranks each, over processor sharing
    checkpointing: bool = False  # the profiled layout's activation checkpointing

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        try:
            units = data["units"]
            costs = tuple(
                UnitCost(**{k: units[str(u)][k] for k in UnitCost.__slots__})
                for u in range(len(units))
            )
            profile = cls(
                units=costs,
                micro_batch_size=data["micro_batch_size"],
                seq_tokens=data.get("seq_tokens", 0),
                p2p_seconds=data.get("message_latency_s", data["p2p"]["seconds"]),
                optimizer_s_per_byte=data.get("optimizer_s_per_param_byte", 0.0),
                cores=data.get("cores", 0),
                threads=data.get("threads", 1),
                rendezvous_s=data.get("rendezvous_s", 0.0),
                message_work_s=data.get("message_work_s", 0.0),
                checkpointing=data.get("layout", {}).get("activation_checkpointing", False),
            )
            if "calibration" not in data:
                return profile
            calibration = _calibration(data, len(units))
        except KeyError as err:
            raise ProfileError(f"profile lacks {err}: write it with tidal run --profile") from None
        # The posting of a SEND and a RECV counts on the compute beside it already.
        posting = sum(calibration.send_s.values()) + sum(calibration.recv_s.values())
        profile = dataclasses.replace(
            profile, calibration=calibration,
            message_work_s=max(0.0, profile.message_work_s - posting / 4),
        )
        return _shared(_in_pipeline(profile, data), data)


def _in_pipeline(profile: Profile, data: dict[str, Any], most: float = 50.0) -> Profile:
    """The profile with its message delays as long as the profiled pipeline saw them.

    The delays were timed between two ranks doing nothing else; in the running pipeline the
    threads that must wake up for a message compete with compute, and wait longer. One factor
    (at least 1, at most ``most``) stretches both delays so that the dry run of the profiled
    layout takes as long as its plain profiled steps' pipeline did (the slowest rank's median).
    """
    parts = data.get("step_parts") or {}
    if "layout" not in data or not parts:
        return profile
    layout = Layout(**data["layout"])
    if layout.pp == 1:
        return profile
    measured = max(part["pipeline_s"] for part in parts.values())

    def stretched(factor: float) -> Profile:
        return dataclasses.replace(profile, p2p_seconds=factor * profile.p2p_seconds,
                                   rendezvous_s=factor * profile.rendezvous_s)

    def makespan(factor: float) -> float:
        return _profiled_dry_run(stretched(factor), layout).makespan

    low, high = 1.0, most
    if makespan(low) >= measured:
        return profile
    if makespan(high) <= measured:
        return stretched(high)
    for _ in range(30):  # bisection: the makespan grows with the delays
        mid = (low + high) / 2
        low, high = (mid, high) if makespan(mid) < measured else (low, mid)
    return stretched((low + high) / 2)


def _shared(profile: Profile, data: dict[str, Any], most: float = 4.0) -> Profile:
    """The profile with its ``sharing``: the probe's step over its dry run, in [1, ``most``].

    The probe ran ``copies`` copies of the profiled layout at once; they share the cores as
    that many data-parallel replicas would, each with its own all-reduces.
    """
    probe = data.get("sharing") or {}
    if (not probe.get("step_s") or "layout" not in data or profile.calibration is None
            or not profile.cores):  # without the cores, nothing tells shared from not
        return profile
    layout = Layout(**data["layout"])
    copies = dataclasses.replace(layout, dp=layout.dp * probe["copies"])
    sim = _profiled_dry_run(profile, copies)
    predicted = sim.makespan + _post_pipeline(profile, copies) + profile.calibration.collectives_s
    factor = min(most, max(1.0, probe["step_s"] / predicted))
    return dataclasses.replace(profile, sharing=factor)


def _calibration(data: dict[str, Any], num_units: int) -> Calibration:
    raw = data["calibration"]
    units = tuple(
        {kind: Affine(**costs) for kind, costs in raw["units"][str(u)].items()}
        for u in range(num_units)
    )
    actions = data.get("actions_s", {})
    calibration = Calibration(
        units=units,
        action_overhead=raw["action_overhead_s"],
        world_size=raw["world_size"],
        send_s={p: actions.get(f"SEND_{p}", 0.0) for p in "FB"},
        recv_s={p: actions.get(f"RECV_{p}", 0.0) for p in "FB"},
        collectives_s=data.get("collectives_s", 0.0),
    )
    if "layout" not in data or not actions:
        return calibration
    # In-run factor: the run's own action seconds against the calibrated ones, in the
    # profiled layout (median action of each kind against the median stage's).
    layout = Layout(**data["layout"])
    m = layout.micro_batch_size
    real = calibrated = 0.0
    for kind, key in _KIND_KEYS.items():
        if key in actions:
            stages = sorted(calibration.stage(kind, layout.stage_units(s), m)
                            for s in range(layout.num_stages))
            real += actions[key]
            calibrated += stages[len(stages) // 2]
    if not real or not calibrated:
        return calibration
    return Calibration(**{k: getattr(calibration, k) for k in Calibration.__slots__
                          if k != "in_run"}, in_run=real / calibrated)


def load_profile(path: str | Path) -> Profile:
    """The profile that ``tidal run --profile`` wrote to ``path``."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise ProfileError(f"{path}: {err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    not_one = f"{path} is not a profile: write one with tidal run --profile"
    if not isinstance(data, dict):
        raise ProfileError(not_one)
    try:
        return Profile.from_dict(data)
    except ProfileError as err:
        raise ProfileError(f"{path}: {err}") from None
    except (KeyError, TypeError, AttributeError, ValueError):  # a JSON object of other fields
        raise ProfileError(not_one) from None


def _check_units(profile: Profile, layout: Layout) -> None:
    if layout.num_units != len(profile.units):
        raise ProfileError(
            f"the profile has {len(profile.units)} units; the layout {layout.num_units}"
        )
    if layout.activation_checkpointing != profile.checkpointing:
        raise ProfileError(
            f"the profile was measured {_with(profile.checkpointing)} activation checkpointing; "
            f"it cannot price {layout.describe()}, {_with(layout.activation_checkpointing)}"
        )


def _with(checkpointing: bool) -> str:
    return "with" if checkpointing else "without"


def _cores(profile: Profile) -> float:
    """Ranks that can compute at once without slowing each other; infinite if unknown."""
    return profile.cores / profile.threads if profile.cores else float("inf")


def _contention(profile: Profile, layout: Layout) -> float:
    if not profile.cores:
        return 1.0
    return max(1.0, layout.world_size * profile.threads / profile.cores)


def _calibrated_costs(
    profile: Profile, layout: Layout, lowered: Mapping[int, Sequence[Action]]
) -> Costs:
    cal = profile.calibration
    assert cal is not None
    m, last = layout.micro_batch_size, layout.num_stages - 1
    # The calibration ran with the profiled world's ranks all busy at once.
    scale = cal.in_run / max(1.0, cal.world_size / _cores(profile))
    split_stages = {a.stage for actions in lowered.values() for a in actions if a.kind is Kind.I}
    forward, input_grad, weight_grad = [], [], []
    for s in range(layout.num_stages):
        units = layout.stage_units(s)

        def cost(kind: str, units=units) -> float:
            return scale * cal.stage(kind, units, m)

        def remote(other: int, s=s) -> bool:
            return layout.stage_rank(other) != layout.stage_rank(s)

        f = cost("forward")
        f += cal.recv_s["F"] if s > 0 and remote(s - 1) else 0.0
        f += cal.send_s["F"] if s < last and remote(s + 1) else 0.0
        b_comm = (cal.recv_s["B"] if s < last and remote(s + 1) else 0.0) + (
            cal.send_s["B"] if s > 0 and remote(s - 1) else 0.0)
        if s not in split_stages:
            i, w = cost("backward") + b_comm, 0.0
        elif s == 0:  # no input gradient: I does nothing and W is the whole backward
            i, w = b_comm, cost("backward")
        else:
            i, w = cost("input_grad") + b_comm, cost("weight_grad")
        forward.append(f)
        input_grad.append(i)
        weight_grad.append(w)
    ratio = m / profile.micro_batch_size
    return Costs(
        forward=tuple(forward),
        input_grad=tuple(input_grad),
        weight_grad=tuple(weight_grad),
        comm=profile.p2p_seconds,  # wake-ups more than bytes: the same for any size
        activation_bytes=tuple(
            ratio * sum(profile.units[u].activation_bytes for u in layout.stage_units(s))
            for s in range(layout.num_stages)
        ),
    )


def _linear_costs(profile: Profile, layout: Layout) -> Costs:
    """The pre-calibration model: unit costs scaled by micro-batch size and oversubscription."""
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


def _machine(profile: Profile, layout: Layout) -> Machine:
    return Machine(cores=_cores(profile), replicas=layout.dp, rendezvous=profile.rendezvous_s,
                   message_work=profile.message_work_s)


def _sharing(profile: Profile, layout: Layout) -> float:
    """How much slower than processor sharing ``layout`` steps: ``profile.sharing`` where
    every core is shared by two of its ranks, none where each has a core, linear between."""
    shared = min(1.0, max(0.0, layout.world_size / _cores(profile) - 1.0))
    return 1.0 + (profile.sharing - 1.0) * shared


def _profiled_dry_run(profile: Profile, layout: Layout) -> DryRun:
    """The dry run of ``layout``, its ranks sharing the machine's cores."""
    lowered = plan_step(layout)
    costs = _calibrated_costs(profile, layout, lowered)
    return dry_run(layout, lowered, costs, _machine(profile, layout)).raise_on_deadlock()


def profiled_costs(profile: Profile, layout: Layout) -> Costs:
    """Per-stage dry-run costs of ``layout`` from the profile (work, before core sharing)."""
    _check_units(profile, layout)
    if profile.calibration is None:
        return _linear_costs(profile, layout)
    return _calibrated_costs(profile, layout, plan_step(layout))


def predict_profiled(profile: Profile, layout: Layout, seq_len: int) -> Prediction:
    """Step time and per-rank peak memory of ``layout`` from measured costs."""
    _check_units(profile, layout)
    rank_params = [
        sum(profile.units[u].param_bytes for s in layout.rank_stages(r) for u in layout.stage_units(s))
        for r in range(layout.pp)
    ]
    cal = profile.calibration
    if cal is None:
        sim = dry_run(layout, plan_step(layout), _linear_costs(profile, layout))
        sim.raise_on_deadlock()
        post = profile.optimizer_s_per_byte * max(rank_params) * _contention(profile, layout)
        collectives = 0.0
        pipeline = sim.makespan
    else:
        sim = _profiled_dry_run(profile, layout)
        sharing = _sharing(profile, layout)
        pipeline = sim.makespan * sharing
        post = _post_pipeline(profile, layout) * sharing
        collectives = _collectives(profile, layout)
    step = pipeline + post + collectives
    tokens = layout.dp * layout.num_micro_batches * layout.micro_batch_size * seq_len
    # State: parameters, gradients and two AdamW moments, all fp32 on this runner.
    peak = tuple(4 * p + a for p, a in zip(rank_params, sim.peak_memory, strict=True))
    return Prediction(
        step_seconds=step,
        tokens_per_second=tokens / step,
        pipeline_seconds=pipeline,
        optimizer_seconds=post,
        allreduce_seconds=collectives,
        bubble_fraction=sim.bubble_fraction,
        peak_memory_bytes=peak,
        fits=True,
    )


def _post_pipeline(profile: Profile, layout: Layout) -> float:
    """Clip and AdamW after the pipeline: every rank at once, sharing the cores."""
    cal = profile.calibration
    assert cal is not None
    scale = 1.0 / max(1.0, cal.world_size / _cores(profile))
    # The post-pipeline work depends on the parameters, not on the micro-batch size.
    m = profile.micro_batch_size
    per_rank = [
        scale * (cal.action_overhead["post"] + sum(
            cal.units[u]["post"].at(m) for s in layout.rank_stages(r) for u in layout.stage_units(s)
        ))
        for r in range(layout.pp)
    ]
    return max(max(per_rank), layout.dp * sum(per_rank) / _cores(profile))


def _collectives(profile: Profile, layout: Layout) -> float:
    cal = profile.calibration
    assert cal is not None
    if cal.world_size == 1:
        return cal.collectives_s
    return cal.collectives_s * (layout.world_size - 1) / (cal.world_size - 1)
