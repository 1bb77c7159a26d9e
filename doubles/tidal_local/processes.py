"""Pods as local processes: the container runtime of the one-machine cluster.

:class:`AgentProcesses` is the :class:`~tidal_kube.kubelet.PodRuntime` that runs each
worker pod (label ``tidal.dev/role=worker``) as a ``tidal agent`` process, and each job's
rendezvous pod (``tidal.dev/role=rendezvous``) as its ``tidal rendezvous`` process, with the
pod's environment as the operator wrote it, and these changes, because every pod shares one
host:

- ``TIDAL_RENDEZVOUS_HOST`` is ``127.0.0.1`` (there is no cluster DNS for the headless
  Service) and ``TIDAL_RENDEZVOUS_PORT`` a free port chosen once per job, so jobs do not
  collide on the port every pod spec names;
- ``TIDAL_METRICS_PORT``, where the pod sets it, is a free port of the pod's own;
- a worker's agent gets ``--kubeconfig`` (a pod would use its service account), ``--threads 1``
  (the machine's cores are shared), ``--publish-interval`` and ``--report`` (the leader's JSON
  report, under ``reports/<namespace>/<pod>.json``); its output goes to
  ``logs/<namespace>/<pod>.log``.

The pod spec itself stays as the operator made it. Each process leads its own process group
(a terminal's Ctrl-C reaches only ``tidal local``, which then stops the pods in order) and is
killed by the kernel if the thread that started it dies. Stopping a pod is a SIGTERM to its
group, then a SIGKILL once the pod's grace period is over.

A pod whose command is the image's ``tidal`` is a fork (:func:`fork`) of one server process
that has imported the agent, torch included, as the launcher's training workers are: a fresh
interpreter spends about 5 s of CPU on those imports before it trains, on cores the other pods
share. Here, ``tidal local`` itself imports no torch; the server does, once.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal_api import keys

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# Every process the local cluster starts carries this variable (the run's id), so that a
# test, or a person, can find any that outlived it: grep -l TIDAL_LOCAL_RUN /proc/*/environ.
RUN_ENV = "TIDAL_LOCAL_RUN"
FAILED_TO_START = 127  # the exit code of a pod whose process could not be started
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# Loaded here, not in the forked child: dlopen there could wait for a lock another thread held.
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform == "linux" else None


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that forked it ends, so that even a
    ``kill -9`` of ``tidal local`` leaves no process behind (Linux; elsewhere a no-op)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(args: list[str], *, env: dict[str, str], log_path: Path,
          cwd: Path | None = None) -> subprocess.Popen:
    """Start ``args`` in a new process group, output appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True,
                                preexec_fn=die_with_parent)


# What the fork server imports for a pod: tidal_agent.runner.PRELOAD and HF_PRELOAD (not
# imported: no torch here), as one server per process serves the runner's workers and the pods,
# whichever starts it. transformers' part where this process has imported transformers (a
# test's); ``tidal local`` does not, and a Hugging Face pod imports it itself (1.1 s of CPU).
AGENT_PRELOAD = ("tidal_agent.pod", "tidal_agent.worker", "torch._dynamo")
HF_PRELOAD = ("transformers.modeling_utils", "transformers.masking_utils",
              "transformers.models.auto.modeling_auto")


class Forked:
    """A process forked by :func:`fork`, with the part of ``subprocess.Popen`` used here."""

    def __init__(self, process: mp.process.BaseProcess, args: list[str]) -> None:
        self._process, self.args = process, args
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork(main: str, args: list[str], *, env: dict[str, str], log_path: Path,
         cwd: Path | None = None, stderr_path: Path | None = None,
         daemon: bool = True) -> Forked:
    """``spawn`` of ``python -m MAIN ARGS`` (``main``: a module with the click ``main`` of a
    ``tidal`` command: ``tidal_cli``, or ``tidal_agent.cli`` for a checkout's agent), as a
    fork of a server process that has imported ``AGENT_PRELOAD`` (and ``HF_PRELOAD`` where
    this process has imported transformers); the child then takes ``env`` (read at import by
    none of those) as its whole environment. Its standard error goes to ``stderr_path`` where
    given. ``daemon``: terminated rather than waited for should this process exit first, and
    itself unable to start processes (``tidal run``'s workers)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("forkserver")
    hf = "transformers" in sys.modules
    ctx.set_forkserver_preload([*AGENT_PRELOAD, *(HF_PRELOAD if hf else ())])
    process = ctx.Process(target=_forked_main, name=f"{main} {' '.join(args[:1])}",
                          args=(main, args, env, str(log_path), stderr_path and str(stderr_path),
                                cwd), daemon=daemon)
    process.start()
    return Forked(process, [main, *args])


def _forked_main(main: str, args: list[str], env: dict[str, str], log_path: str,
                 stderr_path: str | None, cwd: Path | None) -> None:
    """In the forked child: what ``spawn`` gives a process, then ``main``'s command line."""
    os.setsid()
    die_with_parent()  # the fork server: it ends with the process that started it
    if _LIBC is not None:  # its name in ps and /proc/PID/comm (its command line is the server's)
        _LIBC.prctl(_PR_SET_NAME, f"tidal {args[0]}"[:15].encode())
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    out = os.open(log_path, flags, 0o644)
    err = os.open(stderr_path, flags, 0o644) if stderr_path else out
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    if err != out:
        os.close(err)
    os.close(out)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [main, *args]
    importlib.import_module(main).main(args=args, prog_name="tidal")


