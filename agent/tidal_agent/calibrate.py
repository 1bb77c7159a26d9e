"""Calibration: the measurements beside the profiled steps that predict other layouts.

What the online profiler (``tidal_agent.profiler``) times in the run's own steps holds for the
run's layout only: the hooks cost time, and a unit's cost is not proportional to the
micro-batch size (a fixed part is Python, dispatch and autograd-engine overhead). So every rank
also measures, on copies, never touching the run's parameters, gradients or optimizer state
(the run keeps its bits):

- ``calibrate_stage``: copies of the rank's units run alone and all together, at the run's
  micro-batch size and at twice it, for every action kind (F, fused B, split I and W) and for
  the post-pipeline work of their parameters (gradient norms, clip, AdamW, zero_grad). A stage
  action costs a fixed per-action overhead plus its units' costs, so the difference between
  the singles' sum and the whole stage gives the overhead, and the two sizes give each unit's
  fixed and per-sample parts;
- ``time_messages``: what a message between pipeline neighbours costs on the run's transport,
  beyond posting it: its latency to a receiver already waiting, its delay to one that posts
  after the sender (gloo's rendezvous), and the CPU seconds each end burns in its process;
- ``time_collectives``: the step's two all-reduces.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from tidal_agent.data import BatchSource
from tidal_agent.model import Unit, UnitContext
from tidal_agent.optim import build_adamw
from tidal_agent.profiler import CALIBRATED
from tidal_agent.trainer import Trainer
from tidal_agent.transport import recv, send


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
    model = group[0].model
    last = group[-1].index == model.num_units - 1
    gen = torch.Generator().manual_seed(group[0].index)  # never the global generator
    x0 = None
    if group[0].index > 0:
        x0 = torch.randn(m, model.seq_len, model.d_model, generator=gen)
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
        legs = [send(buf, peer), recv(buf, peer)]
        for i in range(repeats + 1):  # the first exchange sets the pair up: not counted
            started, cpu_started = time.perf_counter(), time.process_time()
            for leg in legs if sender else legs[::-1]:  # one message at a time, in turn
                world.exchange([leg]).wait()
            if i:
                latency.append((time.perf_counter() - started) / 2)
                cpu.append((time.process_time() - cpu_started) / 2)
        if sender:
            posted = []
            for _ in range(repeats):
                _compute(busy_s)
                posted.append(world.exchange([send(buf, peer)]))
            for exchange in posted:
                exchange.wait()
        else:
            for into in bufs:
                _compute(1.5 * busy_s)
                started = time.perf_counter()
                world.exchange([recv(into, peer)]).wait()
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
    norms = torch.zeros(trainer.num_params, device=trainer.device)
    table = torch.zeros(layout.num_micro_batches * layout.dp, trainer._num_loss_units,
                        dtype=torch.float64, device=trainer.device)
    times = []
    trainer.world.barrier()
    for _ in range(repeats + 1):
        started = time.perf_counter()
        trainer.world.all_reduce(norms)
        trainer.world.all_reduce(table)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])
