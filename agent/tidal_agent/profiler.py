"""Online profiling: what each placement unit costs, measured during real training steps.

During a few steps of the run (no separate profiling run) the runtime hands its stage forwards
and backwards to a ``UnitProfiler``, which records per placement unit:

- forward seconds: the device's time from before the unit's forward to after it;
- input-gradient seconds (I): from the gradient reaching the unit's output (or loss) to it
  reaching the unit's input, marked from tensor hooks on the unit boundaries;
- weight-gradient seconds (W): the stage's W time, shared among its units by parameter count
  (weight gradients are one matmul per weight, so their cost follows the weight sizes);
- activation bytes: what autograd saves for the unit's backward (saved-tensor hooks);
- parameter bytes.

While the unit hooks are on (the first profiled step), a fused backward (B) runs as I then W,
which computes the same bits (tests/integration/test_bitwise.py compares the schedules), so that
I and W are measured apart. In the plain profiled steps (hooks off) it records every action's
time as the runtime runs it, the time its receives waited, and the step's pipeline and
post-pipeline seconds.

Every time is a span between two marks of the device's ``Clock`` (tidal_agent.measure: CUDA
events on a GPU, so kernels are timed rather than their launches), taken during the steps and
read only when the profile is gathered, after the steps: marking never waits for the device.

``build_profile`` joins every rank's part, with what ``tidal_agent.calibrate`` measured beside
the steps, into the profile that ``tidal_plan.profiled`` reads.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from tidal_agent.measure import Clock, Mark, Span
from tidal_agent.model import StageModule, UnitContext
from tidal_api import Layout, ModelSpec
from tidal_plan.ir import Action

# What ``tidal_agent.calibrate`` times per unit and per stage (the action kinds and the
# post-pipeline work): the keys of the profile's calibration.
CALIBRATED = ("forward", "backward", "input_grad", "weight_grad", "post")


@dataclass(slots=True)
class _Trace:
    """Hook marks of one (stage, micro-batch): unit -> when its output gradient arrived."""

    clock: Clock
    units: list[int]
    output_marks: dict[int, Mark] = field(default_factory=dict)
    input_mark: Mark | None = None
    backward: Span | None = None  # the I action's (or a first stage's B)

    # Hooks must return None: a returned value would replace the gradient.
    def mark_output(self, unit: int) -> None:
        if unit not in self.output_marks:
            self.output_marks[unit] = self.clock.mark()

    def mark_input(self) -> None:
        self.input_mark = self.clock.mark()

    def input_grad_seconds(self) -> dict[int, float]:
        """Unit -> its share of the backward: unit u's runs from its output gradient (the
        backward's start for the unit the backward enters first) to the gradient of its input,
        which is the output gradient of unit u - 1, or the stage input's, or the backward's end.
        """
        started, ended = self.backward

        def at(mark: Mark) -> float:  # seconds since the backward's start
            return Clock.seconds(started, mark)

        out = {}
        for i, unit in enumerate(self.units):
            start = max(at(self.output_marks[unit]), 0.0) if unit in self.output_marks else 0.0
            if i > 0 and self.units[i - 1] in self.output_marks:
                end = at(self.output_marks[self.units[i - 1]])
            else:
                end = at(self.input_mark if self.input_mark is not None else ended)
            out[unit] = max(0.0, end - start)
        return out


@dataclass(slots=True)
class _Action:
    """One action of a plain profiled step and the receive waits inside it."""

    kind: str
    span: Span
    waits: list[Span]
    share: float = 1.0  # of the span: a group's posting is shared among its actions


class UnitProfiler:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._forward: dict[int, list[Span]] = defaultdict(list)
        self._backward: list[_Trace] = []
        self._weight: list[tuple[int, Span]] = []  # (stage, the W action's span)
        self.activation_bytes: dict[int, int] = {}
        self.param_bytes: dict[int, int] = {}
        self._optimizer: list[Span] = []  # the rank's AdamW step
        # Plain steps (hooks off): per action, its span minus its receive waits.
        self.hooks = True
        self._actions: list[_Action] = []
        self._steps: list[tuple[Span, Span, list[Span]]] = []  # pipeline, post-pipeline, waits
        self._waits: list[Span] = []
        self._step_waits: list[Span] = []
        self._traces: dict[tuple[int, int], _Trace] = {}
        self._stage_units: dict[int, list[tuple[int, int]]] = {}  # stage -> (unit, params)

    def mark(self) -> Mark:
        return self.clock.mark()

    def forward(self, stage: int, mb: int, module: StageModule, x, ctx: UnitContext):
        """Run ``module`` like ``StageModule.forward``, timing and hooking every unit."""
        trace = _Trace(clock=self.clock, units=[u.index for u in module.ordered_units])
        self._traces[(stage, mb)] = trace
        self._stage_units[stage] = [
            (u.index, sum(p.numel() for p in u.parameters())) for u in module.ordered_units
        ]
        if x is not None and x.requires_grad:
            x.register_hook(lambda g: trace.mark_input())
        h, losses = x, []
        for unit in module.ordered_units:
            saved = [0]

            def pack(t: torch.Tensor, saved=saved) -> torch.Tensor:
                saved[0] += t.numel() * t.element_size()
                return t

            started = self.clock.mark()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                h, loss = module.run_unit(unit, h, ctx)
            self._forward[unit.index].append((started, self.clock.mark()))
            self.activation_bytes[unit.index] = saved[0]
            self.param_bytes[unit.index] = sum(
                p.numel() * p.element_size() for p in unit.parameters()
            )
            for boundary in (h, loss):
                if boundary is not None and boundary.requires_grad:
                    boundary.register_hook(lambda g, u=unit.index: trace.mark_output(u))
            if loss is not None:
                losses.append(loss)
        return h, losses

    def input_grad_done(self, stage: int, mb: int, started: Mark, ended: Mark) -> None:
        """The backward (I) of (stage, mb) ran from ``started`` to ``ended``: attribute it."""
        trace = self._traces.pop((stage, mb))
        trace.backward = (started, ended)
        self._backward.append(trace)

    def weight_grad_done(self, stage: int, started: Mark, ended: Mark) -> None:
        self._weight.append((stage, (started, ended)))

    def waited(self, started: Mark, ended: Mark) -> None:
        """A compute action spent this span waiting for a receive: not its own time."""
        self._waits.append((started, ended))
        self._step_waits.append((started, ended))

    def action_done(self, action: Action, started: Mark, ended: Mark, share: float = 1.0) -> None:
        if not self.hooks:
            self._actions.append(_Action(action.kind.value, (started, ended), self._waits,
                                         share))
        self._waits = []

    def optimizer_done(self, started: Mark, ended: Mark) -> None:
        self._optimizer.append((started, ended))

    def step_done(self, started: Mark, pipelined: Mark, ended: Mark) -> None:
        """The step's pipeline ran from ``started`` to ``pipelined``, the rest to ``ended``."""
        if not self.hooks:
            self._steps.append(((started, pipelined), (pipelined, ended), self._step_waits))
        self._step_waits = []

    @property
    def optimizer_s(self) -> list[float]:
        return [Clock.seconds(*span) for span in self._optimizer]

    @property
    def step_parts(self) -> list[dict[str, float]]:
        """Per plain step: its pipeline, post-pipeline and receive-wait seconds."""
        return [{"pipeline_s": Clock.seconds(*pipeline), "post_s": Clock.seconds(*post),
                 "wait_s": _total(waits)} for pipeline, post, waits in self._steps]

    def actions(self) -> dict[str, float]:
        """Median seconds per action kind in the plain profiled steps, waits excluded."""
        times: dict[str, list[float]] = defaultdict(list)
        for action in self._actions:
            times[action.kind].append(
                (Clock.seconds(*action.span) - _total(action.waits)) * action.share)
        return {kind: statistics.median(ts) for kind, ts in sorted(times.items())}

    def units(self) -> dict[int, dict[str, float]]:
        """Per unit: median seconds of F, I and W, and activation and parameter bytes."""
        input_grad: dict[int, list[float]] = defaultdict(list)
        for trace in self._backward:
            for unit, seconds in trace.input_grad_seconds().items():
                input_grad[unit].append(seconds)
        weight_grad: dict[int, list[float]] = defaultdict(list)
        for stage, span in self._weight:
            seconds, units = Clock.seconds(*span), self._stage_units[stage]
            total = sum(n for _, n in units) or 1
            for unit, params in units:
                weight_grad[unit].append(seconds * params / total)
        out = {}
        for unit in sorted(self._forward):
            out[unit] = {
                "forward_s": statistics.median(Clock.seconds(*s) for s in self._forward[unit]),
                "input_grad_s": statistics.median(input_grad[unit] or [0.0]),
                "weight_grad_s": statistics.median(weight_grad[unit] or [0.0]),
                "activation_bytes": self.activation_bytes[unit],
                "param_bytes": self.param_bytes[unit],
            }
        return out


