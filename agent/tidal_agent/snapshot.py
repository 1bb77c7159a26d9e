"""Peer snapshots (DESIGN.md section 2, Faults): a lost worker costs only the steps since the
newest complete snapshot.

At a snapshot boundary each member of a world copies its training state (everything
``Trainer.state_tensors`` holds: parameters, AdamW moments and step; data, learning rate and
dropout are functions of the step) into one flat buffer in host memory (pinned where the state
is on a GPU, for the copy out of it), and sends that copy to the next member of the world, its
*keeper* (``members[(rank + 1) % size]``, the rule of tidal_plan.keepers), while it receives
the copy of the member before it, its *ward*. So every member's state at that boundary lives
on two workers, and losing one worker (or several, none next to another in the ring) loses
none of it.

Only the copy holds training up: the swap runs in the background over a CPU group of its own
(``World.cpu``, so the pipeline's messages never queue behind it) while the next steps train,
and is waited for at the next snapshot, at a shrink that uses it, or on the fault path
(:meth:`PeerSnapshots.settle`). A ward's copy counts only once it has arrived whole.

Snapshots are taken at the first boundary of every world and then every ``interval`` steps
(:class:`Cadence`): ``checkpoint.snapshotEverySteps``, or by default an interval chosen at run
time from their measured cost, the fewest steps that keep it within ``BUDGET`` of the training
time (every member computes the same one from figures reduced over the world).

A worker keeps its two newest own copies and its ward's two newest complete ones. Two, because
the members of a failed step may stand at different boundaries: one that reached a snapshot
boundary (and took its copy) is a snapshot past a lost member that did not, whose newest copy
is the one before. A *cut* is one boundary of one world (generation, members, step); it is
whole when every member's copy at it survives, its own or its keeper's. The leader picks the
newest whole cut from the survivors' summaries (:func:`choose_cut`), and the survivors rebuild
the state of that step in their new layout with an ordinary reshard plan from the cut's
placement, in which a keeper sends for its lost ward (``senders``).

The price: four times the state's memory per worker, in host memory (two own copies, two of
the ward's), and one state-sized transfer per worker per snapshot. Only the own copies, which
the GPU copies into, are pinned; the ward's arrive over the CPU group into pageable memory. A
new copy takes the buffer of the oldest it replaces where that is large enough (a switch to a
layout with less state per worker allocates nothing), so the host memory held
(``host_bytes``, its peak ``peak_bytes``, in the run's report) stays within four copies of the
largest state the worker held, whatever the generations.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tidal_agent.world import World
from tidal_api.layout import Layout
from tidal_plan.reshard import Placement, TensorMeta

log = logging.getLogger("tidal.agent")

KEEP = 2  # copies of each kind: see the module docstring
BUDGET = 0.05  # the automatic interval's bound on snapshots' share of training time
MAX_INTERVAL = 50  # steps: the automatic interval's bound on what a fault replays
_TAG = 7_000_001  # the swap's P2P tag


@dataclass(frozen=True, kw_only=True, slots=True)
class Cut:
    """One step boundary of one world: where the survivors' state is rebuilt from.

    ``senders`` maps each lost member of the cut's world to the survivor (its keeper) that
    holds its copy and sends it in the member's place.
    """

    generation: int
    members: tuple[str, ...]
    layout: Layout
    step: int
    senders: Mapping[str, str]

    @property
    def key(self) -> tuple[int, int, tuple[str, ...], Layout]:
        # The layout too: a re-plan's boundary has two cuts of one generation and step, the
        # same state in two layouts.
        return (self.generation, self.step, self.members, self.layout)

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "members": list(self.members),
                "layout": self.layout.to_dict(), "step": self.step,
                "senders": dict(self.senders)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Cut:
        return cls(generation=data["generation"], members=tuple(data["members"]),
                   layout=Layout(**data["layout"]), step=data["step"],
                   senders=dict(data.get("senders", {})))


@dataclass(slots=True)
class _Copy:
    """A flat copy of one worker's state at one boundary, at the front of ``buffer`` (which may
    be larger: a reused one); ``index``: name -> (offset, numel)."""

    cut: Cut  # senders empty: where the copy was taken
    owner: str
    buffer: torch.Tensor
    index: dict[str, tuple[int, int]]

    @property
    def flat(self) -> torch.Tensor:
        return self.buffer[:sum(n for _, n in self.index.values())]

    def views(self) -> dict[str, torch.Tensor]:
        """The state by name, as 1-D views of the flat buffer."""
        return {name: self.buffer[o:o + n] for name, (o, n) in self.index.items()}

    def summary(self) -> dict[str, Any]:
        return {**self.cut.to_json(), "of": self.owner}


class Cadence:
    """Which step boundaries take a snapshot: the first of every world, then every ``every``
    steps, or, with ``every`` 0, every ``interval`` steps chosen from the measured cost.

    The cost of one snapshot is the time it held training up (the copy, and the wait for the
    previous swap) plus what the step after it, trained while the swap ran, took over a step
    without one. Every member reduces its figures over the world at each snapshot, so all
    choose the same interval: the fewest steps over which that cost stays within ``BUDGET`` of
    the training time, two while a figure is missing (so that a plain step gets measured).
    """

    def __init__(self, every: int = 0) -> None:
        if every < 0:
            raise ValueError(f"the snapshot interval must be at least 1 step, or 0 to choose it "
                             f"from the measured cost; got {every}")
        self.every = every
        self.interval = every or 1
        self._world: tuple[int, str] | None = None  # the newest snapshot's (world_key)
        self._next = 0
        self._after = False  # the next step trains beside the newest snapshot's swap
        self._overlapped: float | None = None
        self._plain: deque[float] = deque(maxlen=8)

    def due(self, world: World, step: int) -> bool:
        return world_key(world) != self._world or step >= self._next

    def stepped(self, seconds: float) -> None:
        """A step of ``seconds`` was trained."""
        if self._after:
            self._overlapped, self._after = seconds, False
        else:
            self._plain.append(seconds)

    def taken(self, world: World, step: int, held_s: float) -> None:
        """A snapshot was taken at ``step``, holding training up for ``held_s``; every member
        of ``world`` calls this at the same boundary."""
        if world_key(world) != self._world:  # another layout: other step times
            self._plain.clear()
            self._overlapped = None
        if self.every:
            self.interval = self.every
        else:
            self.interval = self._choose(world, held_s)
        self._world, self._next, self._after = world_key(world), step + self.interval, True

    def _choose(self, world: World, held_s: float) -> int:
        missing = self._overlapped is None or not self._plain
        plain = statistics.median(self._plain) if self._plain else 0.0
        cost = held_s + max(0.0, (self._overlapped or 0.0) - plain)
        figures = torch.tensor([float(missing), cost, -plain], dtype=torch.float64)
        world.cpu.allreduce([figures], _MAX).wait()
        missing, cost, plain = figures[0].item(), figures[1].item(), -figures[2].item()
        if missing or plain <= 0.0:
            return 2
        return max(1, min(MAX_INTERVAL, math.ceil(cost / (BUDGET * plain))))


_MAX = torch.distributed.AllreduceOptions()
_MAX.reduceOp = torch.distributed.ReduceOp.MAX


class _Swap:
    """One snapshot's exchange, in a background thread: this member's copy to its keeper, its
    ward's into ``ward`` (complete only once the thread ends without an error)."""

    def __init__(self, world: World, own: _Copy, ward: _Copy,
                 copied: torch.cuda.Event | None) -> None:
        self.ward = ward
        self.error: BaseException | None = None
        # Its keeper and its ward: the two members whose loss can leave it waiting.
        self.peers = tuple({world.members[(world.rank + 1) % world.size],
                            world.members[(world.rank - 1) % world.size]})
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(world, own.flat, copied),
                                        name="tidal-snapshot-swap", daemon=True)
        self._thread.start()

    def _run(self, world: World, flat: torch.Tensor, copied: torch.cuda.Event | None) -> None:
        started = time.perf_counter()
        try:
            if copied is not None:
                copied.synchronize()  # the copy out of GPU memory, queued at the boundary
            works = [world.cpu.send([flat], (world.rank + 1) % world.size, _TAG),
                     world.cpu.recv([self.ward.flat], (world.rank - 1) % world.size, _TAG)]
            for work in works:
                work.wait()
        except BaseException as err:  # noqa: BLE001 - raised in the training thread (settle)
            self.error = err
        self.seconds = time.perf_counter() - started

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, gone: Callable[[tuple[str, ...]], set[str]] | None = None,
             poll_s: float = 0.05) -> BaseException | None:
        """Wait for the swap to end; its error, if any. With ``gone``, not past the moment it
        names a peer: a gloo operation whose peer died does not always fail (seen: a swap
        blocked to its 120 s timeout on the fault path), so its copy is given up instead."""
        while self._thread.is_alive():
            if gone is not None and (lost := gone(self.peers)):
                return RuntimeError(f"{', '.join(sorted(lost))} died during the swap")
            self._thread.join(poll_s)
        return self.error


