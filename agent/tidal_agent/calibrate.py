"""Calibration: the measurements beside the profiled steps that predict other layouts.

What the online profiler (``tidal_agent.profiler``) times in the run's own steps holds for the
run's layout only: the hooks cost time, and a unit's cost is not proportional to the
micro-batch size (a fixed part is Python, dispatch and autograd-engine overhead). So every rank
also measures, beside the steps, on its own stage modules and device, leaving the run's
parameters, gradients and optimizer state as they were, bit for bit:

- ``calibrate_stage``: the rank's units run alone and all together, at the run's micro-batch
  size and at twice it, for every action kind (F, fused B, split I and W) and for the
  post-pipeline work of their parameters (gradient norms, clip, AdamW, zero_grad). A stage
  action costs a fixed per-action overhead plus its units' costs, so the difference between
  the singles' sum and the whole stage gives the overhead, and the two sizes give each unit's
  fixed and per-sample parts. Times are the device's (``tidal_agent.measure``), read after
  each pass;
- ``time_messages``: what a message between pipeline neighbours costs on the run's transport,
  beyond posting it: its latency to a receiver already waiting, its delay to one that posts
  after the sender (gloo's rendezvous), and the CPU seconds each end burns in its process;
- ``time_collectives``: the step's two all-reduces.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from tidal_agent.data import BatchSource
from tidal_agent.measure import Clock, Span, synchronize
from tidal_agent.model import StageModule, Unit, UnitContext
from tidal_agent.optim import build_adamw
from tidal_agent.profiler import CALIBRATED
from tidal_agent.runtime import split_backward
from tidal_agent.trainer import Trainer
from tidal_agent.transport import recv, send


def calibrate_stage(
    stage: StageModule,
    micro_batch_size: int,
    tokens: Callable[[int], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    build_optimizer: Callable[[list], torch.optim.Optimizer],
    *,
    device: torch.device,
    repeats: int = 5,
) -> dict:
    """Time one stage's units, alone and together, at two micro-batch sizes, on ``device``.

    ``tokens(m)`` loads a micro-batch of ``m`` samples the way the run does, onto the device;
    ``optimizer`` is the run's, ``build_optimizer`` builds one like it over ``(name,
    parameter)`` pairs. Returns, per size, the median seconds of every kind in ``CALIBRATED``
    for each unit alone (``units``) and, for a stage of several units, for all of them as one
    action (``stage``).

    The passes run the stage's own modules (under the run's precision and checkpointing) and
    the timed AdamW steps update the run's own AdamW state: nothing of the stage is copied on
    the device. Meanwhile the parameters and the AdamW state wait in host memory, and go back
    bit for bit afterwards (``_run_state_kept``).
    """
    units = stage.ordered_units
    singles = [[u] for u in units]
    groups = singles + ([list(units)] if len(units) > 1 else [])
    sizes = [micro_batch_size, 2 * micro_batch_size]
    clock = Clock(device)
    out: dict = {"sizes": sizes, "units": {}, "stage": None}
    with _run_state_kept([p for u in units for p in u.parameters()], optimizer):
        for i, group in enumerate(groups):
            named = [(f"{u.index}.{n}", p) for u in group for n, p in u.named_parameters()]
            opt = build_optimizer(named)
            for _, param in named:
                opt.state[param] = optimizer.state[param]  # the run's moments: no second copy
            times: dict[str, list[float]] = {kind: [] for kind in CALIBRATED}
            for m in sizes:
                # The first pass warms up (allocations, caches) and is dropped.
                runs = [_time_group(stage, group, m, tokens, opt, clock, device)
                        for _ in range(repeats + 1)][1:]
                for kind in CALIBRATED:
                    times[kind].append(statistics.median(run[kind] for run in runs))
            if i < len(singles):
                out["units"][group[0].index] = times
            else:
                out["stage"] = times
    return out


@contextlib.contextmanager
def _run_state_kept(params: list[torch.nn.Parameter],
                    optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Let calibration run on the run's parameters and optimizer state: a copy of them waits in
    host memory and is copied back afterwards, bit for bit; their gradients are set aside
    meanwhile and put back (the same tensors); AdamW state that calibration created goes."""
    grads = [p.grad for p in params]
    states = {p: dict(optimizer.state[p]) for p in params if optimizer.state.get(p)}
    live = [p.data for p in params] + [t for state in states.values() for t in state.values()
                                       if isinstance(t, torch.Tensor)]
    saved = [t.to("cpu", copy=True) for t in live]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for t, copy in zip(live, saved, strict=True):
                t.copy_(copy)
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
            if p in states:
                optimizer.state[p].clear()
                optimizer.state[p].update(states[p])
            else:
                optimizer.state.pop(p, None)


