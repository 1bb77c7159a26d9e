"""A worker process: joins the job's process group and trains its share of the layout.

Events go back to the launcher on a queue: per-step results from rank 0, parameter digests
from every rank at the end, and an error line from a rank that fails.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tidal_agent import checkpoint
from tidal_agent.optim import ClipMode
from tidal_agent.trainer import Trainer
from tidal_agent.world import Rendezvous, build_world
from tidal_api import JobSpec
from tidal_plan.layout import Layout


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerOptions:
    store_host: str
    store_port: int
    store_prefix: str
    world_size: int
    steps: int
    backend: str = "gloo"
    timeout_s: float = 120.0
    threads: int = 1
    clip_mode: ClipMode = ClipMode.GLOBAL_ORDER
    resume_from: str | None = None  # a checkpoint directory
    checkpoint_root: str | None = None
    checkpoint_every: int = 0  # steps; 0: no periodic checkpoints


def worker_id(index: int) -> str:
    return f"worker-{index}"


def worker_main(rank: int, spec_json: str, layout: Layout, opts: WorkerOptions, events) -> None:
    """Process entry point (spawned); never raises, reports through ``events``."""
    try:
        _run(rank, JobSpec.model_validate_json(spec_json), layout, opts, events)
    except BaseException as err:  # noqa: BLE001 - the launcher needs every failure, with cause
        events.put(("error", rank, f"{type(err).__name__}: {err}", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(rank: int, spec: JobSpec, layout: Layout, opts: WorkerOptions, events) -> None:
    # Same threads in every process: part of the determinism contract.
    torch.set_num_threads(opts.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(opts.threads))
    rendezvous = Rendezvous(host=opts.store_host, port=opts.store_port, prefix=opts.store_prefix,
                            timeout_s=opts.timeout_s, backend=opts.backend)
    device = torch.device("cpu")
    if opts.backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    members = tuple(worker_id(r) for r in range(opts.world_size))
    world = build_world(rendezvous, 0, members, worker_id(rank))
    trainer = Trainer(
        spec=spec, layout=layout, world=world, device=device, clip_mode=opts.clip_mode,
        initialise=opts.resume_from is None,
    )
    start = checkpoint.load(trainer, opts.resume_from) if opts.resume_from else 0
    events.put(("ready", rank, start))
    for step in range(start, opts.steps):
        started = time.perf_counter()
        result = trainer.step(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
        if rank == 0:
            events.put(("step", rank, _step_event(result, seconds, layout)))
        done = step + 1
        if opts.checkpoint_every and opts.checkpoint_root and done % opts.checkpoint_every == 0:
            path = checkpoint.save(trainer, opts.checkpoint_root, done, layout.describe())
            if rank == 0:
                events.put(("checkpoint", rank, str(path)))
    events.put(("done", rank, trainer.parameter_digests()))


def _step_event(result, seconds: float, layout: Layout) -> dict[str, Any]:
    return {
        "step": result.step,
        "loss": result.loss,
        "loss_hex": float.hex(result.loss),
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "seconds": seconds,
        "layout": layout.to_dict(),
    }
