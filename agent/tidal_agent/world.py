"""Communication worlds, one per generation of a job's membership.

A ``World`` is a process group over an ordered tuple of member ids, built directly on a
``PrefixStore`` of the job's long-lived rendezvous store (``gen<g>/<name>/``). Unlike the
default process group, any number of worlds can exist at once, so the next generation's world
can be built in a background thread while the current one trains, and subgroups (the DP group
of a pipeline rank) need no participation from non-members.

Checkpoints go through torch.distributed.checkpoint, which wants the default process group:
``ensure_default_group`` (re)initialises it for a generation: the worker does so as it builds
the generation's trainer, where every member is (see ``Worker._trainer``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


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
    pg: dist.ProcessGroup
    store: dist.Store = field(repr=False)
    rendezvous: Rendezvous = field(repr=False)
    name: str = "train"  # with the generation, the world's store prefix: unique per world
    # A gloo group over the same members for background transfers through host memory (the
    # peer snapshots' swap): its own connections, so nothing of the training's queues behind
    # them, whatever the backend. Built with the world where asked (``build_world``).
    cpu: dist.ProcessGroup | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def device(self) -> torch.device:
        """Where the tensors this world's group sends and receives must be."""
        if self.rendezvous.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        return self.pg.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        return self.pg.recv([tensor], src, tag)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.pg.allreduce([tensor]).wait()

    def all_to_all(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """Block ``i`` of ``tensor`` (split in ``size`` equal blocks) to rank ``i``; returns
        the blocks this rank got, in rank order (of ``sizes[i]`` elements from rank ``i``
        where the ranks send unequal amounts)."""
        if sizes is None:
            out = torch.empty_like(tensor)
            self.pg.alltoall_base(out, tensor, [], []).wait()
            return out
        out = tensor.new_empty(sum(sizes))
        self.pg.alltoall_base(out, tensor, sizes, [tensor.numel() // self.size] * self.size
                              ).wait()
        return out

    def all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        """Every rank's ``tensor``, in rank order, into ``out`` (``size`` times as long)."""
        self.pg._allgather_base(out, tensor).wait()

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))

    def subgroup(self, name: str, members: tuple[str, ...]) -> World:
        """A world over some of this world's members (every one of them must call this)."""
        return build_world(self.rendezvous, self.generation, members, self.members[self.rank],
                           name=f"{self.name}.{name}", store=self.store)


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
    """Join the world of ``members`` for ``generation``; blocks until every member joins.
    ``cpu_group``: with a gloo group beside it (``World.cpu``), built now, where every member
    is, rather than later, when one may be lost."""
    if me not in members:
        raise ValueError(f"worker {me} is not a member of generation {generation}: {members}")
    store = store if store is not None else rendezvous.connect()
    prefixed = dist.PrefixStore(f"gen{generation}/{name}/", store)
    rank, size = members.index(me), len(members)
    timeout = timedelta(seconds=rendezvous.timeout_s)
    if rendezvous.backend == "nccl":
        pg = dist.ProcessGroupNCCL(prefixed, rank, size)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    cpu = (dist.ProcessGroupGloo(dist.PrefixStore(f"gen{generation}/{name}.cpu/", store), rank,
                                 size, timeout) if cpu_group else None)
    return World(generation=generation, members=members, rank=rank, pg=pg, store=store,
                 rendezvous=rendezvous, name=name, cpu=cpu)


class WorldBuilder:
    """Builds a world in a background thread, so training goes on meanwhile."""

    def __init__(self, *args, **kwargs) -> None:
        self._result: World | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=args, kwargs=kwargs, daemon=True)
        self.started = time.perf_counter()
        self._thread.start()

    def _run(self, *args, **kwargs) -> None:
        try:
            self._result = build_world(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            self._error = err

    def result(self, timeout_s: float) -> World:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"building the next world took more than {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RuntimeError("the world builder finished without a world or an error")
        return self._result


_default_world: tuple[int, str] | None = None  # (generation, name) of the default group's world


def ensure_default_group(world: World) -> None:
    """Make the default process group this world's, for APIs that need it (DCP)."""
    global _default_world
    if _default_world == (world.generation, world.name) and dist.is_initialized():
        return
    drop_default_group()
    dist.init_process_group(
        world.rendezvous.backend,
        store=dist.PrefixStore(f"gen{world.generation}/{world.name}-default/", world.store),
        rank=world.rank,
        world_size=world.size,
        timeout=timedelta(seconds=world.rendezvous.timeout_s),
    )
    _default_world = (world.generation, world.name)


def drop_default_group() -> None:
    """Destroy the default process group, if any (its world is over or broken)."""
    global _default_world
    if dist.is_initialized():
        dist.destroy_process_group()
    _default_world = None
