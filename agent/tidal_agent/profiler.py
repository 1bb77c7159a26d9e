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
I and W are measured apart.

The hooks themselves cost time, and a unit's cost is not proportional to the micro-batch size
(a fixed part is Python, dispatch and autograd-engine overhead), so what predicts other layouts
comes from two more measurements:

- ``calibrate_units``: copies of the rank's units run alone and all together, at the run's
  micro-batch size and at twice it, for every action kind (F, fused B, split I and W) and for
  the post-pipeline work of their parameters (gradient norms, clip, AdamW, zero_grad). A stage
  action costs a fixed per-action overhead plus its units' costs, so the difference between
  the singles' sum and the whole stage gives the overhead, and the two sizes give each unit's
  fixed and per-sample parts. Copies: the run's parameters, gradients and optimizer state are
  never touched, so the run keeps its bits.
- the plain profiled steps (hooks off): every action's wall time as the runtime runs it, the
  time its receives waited, and the step's pipeline and post-pipeline seconds;
- ``time_messages``: what a message between pipeline neighbours costs on the run's transport,
  beyond posting it: its latency to a receiver already waiting, its delay to one that posts
  after the sender (gloo's rendezvous), and the CPU seconds each end burns in its process.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from tidal_agent.model import StageModule, Unit, UnitContext
from tidal_plan.ir import Action

if TYPE_CHECKING:  # the trainer imports the runtime, which imports this module
    from tidal_agent.trainer import Trainer


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
                h, loss = unit(h, ctx)
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


def build_profile(parts: list[dict], layout, steps: tuple[int, int], config) -> dict:
    """The job's profile from every rank's part: per unit costs, P2P cost, rank speeds.

    A rank's relative speed compares its median transformer-block forward time with the
    median over all ranks (> 1: faster than the typical rank); ranks without blocks get 1.
    """
    units: dict[str, dict] = {}
    block_times: dict[int, list[float]] = defaultdict(list)
    for part in parts:
        for unit, costs in part["units"].items():
            units[str(unit)] = {**costs, "rank": part["rank"]}
            if 1 <= int(unit) <= config.layers:
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
        "seq_tokens": config.seq_len,
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


CALIBRATED = ("forward", "backward", "input_grad", "weight_grad", "post")


def calibrate_stage(
    units: Sequence[Unit],
    micro_batch_size: int,
    tokens: Callable[[int], torch.Tensor],
    optimizer: Callable[[list], torch.optim.Optimizer],
    *,
    repeats: int = 5,
) -> dict:
    """Time copies of one stage's units, alone and together, at two micro-batch sizes.

    ``tokens(m)`` loads a micro-batch of ``m`` samples the way the run does; ``optimizer``
    builds the run's optimizer over ``(name, parameter)`` pairs. Returns, per size, the median
    seconds of every kind in ``CALIBRATED`` for each unit alone (``units``) and, for a stage
    of several units, for all of them as one action (``stage``).
    """
    singles = [[copy.deepcopy(u)] for u in units]
    groups = singles + ([[u for [u] in singles]] if len(units) > 1 else [])
    sizes = [micro_batch_size, 2 * micro_batch_size]
    out: dict = {"sizes": sizes, "units": {}, "stage": None}
    for i, group in enumerate(groups):
        opt = optimizer([(f"{u.index}.{n}", p) for u in group for n, p in u.named_parameters()])
        times: dict[str, list[float]] = {kind: [] for kind in CALIBRATED}
        for m in sizes:
            # The first pass warms up (allocations, the optimizer's state) and is dropped.
            runs = [_time_group(group, m, tokens, opt) for _ in range(repeats + 1)][1:]
            for kind in CALIBRATED:
                times[kind].append(statistics.median(run[kind] for run in runs))
        if i < len(singles):
            out["units"][group[0].index] = times
        else:
            out["stage"] = times
    return out


def _time_group(group: list[Unit], m: int, tokens, opt) -> dict[str, float]:
    """One F, B, F, I, W and post-pipeline pass of ``group`` on ``m`` samples, timed."""
    config = group[0].config
    last = group[-1].index == config.num_units - 1
    gen = torch.Generator().manual_seed(group[0].index)  # never the global generator
    x0 = None
    if group[0].index > 0:
        x0 = torch.randn(m, config.seq_len, config.d_model, generator=gen)
    weights = [p for u in group for p in u.parameters()]
    out: dict[str, float] = {}

    def forward():
        ctx = UnitContext(seed=0, step=0, mb=0, device=torch.device("cpu"),
                          load=lambda: tokens(m))
        x = None if x0 is None else x0.clone().requires_grad_(True)
        started = time.perf_counter()
        h, losses = x, []
        for unit in group:
            h, loss = unit(h, ctx)
            if loss is not None:
                losses.append(loss)
        seconds = time.perf_counter() - started
        roots = list(losses) + ([] if last else [h])
        grads = [torch.ones_like(r) for r in roots]
        return seconds, x, roots, grads

    out["forward"], x, roots, grads = forward()
    started = time.perf_counter()
    torch.autograd.backward(roots, grads)
    out["backward"] = time.perf_counter() - started

    _, x, roots, grads = forward()
    started = time.perf_counter()
    if x is None:  # as the runtime: a stage without input has no I; its W is the backward
        out["input_grad"] = time.perf_counter() - started
        started = time.perf_counter()
        torch.autograd.backward(roots, grads, inputs=weights)
    else:
        _, groups = stage_backward_input(roots, grads, [x], iter(weights))
        out["input_grad"] = time.perf_counter() - started
        started = time.perf_counter()
        stage_backward_weight(iter(weights), groups)
    out["weight_grad"] = time.perf_counter() - started

    started = time.perf_counter()
    norms = torch.stack([torch.linalg.vector_norm(p.grad) for p in weights])
    coef = torch.clamp(1.0 / (torch.linalg.vector_norm(norms) + 1e-6), max=1.0)
    for p in weights:
        p.grad.mul_(coef)
    opt.step()
    opt.zero_grad(set_to_none=True)
    out["post"] = time.perf_counter() - started
    return out


def calibrate_trainer(trainer: Trainer, repeats: int = 5) -> list[dict]:
    """``calibrate_stage`` for every stage of the trainer's rank, all ranks at once.

    Each stage's entry also carries what ``time_messages`` measured on the rank.
    """
    from tidal_agent.data import BatchSource
    from tidal_agent.optim import build_adamw

    corpus = trainer.runtime.batches.corpus
    trainer.world.barrier()  # every rank calibrates at the same time, sharing cores as in the run
    stages = [
        calibrate_stage(
            module.ordered_units, trainer.layout.micro_batch_size,
            lambda m: BatchSource(corpus, m).micro_batch(0, 0),
            lambda named: build_adamw(named, trainer.spec.training),
            repeats=repeats,
        )
        for module in trainer.stages.values()
    ]
    messages = time_messages(trainer)
    return [{**stage, "messages": messages} for stage in stages]


_MESSAGE_TAG = 5_000_000  # above the step's tags and the ping-pong's


def time_messages(trainer: Trainer, repeats: int = 20, busy_s: float = 0.002) -> dict:
    """What an activation-sized message costs between pipeline neighbours, both orders.

    Pairs (r, r + 1) of each replica's pipeline take turns, like ``profile_p2p``:

    - ``latency_s``: half a ping-pong's round trip; each leg's RECV is posted first and its
      receiver sleeps in it until the data comes;
    - ``cpu_s``: the process CPU seconds (every thread: the transport's too) one end of those
      messages costs, on average over both ends;
    - ``rendezvous_s``: the RECV posted after the SEND, which gloo answers only once the
      receiver's notice reaches the sender's side. Timed as a pipeline streams: the sender
      computes ``busy_s`` and posts, ``repeats`` times; the receiver computes ``1.5 busy_s``
      before each RECV, lagging ever more behind; the seconds from each posting to the data.

    Each is the median of ``repeats`` tries: other load on the host stretches some of them a
    lot, and what the running pipeline adds to the delays is measured apart (the predictor
    scales them to the profiled steps). Every rank calls it; the values are None on ranks that
    measured none of them.
    """
    buf = torch.zeros(trainer.runtime.activation_shape, device=trainer.device)
    bufs = [torch.zeros_like(buf) for _ in range(repeats)]
    latency, cpu, rendezvous = [], [], []
    layout, me, world = trainer.layout, trainer.pp_rank, trainer.world
    for first in range(layout.pp - 1):
        if me not in (first, first + 1):
            continue
        sender = me == first
        peer = trainer.runtime.group_ranks[first + 1 if sender else first]
        tags = iter(range(_MESSAGE_TAG + 1000 * first, _MESSAGE_TAG + 1000 * (first + 1)))
        for i in range(repeats + 1):  # the first exchange sets the pair up: not counted
            started, cpu_started = time.perf_counter(), time.process_time()
            out, back = next(tags), next(tags)
            if sender:
                world.send(buf, peer, out).wait()
                world.recv(buf, peer, back).wait()
            else:
                world.recv(buf, peer, out).wait()
                world.send(buf, peer, back).wait()
            if i:
                latency.append((time.perf_counter() - started) / 2)
                cpu.append((time.process_time() - cpu_started) / 2)
        stream = [next(tags) for _ in range(repeats)]
        if sender:
            works = []
            for tag in stream:
                _compute(busy_s)
                works.append(world.send(buf, peer, tag))
            for work in works:
                work.wait()
        else:
            for tag, into in zip(stream, bufs, strict=True):
                _compute(1.5 * busy_s)
                started = time.perf_counter()
                world.recv(into, peer, tag).wait()
                rendezvous.append(time.perf_counter() - started)
    world.barrier()

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    return {"latency_s": median(latency), "cpu_s": median(cpu),
            "rendezvous_s": median(rendezvous)}


def _compute(seconds: float) -> None:
    """Keep this rank's core busy with small matmuls, as a stage's compute would."""
    x = torch.full((64, 64), 1.0 / 64)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        x = torch.tanh(x @ x)


def time_collectives(trainer: Trainer, repeats: int = 5) -> float:
    """Median seconds of the step's two all-reduces: the gradient norms and the step loss."""
    layout = trainer.layout
    norms = torch.zeros(trainer.num_params)
    table = torch.zeros(layout.num_micro_batches * layout.dp, trainer._num_loss_units,
                        dtype=torch.float64)
    times = []
    trainer.world.barrier()
    for _ in range(repeats + 1):
        started = time.perf_counter()
        trainer.world.all_reduce(norms)
        trainer.world.all_reduce(table)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])
