"""The local runner: a training job as worker processes on this machine.

The launcher hosts the job's long-lived rendezvous store and starts one process per worker
that will ever take part, joiners included (they wait in standby until their generation).
It shows progress from the events they send and returns (and optionally writes) the JSON
report: per step the loss (also as ``float.hex``), layout and seconds; per reconfiguration its
timings and bytes; ``params_sha256`` over every final parameter in global order; and where the
workers trained (``device``, ``backend``, ``transport``, the ``determinism`` settings), as the
leader said.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tidal_agent import sharing
from tidal_agent.events import (Checkpointed, Failed, Finished, Left, Listener, Profiled, Ready,
                                Reconfigured, Released, Replanned, Stepped, Straggler)
from tidal_agent.optim import ClipMode
from tidal_agent.trainer import params_sha256
from tidal_agent.worker import worker_main
from tidal_agent.worker_options import WorkerOptions
from tidal_agent.world import Rendezvous
from tidal_api import ElasticTrainingJob
from tidal_api.layout import Layout
from tidal_plan.elastic import Generation, all_workers
from tidal_plan.gpus import Devices


_SPAWNING = threading.Lock()  # held while a launch sets the environment its workers inherit


# What the server imports (tidal_local.processes names the same: the one server of a process
# serves its workers and the local cluster's pods, whichever starts it): the agent and dynamo,
# and transformers' modelling base where a Hugging Face model may be trained.
PRELOAD = ("tidal_agent.pod", "tidal_agent.worker", "torch._dynamo")
HF_PRELOAD = ("transformers.modeling_utils", "transformers.masking_utils",
              "transformers.models.auto.modeling_auto")


def worker_processes(fresh: bool = False, hf: bool = False) -> mp.context.BaseContext:
    """Where worker processes come from: forks of one server process per launcher that has
    imported the worker and ``torch._dynamo`` (which torch.optim imports at an optimizer's
    first parameter group), instead of a fresh interpreter each. That saves every worker after
    the launcher's first about 3 s of CPU (2 cores: one run of the test suite saves minutes).
    The server imports transformers' modelling base too (1.5 s of CPU; 1.1 s saved in each
    worker of a Hugging Face model) where ``hf`` (this job's model is one) or this process has
    imported transformers itself (it may serve such a job later: a server serves every job of
    its launcher, and the first to start it decides what it imports).
    The server runs no tensor operation, so a fork inherits no started thread pool (OpenMP's is
    not fork-safe); each worker sets its own threads. ``fresh``: a fresh interpreter each, as
    a restarted pod has (the checkpoint-restart baseline of bench/reshard.py)."""
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    hf = hf or "transformers" in sys.modules
    ctx.set_forkserver_preload([*PRELOAD, *(HF_PRELOAD if hf else ())])
    return ctx


class RunError(RuntimeError):
    """A run that failed; the message names the worker and the cause."""


StepCallback = Callable[[dict[str, Any]], None]


def run_local(job: ElasticTrainingJob, layout: Layout, **kwargs) -> dict[str, Any]:
    """Train ``job`` in one fixed ``layout``; see ``run_elastic`` for the arguments."""
    members = tuple(f"worker-{i}" for i in range(layout.world_size))
    return run_elastic(job, [Generation(index=0, at_step=0, members=members)], [layout], **kwargs)


def run_elastic(
    job: ElasticTrainingJob,
    gens: list[Generation],
    layouts: list[Layout],
    *,
    steps: int,
    report_path: str | Path | None = None,
    on_step: StepCallback | None = None,
    clip_mode: ClipMode = ClipMode.GLOBAL_ORDER,
    timeout_s: float = 120.0,
    threads: int = 1,
    resume_from: str | Path | None = None,
    bucket_bytes: int = 256 << 20,
    profile_out: str | Path | None = None,
    peer_snapshots: bool = False,
    fresh_interpreters: bool = False,
    unit_seconds: tuple[float, ...] | None = None,
    slowdown: tuple[tuple[str, int, int, float], ...] = (),
    pin_cores: bool = False,
    watch_stragglers: bool = True,
    sharing_probe: bool = True,
    on_profile: Callable[[Profiled], None] | None = None,
    devices: Devices = Devices(),
    track_memory: bool = False,
) -> dict[str, Any]:
    """Train ``job`` up to step ``steps``, switching layout live at each generation.

    With ``resume_from`` (a checkpoint directory) training continues from the step it was saved
    at, in the first generation's layout whatever the layout that saved it. ``spec.checkpoint``
    sets periodic saves. A fixed schedule has no fault path, so peer snapshots are off unless
    ``peer_snapshots`` (to measure what they cost). ``fresh_interpreters``: see
    :func:`worker_processes`. ``unit_seconds`` weigh a re-plan around stragglers (where
    ``spec.stragglers.replan``; default: the modeling-based predictor's on the CPU);
    ``slowdown`` makes workers stragglers for a test (``WorkerOptions.slowdown``);
    ``pin_cores`` puts worker i on core i modulo the cores (``os.sched_setaffinity``);
    ``watch_stragglers=False`` turns the straggler watch off (to measure what it costs).
    With ``profile_out`` every generation profiles its first steps (``on_profile`` hears of
    each), and the first profile gets the host's sharing probe unless ``sharing_probe`` is
    off. ``devices``: where the workers compute and how they talk (default: the CPU, gloo);
    worker ``i`` binds ``devices.gpu(i)``. ``track_memory``: CPU workers count their tensors'
    bytes (``WorkerOptions.track_memory``; the report's ``peak_tensor_bytes``), slower.
    """
    workers = all_workers(gens)
    devices.check(len(workers))
    if unit_seconds is None and job.spec.stragglers.replan:
        from tidal_plan.devices import load_device
        from tidal_plan.planner import LayoutPlanner

        unit_seconds = LayoutPlanner(job, load_device("cpu")).unit_seconds()
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s), use_libuv=True,
    )
    opts = WorkerOptions(
        rendezvous=Rendezvous(host="127.0.0.1", port=store.port,
                              prefix=f"run-{os.getpid()}-{time.monotonic_ns()}/",
                              timeout_s=timeout_s, transport=devices.transport),
        generations=tuple(gens),
        layouts=tuple(layouts),
        steps=steps,
        threads=threads,
        clip_mode=clip_mode,
        resume_from=str(resume_from) if resume_from else None,
        checkpoint_root=job.spec.checkpoint.path,
        checkpoint_every=job.spec.checkpoint.every_steps,
        bucket_bytes=bucket_bytes,
        profile_out=str(profile_out) if profile_out else None,
        peer_snapshots=peer_snapshots,
        snapshot_every=job.spec.checkpoint.snapshot_every_steps,
        unit_seconds=tuple(unit_seconds or ()),
        slowdown=tuple(slowdown),
        watch_stragglers=watch_stragglers,
        track_memory=track_memory,
    )
    ctx = worker_processes(fresh_interpreters, hf=job.spec.model.huggingface is not None)
    events = ctx.Queue()
    spec_json = job.spec.model_dump_json()
    procs = {
        me: ctx.Process(target=worker_main,
                        args=(me, spec_json, replace(opts, gpu=devices.gpu(i)), events),
                        name=f"tidal-{me}", daemon=True)
        for i, me in enumerate(workers)
    }
    started = time.perf_counter()
    with _SPAWNING:  # runs at once (the sharing probe's copies) each restore the environment
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the spawned interpreters
        try:
            for proc in procs.values():
                proc.start()
            if pin_cores:
                cores = sorted(os.sched_getaffinity(0))
                for i, proc in enumerate(procs.values()):
                    os.sched_setaffinity(proc.pid, {cores[i % len(cores)]})
        finally:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
    try:
        collected = _collect(procs, events, on_step, timeout_s, on_profile)
    finally:
        for proc in procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if collected.profile is not None and sharing_probe and devices.device == "cpu":
        _add_sharing(collected.profile, job, threads)
    final = collected.reconfigurations[-1]["to"] if collected.reconfigurations else None
    report = {
        "job": job.metadata.name,
        **collected.setup[workers[0]],  # device, backend, transport, determinism
        "workers": len(gens[-1].members),
        "layout": final or layouts[-1].to_dict(),
        "steps": collected.steps,
        "reconfigurations": collected.reconfigurations,
        # per worker a shrink let go: at_step, release_s and the snapshot swap's part of it
        "releases": collected.releases,
        # per flag the straggler watch raised or cleared, and per re-plan it made
        "stragglers": collected.stragglers,
        "replans": collected.replans,
        "params_sha256": params_sha256(collected.digests, collected.num_params),
        "resumed_from": str(resume_from) if resume_from else None,
        "checkpoints": collected.checkpoints,
        "peak_rss_bytes": dict(sorted(collected.peak_rss.items())),
        # per worker: its GPU's peak allocated bytes (null on a CPU), and its peer snapshots'
        # peak host memory, {pinned, pageable} (null without snapshots)
        "peak_gpu_bytes": dict(sorted(collected.peak_gpu.items())),
        # per worker: its steps' peak of live CPU tensor bytes (null unless track_memory)
        "peak_tensor_bytes": dict(sorted(collected.peak_tensor.items())),
        "snapshot_bytes": dict(sorted(collected.snapshot_bytes.items())),
        "profile": collected.profile,  # the first generation's
        # per profile (each generation's first steps): path, layout, steps [first, last)
        "profiles": collected.profiles,
        # launch to every worker ready: interpreters, worlds, trainers, checkpoint load
        "startup_s": (collected.ready_at or float("nan")) - started,
        "seconds_total": time.perf_counter() - started,
    }
    if report_path is not None:
        path = Path(report_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _add_sharing(profile_path: str, job: ElasticTrainingJob, threads: int) -> None:
    """Add the host's sharing probe (``tidal_agent.sharing``) to the profile the run wrote:
    copies of the profiled run at once, once its workers are gone.
    """
    path = Path(profile_path)
    profile = json.loads(path.read_text())
    layout = Layout(**profile["layout"])
    copies = sharing.sharing_copies(layout.world_size, threads)
    if not copies:
        return
    steps = sharing.WARMUP + sharing.STEPS
    # The copies train the job from its start, and keep no checkpoint.
    quiet = job.model_copy(update={"spec": job.spec.model_copy(update={
        "checkpoint": job.spec.checkpoint.model_copy(update={"every_steps": 0})})})

    def train() -> list[float]:
        report = run_local(quiet, layout, steps=steps, threads=threads)
        return [step["seconds"] for step in report["steps"][sharing.WARMUP:]]

    print(f"profile: timing shared cores ({copies} copies of the run at once, {steps} steps)...",
          file=sys.stderr, flush=True)
    profile["sharing"] = sharing.measure_sharing(train, copies)
    path.write_text(json.dumps(profile, indent=2) + "\n")


class _Collected(Listener):
    """What the workers' events say, as the run's report needs it; a failure stops the run."""

    def __init__(self, procs, on_step: StepCallback | None,
                 on_profile: Callable[[Profiled], None] | None = None) -> None:
        self.procs, self.on_step, self.on_profile = procs, on_step, on_profile
        self.steps: list[dict[str, Any]] = []
        self.reconfigurations: list[dict[str, Any]] = []
        self.releases: list[dict[str, Any]] = []
        self.checkpoints: list[dict[str, Any]] = []
        self.stragglers: list[dict[str, Any]] = []
        self.replans: list[dict[str, Any]] = []
        self.ready_at: float | None = None  # when the last worker reported ready
        self.profile: str | None = None  # where the leader wrote the first online profile
        self.profiles: list[dict[str, Any]] = []
        self.digests: dict[int, tuple[str, str]] = {}
        # the model's parameter count, as the final members said (the launcher builds no model:
        # even on the meta device, that imports torch._dynamo, 6-8 s of CPU)
        self.num_params = 0
        self.finished: set[str] = set()  # workers done or gone
        self.peak_rss: dict[str, int] = {}  # per worker that said, its peak resident bytes
        # per worker ready: where it trains (device, backend, transport, determinism)
        self.setup: dict[str, dict[str, Any]] = {}
        self.peak_gpu: dict[str, int | None] = {}
        self.peak_tensor: dict[str, int | None] = {}
        self.snapshot_bytes: dict[str, dict[str, int] | None] = {}

    def on_failed(self, event: Failed) -> None:
        lost = _lost_worker(self.procs, self.finished, besides=event.worker)
        _stop(self.procs)
        me = event.worker
        cause = f"{me} then failed: {event.error}" if lost else f"{me} failed: {event.error}"
        raise RunError(f"{lost + '; ' if lost else ''}{cause}\n{event.traceback}")

    def on_stepped(self, event: Stepped) -> None:
        record = event.record()
        self.steps.append(record)
        if self.on_step is not None:
            self.on_step(record)

    def on_reconfigured(self, event: Reconfigured) -> None:
        self.reconfigurations.append(event.record())

    def on_straggler(self, event: Straggler) -> None:
        self.stragglers.append(event.record())

    def on_replanned(self, event: Replanned) -> None:
        self.replans.append(event.record())

    def on_released(self, event: Released) -> None:
        self.releases.append({"worker": event.worker, **event.record()})

    def on_checkpointed(self, event: Checkpointed) -> None:
        self.checkpoints.append(event.record())

    def on_profiled(self, event: Profiled) -> None:
        self.profile = self.profile or event.path
        self.profiles.append({"path": event.path, "layout": event.layout.to_dict(),
                              "steps": list(event.steps)})
        if self.on_profile is not None:
            self.on_profile(event)

    def on_finished(self, event: Finished) -> None:
        self.digests.update(event.digests)
        self.num_params = event.num_params
        self._gone(event)

    def on_left(self, event: Left) -> None:
        self._gone(event)

    def _gone(self, event: Finished | Left) -> None:
        self.finished.add(event.worker)
        self.peak_rss[event.worker] = event.peak_rss_bytes
        self.peak_gpu[event.worker] = event.peak_gpu_bytes
        self.peak_tensor[event.worker] = event.peak_tensor_bytes
        self.snapshot_bytes[event.worker] = event.snapshot_bytes

    def on_ready(self, event: Ready) -> None:
        self.setup[event.worker] = event.record()
        if len(self.setup) == len(self.procs):
            self.ready_at = time.perf_counter()


def _collect(procs, events, on_step: StepCallback | None, timeout_s: float,
             on_profile: Callable[[Profiled], None] | None = None) -> _Collected:
    """Read worker events until every worker has finished or left; fail fast on any error."""
    out = _Collected(procs, on_step, on_profile)
    last_event = time.monotonic()
    while len(out.finished) < len(procs):
        try:
            event = events.get(timeout=0.5)
        except queue.Empty:
            _check_alive(procs, out.finished)
            if time.monotonic() - last_event > timeout_s:
                raise RunError(f"no progress from any worker for {timeout_s:.0f} s") from None
            continue
        last_event = time.monotonic()
        out.put(event)
    return out


def _lost_worker(procs, finished: set[str], *, besides: str, grace_s: float = 3.0) -> str | None:
    """A worker that died on its own: most errors a peer reports are the echo of such a loss."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        for me, proc in procs.items():
            if me != besides and me not in finished and proc.exitcode not in (None, 0, 1):
                return f"{me} exited with code {proc.exitcode} (lost)"
        time.sleep(0.05)
    return None


def _check_alive(procs, finished: set[str]) -> None:
    for me, proc in procs.items():
        if me not in finished and proc.exitcode is not None:
            _stop(procs)
            raise RunError(f"{me} exited with code {proc.exitcode} before finishing")


def _stop(procs) -> None:
    for proc in procs.values():
        if proc.is_alive():
            proc.terminate()


def layout_report(
    gens: list[Generation], layouts: list[Layout], steps: list[dict[str, Any]],
    predicted: list[float | None], predictor: str | None,
) -> list[dict[str, Any]]:
    """Per generation: its layout, the predicted and the measured (median) step seconds.

    The first step of each generation is left out of the median: it pays for the switch's
    cold caches, which the prediction of a steady step does not include.
    """
    out = []
    for i, (gen, lay) in enumerate(zip(gens, layouts, strict=True)):
        end = gens[i + 1].at_step if i + 1 < len(gens) else None
        seconds = sorted(
            s["seconds"] for s in steps
            if s["step"] > gen.at_step and (end is None or s["step"] < end)
        )
        measured = seconds[len(seconds) // 2] if seconds else None
        out.append({
            "at_step": gen.at_step,
            "workers": len(gen.members),
            "layout": lay.to_dict(),
            "predictor": predictor,
            "predicted_step_s": predicted[i],
            "measured_step_s": measured,
            "error": (predicted[i] / measured - 1) if predicted[i] and measured else None,
        })
    return out


def profile_accuracy(profiled: list[dict[str, Any]], steps: list[dict[str, Any]]
                     ) -> dict[str, Any]:
    """How well each online profile predicted its own layout: per profile (``layout``,
    ``steps`` [first, last) and ``predicted_s``), the median step seconds measured after its
    window for as long as that layout ran, and the error; their median and worst."""
    layouts = []
    for entry in profiled:
        after = []
        for step in steps:
            if step["step"] < entry["steps"][1]:
                continue
            if step["layout"] != entry["layout"]:
                if after:
                    break  # the next layout
                continue
            after.append(step["seconds"])
        if not after:
            continue
        measured = statistics.median(after)
        layouts.append({**entry, "measured_s": measured, "steps_measured": len(after),
                        "error": entry["predicted_s"] / measured - 1})
    errors = sorted(abs(e["error"]) for e in layouts)
    return {"layouts": layouts,
            "median_abs_error": statistics.median(errors) if errors else None,
            "worst_abs_error": errors[-1] if errors else None}


def loss_divergence(run: dict[str, Any], static: dict[str, Any]) -> dict[str, Any]:
    """How far a relaxed run's losses drifted from the static run's, step by step."""
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(run["steps"], static["steps"], strict=True)]
    return {
        "static_workers": static["workers"],
        "bitwise_equal": [s["loss_hex"] for s in run["steps"]]
        == [s["loss_hex"] for s in static["steps"]],
        "max_abs_loss_diff": max(diffs),
        "final_abs_loss_diff": diffs[-1],
        "max_rel_loss_diff": max(d / abs(b["loss"]) for d, b in zip(diffs, static["steps"])),
        "params_equal": run["params_sha256"] == static["params_sha256"],
    }
