"""Presence: a member's death noticed from the connection that breaks, not from its silence.

Every pod of a job holds one TCP connection to the job's presence server, on the host of the
rendezvous store, for as long as it lives. A process that dies (SIGKILL, an OOM kill, its pod
deleted, its node gone with a reset) has its sockets closed by the kernel, so the server reads
the end of that connection at once and records ``gone/<pod>`` in the store, where every member
looks (``Presence``): the leader's fault path counts it lost without waiting for its heartbeat
to fall silent, and a member waiting for a world to be built stops waiting for a pod that will
never join it. The heartbeat (tidal_agent.generations) stays the backstop: a process that hangs
(SIGSTOP, a wedged driver) keeps its socket open.

A pod says its name and its registration number (``pod/<pod>``) on connecting. The server
appends each end to the store (``gone/count``, then ``gone/<n>``: the pod and that number), and
a pod counts as gone only while that number is still its registration, so a pod that left and
registered again under the same name is not gone by its old connection's end. The server's
port is in the store under ``presence``.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger("tidal.agent")

PORT_KEY = "presence"
COUNT_KEY = "gone/count"  # how many connections have ended: a cheap test for news


class PresenceServer:
    """Accepts each pod's connection and marks the pod gone in ``store`` when it ends. One
    thread, one selector; ``close`` stops it."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        dual = socket.has_dualstack_ipv6()  # every interface, IPv4 and IPv6 alike
        self._listener = socket.create_server(
            ("", 0), family=socket.AF_INET6 if dual else socket.AF_INET, dualstack_ipv6=dual)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._said: dict[socket.socket, bytes] = {}  # connection -> what it said so far
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tidal-presence", daemon=True)
        self._thread.start()
        store.set(PORT_KEY, str(self.port))

    def _serve(self) -> None:
        while not self._closed.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                if key.fileobj is self._listener:
                    with contextlib.suppress(BlockingIOError):
                        conn, _ = self._listener.accept()
                        conn.setblocking(False)
                        self._said[conn] = b""
                        self._selector.register(conn, selectors.EVENT_READ)
                else:
                    self._read(key.fileobj)

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""  # reset: ended as surely as closed
        if data:
            self._said[conn] += data
            return
        said = self._said.pop(conn)
        self._selector.unregister(conn)
        conn.close()
        pod, _, registered = said.decode(errors="replace").partition("\n")[0].partition(" ")
        if pod and not self._closed.is_set():
            self._mark(pod, registered)

    def _mark(self, pod: str, registered: str) -> None:
        try:
            n = self.store.add(COUNT_KEY, 1)
            self.store.set(f"gone/{n}", f"{pod} {registered}")
        except RuntimeError as err:  # the store is going down: the job is over
            log.debug("presence: cannot mark %s gone: %s", pod, err)
            return
        log.info("%s is gone: its connection ended", pod)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        for conn in list(self._said):
            conn.close()
        self._selector.close()
        self._listener.close()


class Presence:
    """One pod's side: its connection to the server (held until ``close`` or the process's
    end), and what the store says of the others."""

    def __init__(self, store: dist.Store, host: str) -> None:
        self.store, self.host = store, host
        self._conn: socket.socket | None = None
        self._count = 0  # the ends read so far
        self._ended: dict[str, str] = {}  # pod -> the registration whose connection ended

    def announce(self, pod: str, registered: int, *, timeout_s: float = 30.0) -> None:
        """Connect and say who this pod is. Waits for the server's port (the leader publishes
        it as it starts the store)."""
        self.store.wait([PORT_KEY], timedelta(seconds=timeout_s))
        port = int(self.store.get(PORT_KEY))
        conn = socket.create_connection((self.host, port), timeout=timeout_s)
        conn.sendall(f"{pod} {registered}\n".encode())
        conn.settimeout(None)
        self._conn = conn

    def gone(self, pods: Iterable[str]) -> set[str]:
        """Those of ``pods`` whose connection ended, unless they registered again since. One
        store round trip where nothing new happened."""
        count = self.store.add(COUNT_KEY, 0)
        for n in range(self._count + 1, count + 1):
            pod, _, registered = self.store.get(f"gone/{n}").decode().partition(" ")
            self._ended[pod] = registered
        self._count = count
        return {p for p in pods if p in self._ended and self._registered(p) in (
            None, self._ended[p])}

    def _registered(self, pod: str) -> str | None:
        """The pod's registration number now (None once it has left the job)."""
        key = f"pod/{pod}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
