"""The emulator's command line: ``python -m tidal_kube.emulator`` serves an in-memory Kubernetes
API (see :mod:`tidal_kube.apiserver`), creates the objects of ``--apply`` files, prints
``ready URL`` once it listens, and stops on SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from tidal_kube.serving import load_manifests, serve


async def _run(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve(args.host, args.port, args.kubeconfig) as served:
        for obj in load_manifests(args.apply):
            served.emulator.create(obj)
        print(f"ready {served.url}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tidal_kube.emulator",
        description="Serve an in-memory Kubernetes API; prints 'ready URL' once it listens.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig for it here")
    parser.add_argument("--apply", action="append", default=[], metavar="YAML",
                        help="create the objects in this file at start (CRDs, PriorityClasses...)")
    asyncio.run(_run(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
