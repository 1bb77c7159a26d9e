"""Online profiling: what each placement unit costs, measured during real training steps.

During a few steps of the run (no separate profiling run) the runtime hands its stage forwards
and backwards to a ``UnitProfiler``, which records per placement unit:

- forward seconds: wall time around the unit's forward;
- input-gradient seconds (I): from the gradient reaching the unit's output (or loss) to it
  reaching the unit's input, read from tensor hooks on the unit boundaries;
- weight-gradient seconds (W): the stage's W time, shared among its units by parameter count
  (weight gradients are one matmul per weight, so their cost follows the weight sizes);
- activation bytes: what autograd saves for the unit's backward (saved-tensor hooks);
- parameter bytes.

While the unit hooks are on (the first profiled step), a fused backward (B) runs as I then W,
which computes the same bits (tests/integration/test_bitwise.py compares the schedules), so that
I and W are measured apart. In the plain profiled steps (hooks off) it records every action's
wall time as the runtime runs it, the time its receives waited, and the step's pipeline and
post-pipeline seconds.

``build_profile`` joins every rank's part, with what ``tidal_agent.calibrate`` measured beside
the steps, into the profile that ``tidal_plan.profiled`` reads.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from tidal_agent.model import StageModule, UnitContext
from tidal_api import Layout, ModelSpec
from tidal_plan.ir import Action

# What ``tidal_agent.calibrate`` times per unit and per stage (the action kinds and the
# post-pipeline work): the keys of the profile's calibration.
CALIBRATED = ("forward", "backward", "input_grad", "weight_grad", "post")


@dataclass(slots=True)
class _Trace:
    """Hook timestamps of one (stage, micro-batch): unit -> when its output gradient arrived."""

    units: list[int]
    output_marks: dict[int, float] = field(default_factory=dict)
    input_mark: float | None = None

    # Hooks must return None: a returned value would replace the gradient.
    def mark_output(self, unit: int) -> None:
        self.output_marks.setdefault(unit, time.perf_counter())

    def mark_input(self) -> None:
        self.input_mark = time.perf_counter()


class UnitProfiler:
    def __init__(self) -> None:
        self.forward_s: dict[int, list[float]] = defaultdict(list)
        self.input_grad_s: dict[int, list[float]] = defaultdict(list)
        self.weight_grad_s: dict[int, list[float]] = defaultdict(list)
        self.activation_bytes: dict[int, int] = {}
        self.param_bytes: dict[int, int] = {}
        self.optimizer_s: list[float] = []  # the rank's AdamW step
        # Plain steps (hooks off): per action kind, wall seconds minus receive waits.
        self.hooks = True
        self.action_s: dict[str, list[float]] = defaultdict(list)
        self.step_parts: list[dict[str, float]] = []  # pipeline and post-pipeline seconds
        self._waited = 0.0
        self._step_waited = 0.0
        self._traces: dict[tuple[int, int], _Trace] = {}
        self._stage_units: dict[int, list[tuple[int, int]]] = {}  # stage -> (unit, params)

    def forward(self, stage: int, mb: int, module: StageModule, x, ctx: UnitContext):
        """Run ``module`` like ``StageModule.forward``, timing and hooking every unit."""
        trace = _Trace(units=[u.index for u in module.ordered_units])
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

            started = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                h, loss = module.run_unit(unit, h, ctx)
            self.forward_s[unit.index].append(time.perf_counter() - started)
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

    def input_grad_done(self, stage: int, mb: int, started: float, ended: float) -> None:
        """The backward (I) of (stage, mb) ran from ``started`` to ``ended``: attribute it."""
        trace = self._traces.pop((stage, mb))
        # Unit u's backward runs from its output gradient (the backward's start for the unit
        # the backward enters first) to the gradient of its input, which is the output
        # gradient of unit u - 1, or the stage input's, or the backward's end.
        units = trace.units
        for i, unit in enumerate(units):
            start = max(trace.output_marks.get(unit, started), started)
            if i > 0 and units[i - 1] in trace.output_marks:
                end = trace.output_marks[units[i - 1]]
            else:
                end = trace.input_mark if trace.input_mark is not None else ended
            self.input_grad_s[unit].append(max(0.0, end - start))

    def weight_grad_done(self, stage: int, seconds: float) -> None:
        units = self._stage_units[stage]
        total = sum(n for _, n in units) or 1
        for unit, params in units:
            self.weight_grad_s[unit].append(seconds * params / total)

    def waited(self, seconds: float) -> None:
        """A compute action spent ``seconds`` waiting for a receive: not its own time."""
        self._waited += seconds
        self._step_waited += seconds

    def action_done(self, action: Action, seconds: float) -> None:
        if not self.hooks:
            self.action_s[action.kind.value].append(seconds - self._waited)
        self._waited = 0.0

    def step_done(self, pipeline_s: float, post_s: float) -> None:
        if not self.hooks:
            self.step_parts.append(
                {"pipeline_s": pipeline_s, "post_s": post_s, "wait_s": self._step_waited}
            )
        self._step_waited = 0.0

    def actions(self) -> dict[str, float]:
        """Median wall seconds per action kind in the plain profiled steps."""
        return {kind: statistics.median(ts) for kind, ts in sorted(self.action_s.items())}

    def units(self) -> dict[int, dict[str, float]]:
        """Per unit: median seconds of F, I and W, and activation and parameter bytes."""
        out = {}
        for unit in sorted(self.forward_s):
            out[unit] = {
                "forward_s": statistics.median(self.forward_s[unit]),
                "input_grad_s": statistics.median(self.input_grad_s[unit] or [0.0]),
                "weight_grad_s": statistics.median(self.weight_grad_s[unit] or [0.0]),
                "activation_bytes": self.activation_bytes[unit],
                "param_bytes": self.param_bytes[unit],
            }
        return out


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
