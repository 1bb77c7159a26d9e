"""The transports a world's ranks talk through: one seam for everything that crosses ranks.

Point-to-point traffic is posted as *exchanges*: the sends and receives of one group, posted
together (torch's ``batch_isend_irecv``), matched with the peer's in posting order per pair and
direction, never by tag. Callers post the same groups at both ends of a pair, in an order both
derive from the same plan, which is what NCCL needs (tidal_plan.exchanges). Collectives
(all-reduce, all-to-all, all-gather) take tensors on the world's compute device.

- ``gloo``: CPU tensors, gloo. Tags are each pair's message counts, so gloo matches in order too.
- ``nccl``: one rank per GPU; an exchange is one coalesced NCCL group.
- ``host``: ranks compute on CUDA and talk over gloo through pinned host buffers, so several
  ranks may share one GPU (NCCL refuses two ranks on one device).
- ``nccl-model``: gloo carrying NCCL's rules, a test transport that makes NCCL's deadlocks
  happen on CPU: one ordered channel per pair for both directions (a rank's groups with a peer
  run one after the other), tags ignored, and a send done only once its receive is posted
  (the receiver's notice comes first). A group that waits longer than the timeout raises
  ``TransportDeadlock``.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from tidal_plan.gpus import TRANSPORTS


class TransportDeadlock(RuntimeError):
    """An exchange that NCCL could not run: it waited for a peer that waits for it."""


class P2P(NamedTuple):
    """One operation of an exchange: send ``tensor`` to ``peer``, or receive into it."""

    send: bool
    tensor: torch.Tensor
    peer: int


def send(tensor: torch.Tensor, peer: int) -> P2P:
    return P2P(True, tensor, peer)


def recv(tensor: torch.Tensor, peer: int) -> P2P:
    return P2P(False, tensor, peer)


class Posted:
    """A posted exchange: ``wait`` returns once all of its operations are done (on CUDA with
    NCCL, once the current stream waits for them)."""

    def __init__(self, waits: Sequence[Callable[[], None]] = ()) -> None:
        self._waits = list(waits)

    def wait(self) -> None:
        waits, self._waits = self._waits, []
        for wait in waits:
            wait()


class Transport:
    """Gloo, matched in order: each message of a pair's direction is tagged with its count."""

    name = "gloo"

    def __init__(self, pg: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
        self.pg, self.device, self.timeout_s = pg, device, timeout_s
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}

    def _tag(self, counts: dict[int, int], peer: int) -> int:
        count = counts.get(peer, 0)
        counts[peer] = count + 1
        return count % (1 << 30)

    def exchange(self, ops: Sequence[P2P]) -> Posted:
        works = []
        for op in ops:
            if op.send:
                works.append(self.pg.send([op.tensor], op.peer, self._tag(self._sent, op.peer)))
            else:
                works.append(self.pg.recv([op.tensor], op.peer,
                                          self._tag(self._received, op.peer)))
        return Posted([work.wait for work in works])

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.pg.allreduce([tensor]).wait()

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, out_sizes: list[int],
                   in_sizes: list[int]) -> None:
        self.pg.alltoall_base(out, tensor, out_sizes, in_sizes).wait()

    def all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        self.pg._allgather_base(out, tensor).wait()

    def close(self, *, abort: bool) -> None:
        """Let go of the group; ``abort``: it failed, so nothing in flight is waited for."""
        if abort:
            self.pg.abort()


class NcclTransport(Transport):
    """NCCL: an exchange is one coalesced group (``batch_isend_irecv``); tags are not used."""

    name = "nccl"

    def exchange(self, ops: Sequence[P2P]) -> Posted:
        if not ops:
            return Posted()
        self.pg._start_coalescing()
        for op in ops:
            (self.pg.send if op.send else self.pg.recv)([op.tensor], op.peer, 0)
        return Posted([self.pg._end_coalescing().wait])

    def close(self, *, abort: bool) -> None:
        # Aborted, a failed world's kernels end and its survivors' next wait raises; shut down,
        # a finished one frees its communicator now rather than at the process's exit.
        self.pg.abort() if abort else self.pg.shutdown()


class HostTransport(Transport):
    """CUDA compute, gloo through host buffers (pinned where CUDA is): several ranks may share
    a GPU. A send's tensor is copied to the host when posted; a receive lands in a host buffer
    and is copied to the device when waited for."""

    name = "host"

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype,
                           pin_memory=tensor.device.type == "cuda")

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._host(tensor).copy_(tensor)  # synchronous: the data is there when sent

    def exchange(self, ops: Sequence[P2P]) -> Posted:
        staged = [P2P(op.send, self._staged(op.tensor) if op.send else self._host(op.tensor),
                      op.peer) for op in ops]
        posted = super().exchange(staged)
        landed = [(op.tensor, host.tensor) for op, host in zip(ops, staged, strict=True)
                  if not op.send]

        def wait() -> None:
            posted.wait()
            for device, host in landed:
                device.copy_(host, non_blocking=True)

        return Posted([wait])

    def all_reduce(self, tensor: torch.Tensor) -> None:
        host = self._staged(tensor)
        super().all_reduce(host)
        tensor.copy_(host)

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, out_sizes: list[int],
                   in_sizes: list[int]) -> None:
        host = self._host(out)
        super().all_to_all(host, self._staged(tensor), out_sizes, in_sizes)
        out.copy_(host)

    def all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        host = self._host(out)
        super().all_gather_into(host, self._staged(tensor))
        out.copy_(host)