def _time_group(stage: StageModule, group: list[Unit], m: int, tokens, opt, clock: Clock,
                device: torch.device) -> dict[str, float]:
    """One F, B, F, I, W and post-pipeline pass of ``group`` on ``m`` samples, timed."""
    model = stage.model
    last = group[-1].index == model.num_units - 1
    gen = torch.Generator().manual_seed(group[0].index)  # never the global generator
    x0 = None
    if group[0].index > 0:
        x0 = torch.randn(m, model.seq_len, model.d_model, generator=gen).to(device)
    weights = [p for u in group for p in u.parameters()]
    spans: dict[str, Span] = {}

    def forward():
        ctx = UnitContext(seed=0, step=0, mb=0, device=device, load=lambda: tokens(m))
        x = None if x0 is None else x0.clone().requires_grad_(True)
        started = clock.mark()
        h, losses = x, []
        for unit in group:
            h, loss = stage.run_unit(unit, h, ctx)
            if loss is not None:
                losses.append(loss)
        span = (started, clock.mark())
        roots = list(losses) + ([] if last else [h])
        grads = [torch.ones_like(r) for r in roots]
        return span, x, roots, grads

    spans["forward"], x, roots, grads = forward()
    started = clock.mark()
    torch.autograd.backward(roots, grads)
    spans["backward"] = (started, clock.mark())

    _, x, roots, grads = forward()
    started = clock.mark()
    if x is None:  # as the runtime: a stage without input has no I; its W is the backward
        spans["input_grad"] = (started, clock.mark())
        started = clock.mark()
        torch.autograd.backward(roots, grads, inputs=weights)
    else:
        _, groups = split_backward().stage_backward_input(roots, grads, [x], iter(weights))
        spans["input_grad"] = (started, clock.mark())
        started = clock.mark()
        split_backward().stage_backward_weight(iter(weights), groups)
    spans["weight_grad"] = (started, clock.mark())

    started = clock.mark()
    grads = [p.grad for p in weights]  # clipped as the trainer clips (GradientClip)
    norms = torch.stack(torch._foreach_norm(grads))
    torch._foreach_mul_(grads, torch.clamp(1.0 / (torch.linalg.vector_norm(norms) + 1e-6),
                                           max=1.0))
    opt.step()
    opt.zero_grad(set_to_none=True)
    spans["post"] = (started, clock.mark())
    return {kind: Clock.seconds(*span) for kind, span in spans.items()}


def calibrate_trainer(trainer: Trainer, repeats: int = 5) -> list[dict]:
    """``calibrate_stage`` for every stage of the trainer's rank, all ranks at once.

    Each stage's entry also carries what ``time_messages`` measured on the rank.
    """
    corpus, device = trainer.runtime.batches.corpus, trainer.device
    trainer.world.barrier()  # every rank calibrates at the same time, sharing cores as in the run
    stages = [
        calibrate_stage(
            module, trainer.layout.micro_batch_size,
            lambda m: BatchSource(corpus, m).micro_batch(0, 0).to(device),
            trainer.optimizer, lambda named: build_adamw(named, trainer.spec.training),
            device=device, repeats=repeats,
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
                world.complete([leg])
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
            synchronize(world.device)
        else:
            for into in bufs:
                _compute(1.5 * busy_s)
                started = time.perf_counter()
                world.complete([recv(into, peer)])
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
        synchronize(trainer.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])
