"""A pod's death is known from its ended connection (tidal_agent.presence), at once and by name,
and a world being built with a dead member is not waited for."""

import os
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tidal_agent.presence import Presence, PresenceServer
from tidal_agent.runner import worker_processes
from tidal_agent.world import MemberGone, Rendezvous, WorldBuilder, abort_worlds
from tidal_local.processes import free_port

TIMEOUT_S = 30


def _store(port: int, master: bool) -> dist.Store:
    store = dist.TCPStore("127.0.0.1", port, is_master=master, wait_for_workers=False,
                          timeout=timedelta(seconds=TIMEOUT_S), use_libuv=True)
    return dist.PrefixStore("job/", store)


def _pod(port: int, name: str, registered: int, ready) -> None:
    """A pod that registers, connects, says so, then waits to be killed."""
    store = _store(port, master=False)
    store.set(f"reg/{registered}", name)
    store.set(f"pod/{name}", str(registered))
    presence = Presence(store, "127.0.0.1")  # held: its connection is the pod's presence
    presence.announce(name, registered)
    ready.set()
    time.sleep(600)


def _until(condition, what: str, timeout_s: float = TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.01)
    return value


@pytest.fixture
def served():
    port = free_port()
    host = _store(port, master=True)
    server = PresenceServer(_store(port, master=False))
    yield port, host
    server.close()


def test_a_killed_pod_is_gone_at_once_and_a_live_one_is_not(served):
    port, host = served
    ctx = worker_processes()
    pods = {}
    for n, name in enumerate(("a", "b"), start=1):
        ready = ctx.Event()
        pods[name] = ctx.Process(target=_pod, args=(port, name, n, ready), daemon=True)
        pods[name].start()
        assert ready.wait(TIMEOUT_S)
    watcher = Presence(host, "127.0.0.1")
    try:
        assert watcher.gone(("a", "b")) == set()
        killed = time.monotonic()
        os.kill(pods["b"].pid, signal.SIGKILL)
        assert _until(lambda: watcher.gone(("a", "b")), "pod gone") == {"b"}
        # From the ended connection, not from a silence: well under any heartbeat backstop.
        assert time.monotonic() - killed < 2.0
        assert pods["a"].is_alive() and watcher.gone(("a",)) == set()
    finally:
        for pod in pods.values():
            pod.kill()
            pod.join(10)


def test_a_pod_registered_again_is_not_gone_by_its_old_connection(served):
    port, host = served
    first = Presence(host, "127.0.0.1")
    host.set("pod/c", "1")
    first.announce("c", 1)
    watcher = Presence(host, "127.0.0.1")
    first.close()  # the pod leaves ...
    assert _until(lambda: watcher.gone(("c",)), "pod gone") == {"c"}
    host.set("pod/c", "2")  # ... and a pod of its name registers again
    second = Presence(host, "127.0.0.1")
    second.announce("c", 2)
    assert watcher.gone(("c",)) == set()
    second.close()
    assert _until(lambda: watcher.gone(("c",)), "pod gone again") == {"c"}


def test_a_world_with_a_dead_member_is_not_waited_for():
    """Member "b" never joins: the builder's wait ends as soon as ``gone`` names it, not at the
    world's timeout."""
    port = free_port()
    store = _store(port, master=True)
    rendezvous = Rendezvous(host="127.0.0.1", port=port, prefix="job/", timeout_s=TIMEOUT_S)
    builder = WorldBuilder(rendezvous, 0, ("a", "b"), "a", name="train", store=store)
    started = time.monotonic()
    dead = {"b"}
    with pytest.raises(MemberGone, match="b died while the world of generation 0 was built"):
        builder.result(TIMEOUT_S, gone=lambda members: dead & set(members))
    assert time.monotonic() - started < 2.0
    with pytest.raises(TimeoutError, match="took more than 1 s"):
        WorldBuilder(rendezvous, 1, ("a", "b"), "a", name="train", store=store).result(1)


def test_a_world_abandoned_while_built_is_aborted_once_built():
    """The fault path abandons a world still being built: once its members connect it is
    aborted at once, so the members that finished building it are not held by this one."""
    port = free_port()
    store = _store(port, master=True)
    rendezvous = Rendezvous(host="127.0.0.1", port=port, prefix="job/", timeout_s=TIMEOUT_S)
    mine = WorldBuilder(rendezvous, 0, ("a", "b"), "a", name="train", store=store)
    abort_worlds()  # "a" failed before "b" came: the world is not built yet
    started = time.monotonic()
    theirs = WorldBuilder(rendezvous, 0, ("a", "b"), "b", name="train",
                          store=_store(port, master=False))
    # "b" waits on "a" in the world "a" abandoned: it fails now, not at the timeout, in its
    # first collective or, where "a" aborted before b's side of the connect ended, in that.
    with pytest.raises(RuntimeError, match="Connection (closed|reset) by peer"):
        theirs.result(TIMEOUT_S).barrier()
    assert time.monotonic() - started < TIMEOUT_S / 3
    assert mine._result is not None and mine._result.transport.pg is None  # aborted, let go


def test_a_swap_waited_for_on_the_fault_path_ends_once_its_peer_is_gone():
    """A peer snapshot swap whose peer never takes part (dead, though gloo did not say so) is
    given up as soon as ``gone`` names that peer, not waited for to the group's timeout."""
    import threading

    import torch

    from tidal_agent.snapshot import _Copy, _Swap
    from tidal_agent.world import build_world

    port = free_port()
    store = _store(port, master=True)
    rendezvous = Rendezvous(host="127.0.0.1", port=port, prefix="job/", timeout_s=TIMEOUT_S)
    worlds = {}

    def join(me, store):
        worlds[me] = build_world(rendezvous, 0, ("a", "b"), me, store=store, cpu_group=True)

    other = threading.Thread(target=join, args=("b", _store(port, master=False)))
    other.start()
    join("a", store)
    other.join(TIMEOUT_S)

    def copy(owner):
        return _Copy(cut=None, owner=owner, buffer=torch.zeros(4), index={"w": (0, 4)})

    swap = _Swap(worlds["a"], copy("a"), copy("b"), None)  # "b" never swaps: it hangs
    assert swap.peers == ("b",)
    started = time.monotonic()
    error = swap.join(gone=lambda peers: {"b"} & set(peers))
    assert time.monotonic() - started < 2.0
    assert isinstance(error, RuntimeError) and "b died during the swap" in str(error)
    assert swap.running  # its thread is left to fail on its own