@dataclass(slots=True)
class _Part:
    """A group's operations with one peer, run by that pair's channel."""

    ops: list[P2P]
    done: threading.Event
    error: BaseException | None = None


class NcclModelTransport(Transport):
    """Gloo under NCCL's rules (see the module docstring). Each peer has a channel thread that
    runs this rank's groups with it one after the other. Running a group: every receive is
    posted and its notice (the receiving buffer's size) sent to the peer; then every send
    waits for its receive's notice and goes. So a send completes only once its receive is
    posted, two ends that both send first wait for each other, and a group waits at most the
    timeout for its peer."""

    name = "nccl-model"

    def __init__(self, pg: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
        super().__init__(pg, device, timeout_s)
        self._channels: dict[int, queue.SimpleQueue[_Part | None]] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False

    def exchange(self, ops: Sequence[P2P]) -> Posted:
        parts: dict[int, _Part] = {}
        for op in ops:
            parts.setdefault(op.peer, _Part([], threading.Event())).ops.append(op)
        for peer, part in parts.items():
            self._channel(peer).put(part)
        return Posted([lambda p=part, q=peer: self._wait(p, q) for peer, part in parts.items()])

    def _wait(self, part: _Part, peer: int) -> None:
        if not part.done.wait(self.timeout_s + 5):  # the channel's own waits time out first
            raise TransportDeadlock(f"nccl-model: a group with rank {peer} did not finish")
        if part.error is not None:
            raise part.error

    def _channel(self, peer: int) -> queue.SimpleQueue[_Part | None]:
        if peer not in self._channels:
            self._channels[peer] = queue.SimpleQueue()
            thread = threading.Thread(target=self._run, args=(peer, self._channels[peer]),
                                      name=f"tidal-nccl-model-{peer}", daemon=True)
            self._threads.append(thread)
            thread.start()
        return self._channels[peer]

    def _run(self, peer: int, parts: queue.SimpleQueue[_Part | None]) -> None:
        failed: BaseException | None = None
        while (part := parts.get()) is not None:
            if failed is None:
                try:
                    self._run_part(peer, part.ops)
                except BaseException as err:  # noqa: BLE001 - raised in the waiting thread
                    failed = err
            part.error = failed  # a broken channel fails every later group
            part.done.set()

    def _run_part(self, peer: int, ops: list[P2P]) -> None:
        timeout = timedelta(seconds=self.timeout_s)
        works = []
        for op in ops:
            if not op.send:
                index = self._tag(self._received, peer)
                works.append(self.pg.recv([op.tensor], peer, 2 * index))
                notice = torch.tensor([op.tensor.numel()], dtype=torch.int64)
                works.append(self.pg.send([notice], peer, 2 * index + 1))
        for op in ops:
            if op.send:
                index = self._tag(self._sent, peer)
                notice = torch.empty(1, dtype=torch.int64)
                try:
                    self.pg.recv([notice], peer, 2 * index + 1).wait(timeout)
                except RuntimeError as err:
                    raise TransportDeadlock(
                        f"nccl-model: message {index} to rank {peer} waited {self.timeout_s:.0f} "
                        f"s for its receive to be posted; under NCCL this exchange deadlocks "
                        f"(both ends posted a send the other has not reached a receive for)"
                    ) from err
                if int(notice) != op.tensor.numel():
                    raise RuntimeError(
                        f"nccl-model: message {index} to rank {peer} has {op.tensor.numel()} "
                        f"elements but its receive holds {int(notice)}: the ends disagree on "
                        "the order of their messages")
                works.append(self.pg.send([op.tensor], peer, 2 * index))
        for work in works:
            work.wait(timeout)

    def close(self, *, abort: bool) -> None:
        if self._closed:
            return
        self._closed = True
        for channel in self._channels.values():
            channel.put(None)
        if abort:
            self.pg.abort()


def build_transport(name: str, *, store: dist.Store, rank: int, size: int, timeout_s: float,
                    device: torch.device) -> Transport:
    """The process group of a world and its transport, connected now (NCCL's communicator
    too: built where the world is, never in a pause)."""
    timeout = timedelta(seconds=timeout_s)
    if name == "nccl":
        # On a timeout the watchdog aborts the communicator and the process lives on: the
        # survivors' next operation raises and they take the fault path (1, torch's default
        # on some versions, would end the process; read when the group is built).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout  # else NCCL's 10 minutes, whatever the run's timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, options)
        pg.eager_connect_single_device(device)
        return NcclTransport(pg, device, timeout_s)
    pg = dist.ProcessGroupGloo(store, rank, size, timeout)
    kinds = {"gloo": Transport, "host": HostTransport, "nccl-model": NcclModelTransport}
    if name not in kinds:
        raise ValueError(f"unknown transport {name!r}: expected one of {', '.join(TRANSPORTS)}")
    return kinds[name](pg, device, timeout_s)
