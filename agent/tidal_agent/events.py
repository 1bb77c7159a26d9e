"""What a worker reports while it trains: one record per kind of event, and their one reader.

A worker puts its events on anything with ``put`` (an ``EventSink``): a multiprocessing queue
to the local launcher (tidal_agent.runner), or the leader's ``AgentReport`` in its own process
(tidal_agent.report). The leader (``worker-0``, rank 0 of every world) reports steps, switches,
recoveries, checkpoints and the profile; every worker reports when it is ready and when it
leaves, and a final member its parameter digests.

Every record names the ``worker`` it comes from; those that go into a run's JSON report give
that entry with ``record()``, field for field. A consumer subclasses ``Listener`` and overrides
the kinds it reads: ``Listener.put`` is the one place that tells the kinds apart.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from typing import Any, Protocol

from tidal_api.layout import Layout


@dataclass(frozen=True, kw_only=True, slots=True)
class Ready:
    """The worker has built its world and trainer: ``step`` is where it starts (None: a
    joiner, waiting in standby for the old members). It says where it computes (``device``:
    "cpu" or "cuda: <the GPU's name>"), how it talks (``transport``, over torch.distributed's
    ``backend``) and the determinism settings it made (tidal_agent.devices.set_determinism)."""

    worker: str
    step: int | None
    device: str = "cpu"
    transport: str = "gloo"
    backend: str = "gloo"
    determinism: dict[str, Any] = field(default_factory=dict)
    peak_rss_bytes: int = 0

    def record(self) -> dict[str, Any]:
        """The run's report's keys on where and how its workers train."""
        return {"device": self.device, "backend": self.backend, "transport": self.transport,
                "determinism": self.determinism}


@dataclass(frozen=True, kw_only=True, slots=True)
class Stepped:
    """The leader trained a step."""

    worker: str
    step: int
    loss: float
    loss_hex: str  # float.hex of the loss: compared bit for bit
    grad_norm: float
    lr: float
    seconds: float
    snapshot_s: float | None  # the boundary's swap of peer snapshots (None: they are off)
    layout: Layout
    watch_s: float | None = None  # the boundary's straggler watch (None: it is off)
    speeds: dict[str, float] = field(default_factory=dict)  # per member, to the fastest
    # The graphs the leader's process has compiled so far (None: units run eagerly): a step
    # that compiled something raises it, a live switch to shapes compiled before does not.
    compiled_graphs: int | None = None

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "loss": self.loss, "loss_hex": self.loss_hex,
                "grad_norm": self.grad_norm, "lr": self.lr, "seconds": self.seconds,
                "snapshot_s": self.snapshot_s, "watch_s": self.watch_s, "speeds": self.speeds,
                "compiled_graphs": self.compiled_graphs, "layout": self.layout.to_dict()}


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpointed:
    """The leader saved a periodic checkpoint (every member saved its part)."""

    worker: str
    path: str
    step: int
    seconds: float

    def record(self) -> dict[str, Any]:
        return {"path": self.path, "step": self.step, "seconds": self.seconds}


@dataclass(frozen=True, kw_only=True, slots=True)
class Profiled:
    """The leader wrote the online profile (JSON) of ``layout``'s steps ``[first, last)`` to
    ``path``."""

    worker: str
    path: str
    layout: Layout
    steps: tuple[int, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class Reconfigured:
    """The leader switched to generation ``generation`` at ``at_step``: its timings and bytes."""

    worker: str
    at_step: int
    generation: int
    members: tuple[str, ...]
    from_layout: Layout
    to_layout: Layout
    workers: tuple[int, int]  # before and after
    pause_s: float  # the end of the last old step to the end of the switch
    world_s: float  # waiting for the new world (built while the old one trained)
    rebuild_s: float  # the new trainer
    transfer_s: float
    bytes_moved: int
    bytes_min: int
    buckets: int
    released_at_once: bool  # the leavers went at the boundary, their keepers sending
    peak_gpu_bytes: int | None = None  # the leader's GPU during the switch (None: a CPU)

    def record(self) -> dict[str, Any]:
        return {"at_step": self.at_step, "generation": self.generation,
                "members": list(self.members), "from": self.from_layout.to_dict(),
                "to": self.to_layout.to_dict(), "workers": list(self.workers),
                "pause_s": self.pause_s, "world_s": self.world_s, "rebuild_s": self.rebuild_s,
                "transfer_s": self.transfer_s, "bytes_moved": self.bytes_moved,
                "bytes_min": self.bytes_min, "buckets": self.buckets,
                "released_at_once": self.released_at_once, "peak_gpu_bytes": self.peak_gpu_bytes}


@dataclass(frozen=True, kw_only=True, slots=True)
class Straggler:
    """The leader flagged ``member`` as a straggler at ``step`` (``flagged``), or cleared it."""

    worker: str
    member: str
    step: int
    flagged: bool
    slowdown: float  # its seconds per decoder layer over the median of the others'
    release: bool = False  # the job is predicted faster without it: the operator may drop it

    def record(self) -> dict[str, Any]:
        return {"member": self.member, "step": self.step, "flagged": self.flagged,
                "slowdown": self.slowdown, "release": self.release}


@dataclass(frozen=True, kw_only=True, slots=True)
class Replanned:
    """The leader re-partitioned the units for the members' measured speeds at ``step``: the
    same members switch to ``to_layout`` at ``at_step``."""

    worker: str
    step: int
    at_step: int
    from_layout: Layout
    to_layout: Layout
    speeds: dict[str, float]  # per member, relative to the typical one
    gain: float  # the slowest rank's time, predicted: before over after, minus 1

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "at_step": self.at_step, "from": self.from_layout.to_dict(),
                "to": self.to_layout.to_dict(), "speeds": self.speeds, "gain": self.gain}


@dataclass(frozen=True, kw_only=True, slots=True)
class Released:
    """A shrink let the worker go at ``at_step``: how long after the end of its last step it
    was free (None: it trained no step)."""

    worker: str
    at_step: int
    release_s: float | None
    snapshot_s: float  # of which the boundary's swap of peer snapshots took

    def record(self) -> dict[str, Any]:
        return {"at_step": self.at_step, "release_s": self.release_s,
                "snapshot_s": self.snapshot_s}


@dataclass(frozen=True, kw_only=True, slots=True)
class Recovered:
    """The survivors of a fault (the leader reports) go on from ``resumed_at``."""

    worker: str
    failed_at: int
    resumed_at: int
    snapshot: bool  # from the peer snapshots
    checkpoint: str | None  # else from this checkpoint; neither: from step 0
    lost: tuple[str, ...]
    left: tuple[str, ...]  # of the lost, those that left when asked to stop
    generation: int
    members: tuple[str, ...]
    layout: Layout
    pause_s: float  # the failure to training again
    swapping: bool = False  # the leader's peer snapshot swap was under way at the failure

    def record(self) -> dict[str, Any]:
        return {"failed_at": self.failed_at, "resumed_at": self.resumed_at,
                "swapping": self.swapping,
                "snapshot": self.snapshot, "checkpoint": self.checkpoint,
                "lost": list(self.lost), "left": list(self.left),
                "generation": self.generation, "members": list(self.members),
                "layout": self.layout.to_dict(), "pause_s": self.pause_s}


@dataclass(frozen=True, kw_only=True, slots=True)
class Halted:
    """The job halted at ``step`` (its leader was asked to stop), saved in ``checkpoint``."""

    worker: str
    step: int
    checkpoint: str | None  # None: the job has no checkpoint path

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "checkpoint": self.checkpoint}


@dataclass(frozen=True, kw_only=True, slots=True)
class Finished:
    """A final member trained the last step: the digests of the parameters it holds."""

    worker: str
    digests: dict[int, tuple[str, str]]  # global index -> (name, sha256)
    num_params: int  # the whole model's parameters, of which ``digests`` holds this member's
    peak_rss_bytes: int = 0  # the process's peak resident memory
    peak_gpu_bytes: int | None = None  # its GPU's peak allocated memory (None: a CPU)
    snapshot_bytes: dict[str, int] | None = None  # peer snapshots' peak host memory (None: off)
    # its steps' peak of live CPU tensor bytes (WorkerOptions.track_memory; None: not tracked)
    peak_tensor_bytes: int | None = None


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports kibibytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class Left:
    """The worker left at the boundary before ``step`` (None: from standby)."""

    worker: str
    step: int | None
    peak_rss_bytes: int = 0
    peak_gpu_bytes: int | None = None  # as Finished's
    snapshot_bytes: dict[str, int] | None = None
    peak_tensor_bytes: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Failed:
    """The worker process failed (the local launcher's workers only)."""

    worker: str
    error: str  # type and message
    traceback: str


WorkerEvent = (Ready | Stepped | Checkpointed | Profiled | Reconfigured | Straggler | Replanned
               | Released | Recovered | Halted | Finished | Left | Failed)


class EventSink(Protocol):
    """Where a worker puts its events."""

    def put(self, event: WorkerEvent) -> None: ...


class Listener:
    """A reader of worker events: one method per kind (``on_<kind>``), each ignoring its event
    unless a subclass overrides it."""

    def put(self, event: WorkerEvent) -> None:
        match event:
            case Ready():
                self.on_ready(event)
            case Stepped():
                self.on_stepped(event)
            case Checkpointed():
                self.on_checkpointed(event)
            case Profiled():
                self.on_profiled(event)
            case Reconfigured():
                self.on_reconfigured(event)
            case Straggler():
                self.on_straggler(event)
            case Replanned():
                self.on_replanned(event)
            case Released():
                self.on_released(event)
            case Recovered():
                self.on_recovered(event)
            case Halted():
                self.on_halted(event)
            case Finished():
                self.on_finished(event)
            case Left():
                self.on_left(event)
            case Failed():
                self.on_failed(event)
            case _:
                raise TypeError(f"not a worker event: {event!r}")

    def on_ready(self, event: Ready) -> None: ...

    def on_stepped(self, event: Stepped) -> None: ...

    def on_checkpointed(self, event: Checkpointed) -> None: ...

    def on_profiled(self, event: Profiled) -> None: ...

    def on_reconfigured(self, event: Reconfigured) -> None: ...

    def on_straggler(self, event: Straggler) -> None: ...

    def on_replanned(self, event: Replanned) -> None: ...

    def on_released(self, event: Released) -> None: ...

    def on_recovered(self, event: Recovered) -> None: ...

    def on_halted(self, event: Halted) -> None: ...

    def on_finished(self, event: Finished) -> None: ...

    def on_left(self, event: Left) -> None: ...

    def on_failed(self, event: Failed) -> None: ...
