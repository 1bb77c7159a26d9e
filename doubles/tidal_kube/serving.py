"""Serving the emulator: in the running event loop (:func:`serve`), from a thread of its own
for synchronous code (:class:`EmulatorThread`), with a kubeconfig for clients
(:func:`write_kubeconfig`); and reading the manifests to create in it (:func:`load_manifests`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp.web
import yaml

from tidal_kube.apiserver import Emulator
from tidal_kube.resources import Obj


@dataclasses.dataclass(frozen=True)
class Served:
    """A running emulator: where it listens, and its kubeconfig if one was written."""

    emulator: Emulator
    url: str
    kubeconfig: Path | None


@asynccontextmanager
async def serve(host: str = "127.0.0.1", port: int = 0, kubeconfig: str | Path | None = None,
                emulator: Emulator | None = None) -> AsyncIterator[Served]:
    """Serve an emulator on ``host:port`` (0: any free port) until the block ends."""
    emulator = Emulator() if emulator is None else emulator  # an Emulator with no requests is falsy
    emulator.storage.open()
    async with emulator:
        server = aiohttp.web.Server(emulator, handler_cancellation=True)
        runner = aiohttp.web.ServerRunner(server, shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = aiohttp.web.TCPSite(runner, host, port)
            await site.start()
            bound_host, bound_port = runner.addresses[0][:2]
            url = f"http://{bound_host}:{bound_port}"
            path = None
            if kubeconfig is not None:
                path = write_kubeconfig(kubeconfig, url)
            yield Served(emulator, url, path)
        finally:
            emulator.storage.close()  # end the watch streams, or the shutdown waits for them
            await runner.cleanup()


def write_kubeconfig(path: str | Path, url: str, namespace: str = "default",
                     token: str = "tidal-emulator") -> Path:
    """A kubeconfig for the emulator: plain HTTP, a token user (any token is accepted; tests
    tell clients apart by their token in the recorded requests)."""
    path = Path(path)
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "tidal-emulator",
        "clusters": [{"name": "tidal-emulator",
                      "cluster": {"server": url, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "tidal", "user": {"token": token}}],
        "contexts": [{"name": "tidal-emulator", "context": {
            "cluster": "tidal-emulator", "user": "tidal", "namespace": namespace}}],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class EmulatorThread:
    """An emulator served from its own event loop in a background thread: for synchronous
    tests and the CLI. ``with EmulatorThread() as cluster: cluster.url``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, kubeconfig: str | Path | None = None,
                 emulator: Emulator | None = None) -> None:
        self._args = (host, port, kubeconfig)
        self._emulator = emulator
        self._served: Served | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="tidal-emulator", daemon=True)

    def start(self) -> EmulatorThread:
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise RuntimeError("the emulator did not start") from self._failure
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def __enter__(self) -> EmulatorThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def served(self) -> Served:
        if self._served is None:
            raise RuntimeError("the emulator is not running")
        return self._served

    @property
    def url(self) -> str:
        return self.served.url

    @property
    def kubeconfig(self) -> Path | None:
        return self.served.kubeconfig

    @property
    def emulator(self) -> Emulator:
        return self.served.emulator

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the emulator's loop (e.g. ``cluster.call(cluster.emulator.get,
        "v1/pods", "default", "w-0")``) and return its result; a coroutine is awaited there."""
        assert self._loop is not None

        async def run() -> Any:
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Run a coroutine on the emulator's loop (e.g. a scheduler) without waiting for it."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            host, port, kubeconfig = self._args
            async with serve(host, port, kubeconfig, self._emulator) as served:
                self._served = served
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._ready.set()


def load_manifests(paths: Iterable[str | Path]) -> Iterator[Obj]:
    """The objects in YAML files (several documents each; ``List`` kinds unfold)."""
    for path in paths:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if isinstance(doc, dict) and doc.get("kind", "").endswith("List") and "items" in doc:
                yield from doc["items"]
            elif doc:
                yield doc
