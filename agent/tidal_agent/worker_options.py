"""What a worker process is told to do (``WorkerOptions``), and where its online profiles
go: the launchers (``tidal run``'s runner, ``tidal agent``'s pod) build these, the worker reads
them (tidal_agent.worker)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from tidal_agent.optim import ClipMode
from tidal_agent.world import Rendezvous
from tidal_api.layout import Layout
from tidal_plan.elastic import Generation


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerOptions:
    rendezvous: Rendezvous
    steps: int
    generations: tuple[Generation, ...] = ()  # a static schedule (see StaticGenerations)
    layouts: tuple[Layout, ...] = ()  # one per generation
    threads: int = 1
    # The GPU this worker binds at its start (tidal_agent.devices.bind_gpu), counted among
    # those its launcher sees; None on the CPU, or where the process is bound already.
    gpu: int | None = None
    clip_mode: ClipMode = ClipMode.GLOBAL_ORDER
    resume_from: str | None = None  # a checkpoint directory
    checkpoint_root: str | None = None
    checkpoint_every: int = 0  # steps; 0: no periodic checkpoints
    peer_snapshots: bool = False  # copy the state to a ring neighbour (tidal_agent.snapshot)
    snapshot_every: int = 0  # steps between peer snapshots; 0: chosen from their measured cost
    bucket_bytes: int = 256 << 20  # in flight per worker during a reshard
    # Profile each generation's first steps online (profile_window from its start) and write
    # the first profile (JSON) here, the later ones beside it (profile_path).
    profile_out: str | None = None
    # The planner's seconds per placement unit (any scale: their ratios weigh a re-plan's
    # partition); none: the job does not re-plan around stragglers.
    unit_seconds: tuple[float, ...] = ()
    watch_stragglers: bool = True  # off: no layer times posted or judged (its cost, measured)
    # A test's deterministic stragglers: (worker, first step, end step, factor) each.
    slowdown: tuple[tuple[str, int, int, float], ...] = ()
    # Set when the pod is asked to stop (SIGTERM): a member other than the leader leaves at
    # the next step boundary, once its peer snapshot is with its keeper; the leader, which
    # hosts the rendezvous, halts the job there (its source says so: ``Halt``).
    stop: threading.Event | None = None
    # On a CPU: count the bytes of the tensors this worker allocates (measure.TensorMemory)
    # and report its steps' peak (Finished.peak_tensor_bytes). Every operator then goes
    # through Python: for a benchmark of the memory model, not a timed run.
    track_memory: bool = False


def profile_window(steps: int) -> tuple[int, int]:
    """The steps ``[first, last)`` a run of ``steps`` steps profiles: one with unit hooks, then
    plain ones. A fresh process runs its first steps slower (allocator, caches, the
    interpreter's specialisation: steps 2-5 were 10-40% over the later ones here), so a run long
    enough profiles steps 3-7; a shorter one profiles from step 1 (step 0 warms up)."""
    if steps < 3:
        raise ValueError(f"profiling needs at least 3 steps (a warm-up, a hooked and a plain "
                         f"one); the run has {steps}")
    last = min(8, steps)
    return max(1, last - 5), last


def profile_path(first: str, n: int) -> str:
    """Where the ``n``-th profile of a run goes (0: ``first``; then ``<stem>.<n><suffix>``)."""
    if n == 0:
        return first
    path = Path(first)
    return str(path.with_name(f"{path.stem}.{n}{path.suffix}"))