def stop_fork_server() -> None:
    """Stop the server pods are forked from, and any fork still running with it (each dies
    with it), before this process exits: on its own it goes a moment after."""
    from multiprocessing import forkserver

    try:
        forkserver._forkserver._stop()  # private, and the only way to wait for it
    except FileNotFoundError:  # its socket's directory went first: the server is gone anyway
        pass


def terminate(proc: subprocess.Popen | Forked, grace_s: float) -> int:
    """SIGTERM the process group of ``proc``, SIGKILL it after ``grace_s``; the exit code."""
    _signal_group(proc, signal.SIGTERM)
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        return proc.wait()


def _signal_group(proc: subprocess.Popen | Forked, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def free_port(taken: Collection[int] = ()) -> int:
    """A port free now and not in ``taken`` (ports given out that may be free for a while: a
    job's rendezvous port between its leader's exit and its restart)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in taken:
            return port


@dataclass(slots=True)
class _Running:
    pod: str  # namespace/name
    proc: subprocess.Popen | Forked | None  # None: it could not be started
    grace_s: float = 30.0
    kill_at: float | None = None  # set once a SIGTERM went out


class AgentProcesses:
    """Runs worker pods as ``tidal agent`` processes, rendezvous pods as ``tidal rendezvous``
    (see the module's docstring)."""

    def __init__(self, *, kubeconfig: Path, workdir: Path, run_id: str,
                 publish_interval_s: float = 1.0, tidal: Path | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.run_id = run_id
        self.publish_interval_s = publish_interval_s
        self.tidal = tidal  # None: forks of this installation's
        self._procs: dict[str, _Running] = {}  # by pod uid
        self._ports: dict[tuple[str, str], int] = {}  # (namespace, job) -> rendezvous port
        self._lock = threading.Lock()
        self._closed = False

    def report_path(self, namespace: str, pod: str) -> Path:
        return self.workdir / "reports" / namespace / f"{pod}.json"

    def log_path(self, namespace: str, pod: str) -> Path:
        return self.workdir / "logs" / namespace / f"{pod}.log"

    # ---- PodRuntime ----------------------------------------------------------------------

    def takes(self, pod: Obj) -> bool:
        return _role(pod) in ("worker", "rendezvous")

    def start(self, pod: Obj) -> None:
        meta = pod["metadata"]
        with self._lock:
            if self._closed or meta["uid"] in self._procs:
                return
            key = f"{meta['namespace']}/{meta['name']}"
            grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
            try:
                proc = self._start(self._command(pod), env=self._environment(pod),
                                   log_path=self.log_path(meta["namespace"], meta["name"]))
            except (OSError, ValueError) as err:
                log.error("%s: cannot start: %s", key, err)
                proc = None
            else:
                log.info("%s: started process %d", key, proc.pid)
            self._procs[meta["uid"]] = _Running(key, proc, grace)

    def exit_code(self, pod: Obj) -> int | None:
        with self._lock:
            running = self._procs.get(pod["metadata"]["uid"])
            if running is None:
                return FAILED_TO_START  # not started here: this runtime lost it
            if running.proc is None:
                return FAILED_TO_START
            return running.proc.poll()

    def stop(self, pod: Obj) -> bool:
        with self._lock:
            return self._stop(pod["metadata"]["uid"],
                              float(pod["metadata"].get("deletionGracePeriodSeconds") or 0))

    def keep_only(self, uids: set[str]) -> None:
        with self._lock:
            for uid in [u for u in self._procs if u not in uids]:
                self._stop(uid, 0.0)

    # ---- the rest -------------------------------------------------------------------------

    def pids(self) -> dict[str, int]:
        """The live processes by pod (``namespace/name``)."""
        with self._lock:
            return {r.pod: r.proc.pid for r in self._procs.values()
                    if r.proc is not None and r.proc.poll() is None}

    def close(self, grace_s: float = 10.0) -> None:
        """Stop every process (SIGTERM, SIGKILL after ``grace_s``) and start no more."""
        with self._lock:
            self._closed = True
            running = [r.proc for r in self._procs.values() if r.proc is not None]
            self._procs.clear()
        for proc in running:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()

    def _stop(self, uid: str, grace_s: float) -> bool:
        """Begin or continue stopping one pod's process; True once it is gone (lock held)."""
        running = self._procs.get(uid)
        if running is None or running.proc is None or running.proc.poll() is not None:
            self._procs.pop(uid, None)
            return True
        now = time.monotonic()
        if running.kill_at is None:
            log.info("%s: stopping process %d", running.pod, running.proc.pid)
            _signal_group(running.proc, signal.SIGTERM)
            running.kill_at = now + min(grace_s, running.grace_s)
        elif now >= running.kill_at:
            _signal_group(running.proc, signal.SIGKILL)
            running.proc.wait()
            self._procs.pop(uid, None)
            return True
        return False

    def _start(self, command: list[str], *, env: dict[str, str],
               log_path: Path) -> subprocess.Popen | Forked:
        """The image's ``tidal``, this installation's: forked (see the module's docstring),
        or run from ``tidal`` where the runtime was given another one."""
        if command[0] != "tidal":
            return spawn(command, env=env, log_path=log_path)
        if self.tidal is None:
            return fork("tidal_cli", command[1:], env=env, log_path=log_path)
        return spawn([str(self.tidal), *command[1:]], env=env, log_path=log_path)

    def _command(self, pod: Obj) -> list[str]:
        container = pod["spec"]["containers"][0]
        command = [*(container.get("command") or ["tidal", "agent"]),
                   *(container.get("args") or [])]
        if _role(pod) == "rendezvous":
            return command
        meta = pod["metadata"]
        # No profile, the modeling-based table: these "GPUs" are processes on a few cores,
        # which the job's own profile would see (more workers, no faster). gloo: they are
        # processes, given no real GPU (on a GPU machine, every pod would take the first).
        return [*command, "--kubeconfig", str(self.kubeconfig), "--threads", "1",
                "--backend", "gloo", "--modeled-table",
                "--publish-interval", str(self.publish_interval_s),
                "--report", str(self.report_path(meta["namespace"], meta["name"]))]

    def _environment(self, pod: Obj) -> dict[str, str]:
        meta = pod["metadata"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
        env.update({RUN_ENV: self.run_id, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        for var in pod["spec"]["containers"][0].get("env") or []:
            if "value" in var:
                env[var["name"]] = str(var["value"])
            elif (field := ((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")):
                env[var["name"]] = _field(pod, field)
            else:
                log.warning("%s/%s: env %s: only values and fieldRefs are supported here",
                            meta["namespace"], meta["name"], var["name"])
        job = (meta.get("labels") or {}).get(keys.JOB_LABEL, meta["name"])
        if (meta["namespace"], job) not in self._ports:  # kept for the job's restarts
            self._ports[meta["namespace"], job] = free_port(taken=set(self._ports.values()))
        port = self._ports[meta["namespace"], job]
        env[keys.ENV_RENDEZVOUS_HOST] = "127.0.0.1"
        env[keys.ENV_RENDEZVOUS_PORT] = str(port)
        if keys.ENV_METRICS_PORT in env:  # every pod names the same port; here they share a host
            env[keys.ENV_METRICS_PORT] = str(free_port(taken=set(self._ports.values())))
        return env


def _role(pod: Obj) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(keys.ROLE_LABEL)


def _field(pod: Obj, path: str) -> str:
    """A downward-API field of the pod (the few a worker pod may use)."""
    values = {
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"]["namespace"],
        "metadata.uid": pod["metadata"]["uid"],
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.hostIP": "127.0.0.1",
        "status.podIP": "127.0.0.1",
    }
    if path not in values:
        raise ValueError(f"fieldRef {path} is not supported by the local cluster")
    return values[path]
