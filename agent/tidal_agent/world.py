"""Communication worlds, one per generation of a job's membership.

A ``World`` is a process group over an ordered tuple of member ids, built directly on a
``PrefixStore`` of the job's long-lived rendezvous store (``gen<g>/<name>/``), and the
transport that carries its traffic (tidal_agent.transport). Unlike the default process group,
any number of worlds can exist at once, so the next generation's world can be built in a
background thread while the current one trains, and subgroups (the DP group of a pipeline
rank) need no participation from non-members. A world's communicators are all built where
the world is (NCCL's connected eagerly); a failed world is aborted (``abort_worlds``).

No default process group is ever joined: checkpoints agree through a world's own collectives
too (tidal_agent.checkpoint), so nothing of a generation is connected inside a switch's pause.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tidal_agent.measure import synchronize
from tidal_agent.transport import P2P, Posted, Transport, build_transport
from tidal_plan.gpus import compute_device


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendezvous:
    """Where the job's long-lived store is, and how long to wait on anything."""

    host: str
    port: int
    prefix: str
    timeout_s: float = 120.0
    # How the job's ranks talk (tidal_agent.transport): "gloo" (CPU), "nccl" (one rank per
    # GPU), "host" (CUDA compute, gloo through pinned host buffers: ranks may share a GPU) or
    # "nccl-model" (gloo under NCCL's rules, a test transport).
    transport: str = "gloo"

    @property
    def backend(self) -> str:
        """The torch.distributed backend under the transport."""
        return "nccl" if self.transport == "nccl" else "gloo"

    def connect(self) -> dist.Store:
        store = dist.TCPStore(
            self.host, self.port, is_master=False,
            timeout=timedelta(seconds=self.timeout_s), use_libuv=True,
        )
        return dist.PrefixStore(self.prefix, store)