def _total(spans: list[Span]) -> float:
    return sum(Clock.seconds(*span) for span in spans)


def build_profile(parts: list[dict], layout: Layout, steps: tuple[int, int],
                  model: ModelSpec) -> dict:
    """The job's profile from every rank's part: per unit costs, P2P cost, rank speeds.

    A rank's relative speed compares its median transformer-block forward time with the
    median over all ranks (> 1: faster than the typical rank); ranks without blocks get 1.
    """
    units: dict[str, dict] = {}
    block_times: dict[int, list[float]] = defaultdict(list)
    for part in parts:
        for unit, costs in part["units"].items():
            units[str(unit)] = {**costs, "rank": part["rank"]}
            if 1 <= int(unit) <= model.layers:
                block_times[part["rank"]].append(costs["forward_s"])
    typical = statistics.median(t for ts in block_times.values() for t in ts)
    ranks = {
        str(part["rank"]): {
            "pp_rank": part["pp_rank"],
            "relative_speed": typical / statistics.median(block_times[part["rank"]])
            if block_times.get(part["rank"]) else 1.0,
            # the device's peak allocated bytes in the profiled steps (None: a CPU has none)
            "peak_gpu_bytes": part.get("peak_gpu_bytes"),
        }
        for part in parts
    }
    links = [part["p2p"] for part in parts if part["p2p"]]
    per_byte = [
        part["optimizer_s"] / sum(c["param_bytes"] for c in part["units"].values())
        for part in parts
    ]
    return {
        "layout": layout.to_dict(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "seq_tokens": model.seq_len,
        "optimizer_s_per_param_byte": statistics.median(per_byte),
        "profiled_steps": list(range(*steps)),
        "micro_batch_size": layout.micro_batch_size,
        "units": dict(sorted(units.items(), key=lambda kv: int(kv[0]))),
        "p2p": {
            "bytes": links[0]["bytes"] if links else 0,
            "seconds": statistics.median(link["seconds"] for link in links) if links else 0.0,
        },
        "ranks": ranks,
        **_measured(parts, layout),
    }


def _measured(parts: list[dict], layout) -> dict:
    """What predicts other layouts: calibrated unit costs, action and step overheads."""
    calibrations = [c for part in parts for c in part.get("calibration", [])]
    if not calibrations:
        return {}
    sizes = calibrations[0]["sizes"]
    # A stage action costs c + the sum of its units' costs, so n units alone cost n c more
    # than the stage: c = (sum of singles - stage) / (n - 1), at each size, over all stages.
    # A stage holding the embedding has no input: its I is empty and its W the whole
    # backward, unlike its units' alone, so it says nothing about the I and W overheads.
    overhead = {}
    for kind in CALIBRATED:
        split = kind in ("input_grad", "weight_grad")
        estimates = [
            (sum(unit[kind][j] for unit in c["units"].values()) - c["stage"][kind][j])
            / (len(c["units"]) - 1)
            for c in calibrations
            if c["stage"] is not None and not (split and min(map(int, c["units"])) == 0)
            for j in range(len(sizes))
        ]
        overhead[kind] = max(0.0, statistics.median(estimates)) if estimates else 0.0
    units = {}
    for c in calibrations:
        for unit, times in c["units"].items():
            costs = {}
            for kind in CALIBRATED:
                small, large = (t - overhead[kind] for t in times[kind])
                per_sample = (large - small) / (sizes[1] - sizes[0])
                costs[kind] = {"fixed_s": small - per_sample * sizes[0], "per_sample_s": per_sample}
            units[str(unit)] = costs
    actions = defaultdict(list)
    for part in parts:
        for kind, seconds in part.get("actions_s", {}).items():
            actions[kind].append(seconds)
    messages = {}
    for key, name in (("latency_s", "message_latency_s"), ("rendezvous_s", "rendezvous_s"),
                      ("cpu_s", "message_work_s")):
        values = [c["messages"][key] for part in parts for c in part.get("calibration", [])[:1]
                  if c.get("messages", {}).get(key) is not None]
        if values:
            messages[name] = statistics.fmean(values)
    return {
        **messages,
        "calibration": {
            "sizes": sizes,
            "world_size": layout.world_size,
            "action_overhead_s": overhead,
            "units": dict(sorted(units.items(), key=lambda kv: int(kv[0]))),
        },
        "actions_s": {kind: statistics.median(ts) for kind, ts in sorted(actions.items())},
        "collectives_s": max(part.get("collectives_s", 0.0) for part in parts),
        "step_parts": {
            str(part["rank"]): {
                key: statistics.median(s[key] for s in part["steps"])
                for key in ("pipeline_s", "post_s", "wait_s")
            }
            for part in parts if part.get("steps")
        },
    }
