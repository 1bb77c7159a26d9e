"""The job's rendezvous, hosted apart from its workers: ``tidal rendezvous``.

Every pod of a job agrees through one c10d TCPStore (tidal_agent.generations) and holds a
connection to one presence server beside it (tidal_agent.presence). Both run here, in a small
pod of their own (``<job>-rendezvous``, which the operator creates with the job's first
workers), not in a worker's: the rendezvous outlives any one worker, so a lost leader costs
what any lost member costs. What must outlive the rendezvous itself is in Kubernetes (the
target, the members, the checkpoints); if this pod is lost, the job restarts from there.

The host serves until the job's last leader says it is done with it (``closed``, set once
every other pod has left) or until SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from datetime import timedelta

import click

from tidal_api import keys

log = logging.getLogger("tidal.agent")

CLOSED_KEY = "closed"  # the job's last leader is done with the rendezvous: the host may go


def serve(port: int, prefix: str, *, timeout_s: float = 120.0,
          stop: threading.Event | None = None, poll_s: float = 0.2) -> None:
    """Host the store (on ``port``, every interface) and its presence server, keys under
    ``prefix`` (the job's: ``<job>/``), until ``closed`` or ``stop``."""
    import torch.distributed as dist  # here: `tidal --help` imports this module, not torch

    from tidal_agent.presence import PresenceServer

    stop = stop or threading.Event()
    server = dist.TCPStore("localhost", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=timeout_s), use_libuv=True)
    store = dist.PrefixStore(prefix, dist.TCPStore(
        "localhost", server.port, is_master=False, timeout=timedelta(seconds=timeout_s),
        use_libuv=True))
    presence = PresenceServer(dist.PrefixStore(prefix, dist.TCPStore(
        "localhost", server.port, is_master=False, timeout=timedelta(seconds=timeout_s),
        use_libuv=True)))
    log.info("rendezvous for %s on port %d (presence on %d)", prefix.rstrip("/"),
             server.port, presence.port)
    try:
        while not stop.wait(poll_s):
            if store.check([CLOSED_KEY]):
                log.info("the job's last leader is done: closing the rendezvous")
                return
    finally:
        presence.close()
        del store, server  # the store goes down last


@click.command()
@click.option("--timeout", "timeout_s", type=float, default=120.0, show_default=True, help="Seconds a store client waits on anything.")
def rendezvous(timeout_s) -> None:
    """Host an ElasticTrainingJob's rendezvous (its store and presence server), as the operator
    starts it in the job's <job>-rendezvous pod, apart from every worker so that it outlives
    any one of them.

    The job and port come from TIDAL_JOB and TIDAL_RENDEZVOUS_PORT. It exits 0 once the job's
    last leader is done with it, or on SIGTERM.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    job = os.environ.get(keys.ENV_JOB)
    port = os.environ.get(keys.ENV_RENDEZVOUS_PORT) or str(keys.RENDEZVOUS_PORT)
    if not job:
        raise click.ClickException(f"set {keys.ENV_JOB}: the operator puts it in the pod")
    if not port.isdigit():
        raise click.ClickException(f"{keys.ENV_RENDEZVOUS_PORT}={port!r} is not a port number")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        serve(int(port), f"{job}/", timeout_s=timeout_s, stop=stop)
    except RuntimeError as err:  # c10d's: the port is taken
        raise click.ClickException(f"cannot host the rendezvous on port {port}: {err}") from None