class PeerSnapshots:
    """One worker's own copies and its ward's, taken at the boundaries ``cadence`` says."""

    def __init__(self, metas: Sequence[TensorMeta], device: torch.device, *,
                 every: int = 0) -> None:
        self.metas = tuple(metas)
        self.device = device  # the training state's; the copies are in host memory
        self.cadence = Cadence(every)
        self.own: list[_Copy] = []  # oldest first
        self.ward: list[_Copy] = []
        self.seconds = 0.0  # the newest snapshot's hold on training (copy, and the settle)
        self.swap_s = 0.0  # the newest settled swap's, in the background
        self._swap: _Swap | None = None
        self.peak_bytes = {"pinned": 0, "pageable": 0}  # the most host_bytes held so far
        self._newest: tuple[tuple[int, str], int] | None = None  # (world_key, step)
        self._indexes: dict[tuple[Layout, tuple[str, ...], str], dict[str, tuple[int, int]]] = {}

    def due(self, world: World, step: int) -> bool:
        return self.cadence.due(world, step)

    def holds(self, world: World, step: int) -> bool:
        """Whether a snapshot of ``world`` was taken at ``step``."""
        return self._newest == (world_key(world), step)

    @property
    def swapping(self) -> bool:
        """Whether a swap is still under way (for a fault's report)."""
        return self._swap is not None and self._swap.running

    def take(self, world: World, generation: int, layout: Layout, step: int,
             state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` (this worker's, ``step`` steps done) and start swapping copies with
        the neighbours in ``world``'s ring; every member calls it at the same boundary."""
        started = time.perf_counter()
        self.settle()
        me = world.members[world.rank]
        cut = Cut(generation=generation, members=world.members, layout=layout, step=step,
                  senders={})
        index = self._index(layout, world.members, me)
        if set(index) != set(state):
            raise ValueError(f"{me} holds {sorted(set(state) ^ set(index))[:3]}... unlike its "
                             f"position in {layout.describe()}")
        own = self._slot(self.own, cut, me, index, pinned=self.device.type == "cuda")
        for name, (offset, numel) in index.items():
            own.buffer[offset:offset + numel].copy_(state[name].reshape(-1), non_blocking=True)
        copied = None
        if self.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        self.own.append(own)
        if world.size > 1:
            ward_name = world.members[(world.rank - 1) % world.size]
            ward = self._slot(self.ward, cut, ward_name,
                              self._index(layout, world.members, ward_name), pinned=False)
            self._swap = _Swap(world, own, ward, copied)
        elif copied is not None:
            copied.synchronize()
        for kind, held in self.host_bytes().items():
            self.peak_bytes[kind] = max(self.peak_bytes[kind], held)
        self._newest = (world_key(world), step)
        self.seconds = time.perf_counter() - started
        self.cadence.taken(world, step, self.seconds)

    def stepped(self, seconds: float) -> None:
        """A step of ``seconds`` was trained (for the automatic interval)."""
        self.cadence.stepped(seconds)

    def settle(self, gone: Callable[[tuple[str, ...]], set[str]] | None = None) -> None:
        """Wait for the swap under way, if any: from now on the ward's copy counts. A swap
        that failed (a neighbour lost, or, with ``gone``, one it names) raises, its copy of
        the ward discarded."""
        swap, self._swap = self._swap, None
        if swap is None:
            return
        error = swap.join(gone)
        self.swap_s = swap.seconds
        if error is not None:
            raise RuntimeError(f"the peer snapshot swap failed: {error}") from error
        self.ward.append(swap.ward)

    def _index(self, layout: Layout, members: tuple[str, ...],
               worker: str) -> dict[str, tuple[int, int]]:
        """Where each tensor ``worker`` holds sits in its flat copy (once per generation)."""
        key = (layout, members, worker)
        if key not in self._indexes:
            self._indexes[key] = state_index(self.metas, Placement(layout=layout,
                                                                   workers=members), worker)
        return self._indexes[key]

    def _slot(self, copies: list[_Copy], cut: Cut, owner: str,
              index: dict[str, tuple[int, int]], *, pinned: bool) -> _Copy:
        """A buffer for a new copy: the front of the oldest one's if that is large enough (it
        stops being a copy from now on), else a fresh one (``pinned`` or pageable, the oldest
        freed); the list keeps at most ``KEEP - 1`` others."""
        numel = sum(n for _, n in index.values())
        old = copies.pop(0) if len(copies) >= KEEP else None
        if old is not None and old.buffer.numel() >= numel:
            buffer = old.buffer
        else:
            buffer = torch.empty(numel, dtype=torch.float32, pin_memory=pinned)
        return _Copy(cut=cut, owner=owner, buffer=buffer, index=index)

    def host_bytes(self) -> dict[str, int]:
        """The host memory the copies held now take (a swap's ward under way too), pinned and
        pageable."""
        copies = self.own + self.ward + ([self._swap.ward] if self._swap is not None else [])
        buffers = {id(c.buffer): c.buffer for c in copies}.values()
        held = {"pinned": 0, "pageable": 0}
        for buffer in buffers:
            held["pinned" if buffer.is_pinned() else "pageable"] += buffer.nbytes
        return held

    def summary(self) -> dict[str, Any]:
        """What this worker holds, for the leader's :func:`choose_cut` (JSON)."""
        return {"own": [c.summary() for c in self.own], "ward": [c.summary() for c in self.ward]}

    def held(self, cut: Cut, me: str) -> tuple[dict[str, torch.Tensor] | None,
                                                 dict[str, dict[str, torch.Tensor]]]:
        """This worker's own state at ``cut`` (None if it was no member) and the states it
        sends for lost members, by member."""
        own = next((c.views() for c in self.own if c.cut.key == cut.key), None)
        if me in cut.members and own is None:
            raise RuntimeError(f"{me} holds no copy of step {cut.step} of generation "
                               f"{cut.generation}, yet the cut needs it")
        held = {}
        for lost, sender in cut.senders.items():
            if sender == me:
                copy = next((c for c in self.ward if c.cut.key == cut.key and c.owner == lost),
                            None)
                if copy is None:
                    raise RuntimeError(f"{me} holds no copy of {lost} at step {cut.step}")
                held[lost] = copy.views()
        return own, held

    def clear(self) -> None:
        """Forget every copy (of a world that is gone); a swap under way is waited out."""
        swap, self._swap = self._swap, None
        if swap is not None:
            swap.join()
        self._newest = None
        self.own.clear()
        self.ward.clear()


def world_key(world: World) -> tuple[int, str]:
    """A world's identity that holds no reference to it (its process groups must close when
    the fault path drops it): its generation and name, its store prefix."""
    return (world.generation, world.name)


def state_index(metas: Sequence[TensorMeta], placement: Placement,
                worker: str) -> dict[str, tuple[int, int]]:
    """The state tensors ``worker`` holds in ``placement``, in global order, as name ->
    (offset, numel) in one flat buffer."""
    index, offset = {}, 0
    for meta in metas:
        if meta.unit is None or worker in placement.holders(meta.unit):
            index[meta.name] = (offset, meta.numel)
            offset += meta.numel
    return index


def choose_cut(summaries: Mapping[str, Mapping[str, Any]]) -> Cut | None:
    """The newest whole cut the survivors hold, given each survivor's ``summary()``.

    A cut is whole when every member of its world is a survivor holding its own copy at it, or
    a lost member whose copy a survivor holds. Newest: the most steps done, then the newest
    generation (two cuts at one switch boundary hold the same state). None if there is none.
    """
    own: dict[tuple, set[str]] = {}
    kept: dict[tuple, dict[str, str]] = {}  # cut -> lost member -> keeper
    found: dict[tuple, Mapping[str, Any]] = {}
    for pod, summary in summaries.items():
        for copy in summary.get("own", ()):
            key = _key(copy)
            own.setdefault(key, set()).add(pod)
            found.setdefault(key, copy)
        for copy in summary.get("ward", ()):
            kept.setdefault(_key(copy), {}).setdefault(copy["of"], pod)
    for key in sorted(found, key=lambda k: (k[1], k[0]), reverse=True):
        generation, step, members, _ = key
        senders = {}
        for member in members:
            if member in summaries:
                if member not in own.get(key, ()):
                    break
            elif member in kept.get(key, {}):
                senders[member] = kept[key][member]
            else:
                break
        else:
            return Cut.from_json({**found[key], "senders": senders})
    return None


def _key(copy: Mapping[str, Any]) -> tuple[int, int, tuple[str, ...], Layout]:
    return (copy["generation"], copy["step"], tuple(copy["members"]), Layout(**copy["layout"]))


def agree_on_files(path: Path, me: str, survivors: Sequence[str], held: Mapping[str, Any],
                   wait_s: float, poll_s: float) -> tuple[Cut, Any] | None:
    """The survivors' agreement on a cut without the rendezvous store: each writes its
    ``summary()`` (``held``) into a FileStore at ``path`` and waits up to ``wait_s`` for the
    others'. The newest whole cut (:func:`choose_cut`) and the store, to build the cut's world
    on; None where a survivor did not report in time or no cut is whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    store = dist.FileStore(str(path), -1)
    store.set(f"at/{me}", json.dumps(held))
    deadline = time.monotonic() + wait_s
    while not store.check([f"at/{p}" for p in survivors]):
        if time.monotonic() > deadline:
            missing = [p for p in survivors if not store.check([f"at/{p}"])]
            log.error("no rescue: %s did not report within %.0f s", missing, wait_s)
            return None
        time.sleep(poll_s)
    cut = choose_cut({p: json.loads(store.get(f"at/{p}")) for p in survivors})
    if cut is None:
        log.error("no rescue: the peer snapshots of %s hold no whole boundary", list(survivors))
        return None
    return cut, store