@dataclass(eq=False)
class World:
    generation: int
    members: tuple[str, ...]
    rank: int
    transport: Transport
    store: dist.Store = field(repr=False)
    rendezvous: Rendezvous = field(repr=False)
    name: str = "train"  # with the generation, the world's store prefix: unique per world
    # A gloo group over the same members for background transfers through host memory (the
    # peer snapshots' swap): its own connections, so nothing of the training's queues behind
    # them, whatever the transport. Built with the world where asked (``build_world``).
    cpu: dist.ProcessGroup | None = field(default=None, repr=False)
    _subgroups: dict[str, World] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        _open.add(self)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def device(self) -> torch.device:
        """Where the tensors given to this world's exchanges and collectives must be: the
        ranks' compute device (the host transport stages them through host memory itself)."""
        return self.transport.device

    def _check(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            if tensor.device.type != self.device.type:
                raise ValueError(
                    f"a {tensor.device} tensor reached world {self.name}{self.generation} "
                    f"({self.transport.name}), whose tensors must be on {self.device}")

    def exchange(self, ops: Sequence[P2P]) -> Posted:
        """Post ``ops`` (sends and receives, to and from world ranks) as one group; the peer
        of each must post the matching group, its operations with this rank in the same order
        (tidal_agent.transport)."""
        self._check(*(op.tensor for op in ops))
        return self.transport.exchange(ops)

    def complete(self, ops: Sequence[P2P]) -> None:
        """Exchange ``ops`` and wait until they are done on the device too (NCCL's wait only
        orders the device's stream): what a message is timed by."""
        self.exchange(ops).wait()
        synchronize(self.device)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._check(tensor)
        self.transport.all_reduce(tensor)

    def all_to_all(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """Block ``i`` of ``tensor`` (split in ``size`` equal blocks) to rank ``i``; returns
        the blocks this rank got, in rank order (of ``sizes[i]`` elements from rank ``i``
        where the ranks send unequal amounts)."""
        self._check(tensor)
        if sizes is None:
            out = torch.empty_like(tensor)
            self.transport.all_to_all(out, tensor, [], [])
            return out
        out = tensor.new_empty(sum(sizes))
        self.transport.all_to_all(out, tensor, sizes, [tensor.numel() // self.size] * self.size)
        return out

    def all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        """Every rank's ``tensor``, in rank order, into ``out`` (``size`` times as long)."""
        self._check(out, tensor)
        self.transport.all_gather_into(out, tensor)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def subgroup(self, name: str, members: tuple[str, ...]) -> World:
        """A world over some of this world's members (every one of them must call this, in
        the same order as their other subgroups); built once, at its first call, which the
        world's builder makes for the next layout's subgroups (``WorldBuilder``'s
        ``prepare``), so none is built in a switch's pause."""
        if name not in self._subgroups:
            self._subgroups[name] = build_world(
                self.rendezvous, self.generation, members, self.members[self.rank],
                name=f"{self.name}.{name}", store=self.store)
        return self._subgroups[name]

    def close(self, *, abort: bool = False) -> None:
        """Let go of the world's groups, subgroups first. ``abort`` (the fault path): nothing
        in flight is waited for, and members still blocked on this one fail now rather than
        at the timeout."""
        with _closing:  # once, whichever thread comes first (a builder's, the fault path's)
            if self not in _open:
                return
            _open.discard(self)
        for sub in self._subgroups.values():
            sub.close(abort=abort)
        self.transport.close(abort=abort)
        if self.cpu is not None and abort:
            self.cpu.abort()
        if abort:  # let go: freed now, the groups close their connections (gloo's abort
            self.transport.pg = self.cpu = None  # does not), and peers fail at once


# Every world of this process not closed yet: the fault path aborts them all at once, and the
# worlds still being built as soon as they are.
_open: weakref.WeakSet[World] = weakref.WeakSet()
_building: weakref.WeakSet[WorldBuilder] = weakref.WeakSet()
_closing = threading.Lock()


def abort_worlds() -> int:
    """Abort every world this process holds (a member failed), and every world still being
    built once it is (``WorldBuilder.abandon``); how many were open."""
    for builder in list(_building):
        builder.abandon()
    worlds = list(_open)
    for world in worlds:
        world.close(abort=True)
    return len(worlds)


def _compute_device(transport: str) -> torch.device:
    """The compute device of a rank on ``transport`` (tidal_plan.gpus): its CUDA device,
    bound before, or the CPU. Host transport without CUDA computes on the CPU (its staging is
    then a plain copy: tests run it so)."""
    if compute_device(transport) == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_world(
    rendezvous: Rendezvous,
    generation: int,
    members: tuple[str, ...],
    me: str,
    *,
    name: str = "train",
    store: dist.Store | None = None,
    cpu_group: bool = False,
) -> World:
    """Join the world of ``members`` for ``generation``; blocks until every member joins and
    the communicators are up. ``cpu_group``: with a gloo group beside it (``World.cpu``),
    built now, where every member is, rather than later, when one may be lost."""
    if me not in members:
        raise ValueError(f"worker {me} is not a member of generation {generation}: {members}")
    store = store if store is not None else rendezvous.connect()
    prefixed = dist.PrefixStore(f"gen{generation}/{name}/", store)
    rank, size = members.index(me), len(members)
    transport = build_transport(rendezvous.transport, store=prefixed, rank=rank, size=size,
                                timeout_s=rendezvous.timeout_s,
                                device=_compute_device(rendezvous.transport))
    cpu = (dist.ProcessGroupGloo(dist.PrefixStore(f"gen{generation}/{name}.cpu/", store), rank,
                                 size, timedelta(seconds=rendezvous.timeout_s))
           if cpu_group else None)
    return World(generation=generation, members=members, rank=rank, transport=transport,
                 store=store, rendezvous=rendezvous, name=name, cpu=cpu)


class MemberGone(RuntimeError):
    """A member of a world being built is known dead (tidal_agent.presence): the world will
    never be whole, so nobody waits for it; the fault path takes over."""


class WorldBuilder:
    """Builds a world in a background thread, so training goes on meanwhile; ``prepare``
    then builds, in the same thread, the subgroups the world's layout will need."""

    def __init__(self, rendezvous: Rendezvous, generation: int, members: tuple[str, ...],
                 me: str, *, prepare: Callable[[World], None] | None = None, **kwargs) -> None:
        self.generation, self.members, self.me = generation, members, me
        self._result: World | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._abandoned = False
        _building.add(self)
        self._thread = threading.Thread(
            target=self._run, args=(prepare, rendezvous, generation, members, me),
            kwargs=kwargs, daemon=True)
        self.started = time.perf_counter()
        self._thread.start()

    def _run(self, prepare: Callable[[World], None] | None, *args, **kwargs) -> None:
        try:
            world = build_world(*args, **kwargs)
            if prepare is not None and not self._abandoned:
                prepare(world)
            with self._lock:
                self._result = world
                abandoned = self._abandoned
            if abandoned:
                world.close(abort=True)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            self._error = err
        finally:
            _building.discard(self)

    def abandon(self) -> None:
        """Nobody will use this world (the fault path, or a member died while it was built):
        aborted now if built, else as soon as it is. Left open, a world the other members
        finished building would hold them blocked on this one until the timeout."""
        with self._lock:
            self._abandoned = True
            world = self._result
        if world is not None:
            world.close(abort=True)

    def result(self, timeout_s: float,
               gone: Callable[[tuple[str, ...]], set[str]] = lambda members: set(),
               poll_s: float = 0.05) -> World:
        """The world, once built; ``MemberGone`` as soon as ``gone`` names one of the other
        members (its build is left to fail on its own), ``TimeoutError`` after ``timeout_s``."""
        others = tuple(m for m in self.members if m != self.me)
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive():
            if lost := gone(others):
                self.abandon()
                raise MemberGone(f"{', '.join(sorted(lost))} died while the world of "
                                 f"generation {self.generation} was built")
            if time.monotonic() > deadline:
                self.abandon()
                raise TimeoutError(f"building the world of generation {self.generation} took "
                                   f"more than {timeout_s:.0f} s")
            self._thread.join(poll_s)
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RuntimeError("the world builder finished without a world or an error")
        return self._result
