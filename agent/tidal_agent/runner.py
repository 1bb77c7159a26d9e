"""The local runner: a training job as worker processes on this machine.

``run_local`` hosts the rendezvous store, spawns one process per worker, shows progress from the
events they send, and returns (and optionally writes) the JSON report: per step the loss (also as
``float.hex``), layout and seconds, and ``params_sha256`` over every final parameter in global
order.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tidal_agent.model import global_parameter_names
from tidal_agent.optim import ClipMode
from tidal_agent.trainer import model_config, params_sha256
from tidal_agent.worker import WorkerOptions, worker_main
from tidal_api import ElasticTrainingJob
from tidal_plan.layout import Layout, ScheduleKind, build_layout


class RunError(RuntimeError):
    """A run that failed; the message names the rank and the cause."""


def resolve_layout(
    job: ElasticTrainingJob,
    *,
    workers: int,
    schedule: str | None = None,
    partition: tuple[int, ...] | None = None,
) -> Layout:
    """The layout for ``workers`` pipeline ranks; the CLI's flags override the spec."""
    spec = job.spec
    kind = schedule or spec.parallelism.schedule
    if kind == "auto":  # the planner arrives later; 1F1B is the safe default meanwhile
        kind = ScheduleKind.ONE_F_ONE_B.value
    return build_layout(
        num_units=spec.model.num_units,
        workers=workers,
        micro_batch_size=spec.training.micro_batch_size,
        num_micro_batches=spec.training.num_micro_batches,
        schedule=kind,
        partition=partition,
        virtual_stages=spec.parallelism.virtual_stages,
    )


StepCallback = Callable[[dict[str, Any]], None]


def run_local(
    job: ElasticTrainingJob,
    layout: Layout,
    *,
    steps: int,
    report_path: str | Path | None = None,
    on_step: StepCallback | None = None,
    clip_mode: ClipMode = ClipMode.GLOBAL_ORDER,
    timeout_s: float = 120.0,
    threads: int = 1,
    resume_from: str | Path | None = None,
) -> dict[str, Any]:
    """Train ``job`` up to step ``steps`` in ``layout``; return the report.

    With ``resume_from`` (a checkpoint directory) training continues from the step it was saved
    at, in this layout whatever the layout that saved it. ``spec.checkpoint`` sets periodic saves.
    """
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s), use_libuv=True,
    )
    opts = WorkerOptions(
        store_host="127.0.0.1",
        store_port=store.port,
        store_prefix=f"run-{os.getpid()}-{time.monotonic_ns()}/",
        world_size=layout.world_size,
        steps=steps,
        timeout_s=timeout_s,
        threads=threads,
        clip_mode=clip_mode,
        resume_from=str(resume_from) if resume_from else None,
        checkpoint_root=job.spec.checkpoint.path,
        checkpoint_every=job.spec.checkpoint.every_steps,
    )
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    spec_json = job.spec.model_dump_json()
    procs = [
        ctx.Process(
            target=worker_main, args=(rank, spec_json, layout, opts, events),
            name=f"tidal-worker-{rank}", daemon=True,
        )
        for rank in range(layout.world_size)
    ]
    started = time.perf_counter()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the spawned interpreters
    try:
        for proc in procs:
            proc.start()
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    try:
        step_events, digests, saved = _collect(
            procs, events, layout.world_size, on_step, timeout_s
        )
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    num_params = len(global_parameter_names(model_config(job.spec)))
    report = {
        "job": job.metadata.name,
        "workers": layout.world_size,
        "layout": layout.to_dict(),
        "steps": step_events,
        "params_sha256": params_sha256(digests, num_params),
        "resumed_from": str(resume_from) if resume_from else None,
        "checkpoints": saved,
        "seconds_total": time.perf_counter() - started,
    }
    if report_path is not None:
        path = Path(report_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _collect(procs, events, world: int, on_step: StepCallback | None, timeout_s: float):
    """Read worker events until every rank is done; fail fast on an error or a dead worker."""
    steps: list[dict[str, Any]] = []
    saved: list[str] = []
    digests: dict[int, tuple[str, str]] = {}
    done: set[int] = set()
    last_event = time.monotonic()
    while len(done) < world:
        try:
            kind, rank, payload, *detail = events.get(timeout=0.5)
        except queue.Empty:
            _check_alive(procs, done)
            if time.monotonic() - last_event > timeout_s:
                raise RunError(f"no progress from any worker for {timeout_s:.0f} s") from None
            continue
        last_event = time.monotonic()
        if kind == "error":
            _stop(procs)
            raise RunError(f"worker {rank} failed: {payload}\n{detail[0] if detail else ''}")
        if kind == "step":
            steps.append(payload)
            if on_step is not None:
                on_step(payload)
        elif kind == "checkpoint":
            saved.append(payload)
        elif kind == "done":
            digests.update(payload)
            done.add(rank)
    return steps, digests, saved


def _check_alive(procs, done: set[int]) -> None:
    for rank, proc in enumerate(procs):
        if rank not in done and proc.exitcode is not None:
            _stop(procs)
            raise RunError(f"worker {rank} exited with code {proc.exitcode} before finishing")


def _stop(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
