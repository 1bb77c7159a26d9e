"""``tidal agent`` processes against the Kubernetes API emulator, with the caller as operator.

The caller creates the ElasticTrainingJob, starts one agent process per pod with a worker pod's
environment (:class:`Pods`), writes ``status.target`` through the status subresource
(:func:`set_status`) and watches the status the leader publishes (:class:`Observer`). At the end
:func:`assert_bits_of_a_static_run` holds the leader's report against a run that never changed.
Used by tests/integration/test_control.py and the fault soak (tests/integration/soak.py).

The agents run this checkout's code whatever started the caller: ``tidal_agent.cli`` forked
from the caller's fork server (:func:`tidal_local.processes.fork`, as ``tidal local``'s pods
are), which has imported the checkout's agent, not the ``tidal`` script of a virtual
environment (it runs the checkout it was installed from, which need not be this one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from lightkube import Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.types import PatchType

from tidal_agent.link import ElasticTrainingJobResource as ETJ
from tidal_api import keys
from tidal_kube.serving import EmulatorThread, load_manifests
from tidal_local.processes import Forked, fork, free_port

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("api", "agent", "operator", "doubles")  # pyproject.toml's pythonpath
NAMESPACE = "default"


def checkout_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this checkout's source roots as ``PYTHONPATH``."""
    return {**env, "PYTHONPATH": os.pathsep.join(str(ROOT / root) for root in SOURCE_ROOTS)}


def crd_client(emulator: EmulatorThread) -> Client:
    """A client of ``emulator``, with the ElasticTrainingJob CRD installed there."""
    for crd in load_manifests([ROOT / "crds" / "elastictrainingjobs.tidal.dev.yaml"]):
        emulator.call(emulator.emulator.create, crd)
    return Client(KubeConfig.from_file(emulator.kubeconfig).get())


def job_doc(name: str = "tiny", steps: int = 40) -> dict[str, Any]:
    """examples/tiny.yaml as ``name``, training ``steps`` steps."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    doc["spec"]["training"]["steps"] = steps
    return doc


def create(api: Client, doc: dict[str, Any]) -> None:
    api.create(ETJ(doc), namespace=NAMESPACE)


def status(api: Client, name: str = "tiny") -> dict[str, Any]:
    return dict(api.get(ETJ, name, namespace=NAMESPACE)).get("status") or {}


def set_status(api: Client, fields: dict[str, Any], name: str = "tiny") -> None:
    """The operator's move: a merge patch of its own status fields."""
    api.patch(ETJ.Status, name, {"status": fields}, namespace=NAMESPACE,
              patch_type=PatchType.MERGE)


def until(check, timeout_s: float, what: str, every_s: float = 0.05):
    """The first truthy value of ``check()``, polled every ``every_s`` for ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class Pods:
    """Agent processes with a worker pod's environment, as the operator would start them:
    ``<job>-worker-<index>``, and the job's rendezvous (``tidal rendezvous``, the operator's
    ``<job>-rendezvous`` pod), started first. Whichever pod leads at the end writes the report:
    worker-0 to ``report``, the others beside it (``report_of``). ``timeout_s`` is the
    agents' ``--timeout``; ``args`` go to every agent."""

    def __init__(self, url: str, logs: Path, *, job: str = "tiny", report: Path | None = None,
                 timeout_s: float = 60.0, args: tuple[str, ...] = ()):
        self.url, self.logs, self.job, self.report = url, logs, job, report
        self.timeout_s, self.args = timeout_s, args
        self.port = free_port()
        self.procs: dict[str, Forked] = {}
        self.rendezvous = f"{job}-rendezvous"
        self.procs[self.rendezvous] = fork(
            "tidal_cli", ["rendezvous", "--timeout", str(timeout_s)],
            env=self._env(self.rendezvous), log_path=self._fresh_log(self.rendezvous), cwd=ROOT)

    def name(self, index: int) -> str:
        return f"{self.job}-worker-{index}"

    def report_of(self, pod: str) -> Path | None:
        """Where ``pod`` writes the report if it leads at the end."""
        if self.report is None or pod == self.name(0):
            return self.report
        return self.report.with_name(f"{pod}.json")

    def _env(self, pod: str) -> dict[str, str]:
        return checkout_env({**os.environ, keys.ENV_JOB: self.job, keys.ENV_NAMESPACE: NAMESPACE,
                             keys.ENV_POD: pod, keys.ENV_RENDEZVOUS_HOST: "127.0.0.1",
                             keys.ENV_RENDEZVOUS_PORT: str(self.port), "OMP_NUM_THREADS": "1"})

    def _fresh_log(self, pod: str) -> Path:
        self.log_path(pod).unlink(missing_ok=True)
        return self.log_path(pod)

    def start(self, index: int, *extra: str) -> str:
        pod = self.name(index)
        env = self._env(pod)
        args = ["agent", "--kubeconfig", self.url, "--publish-interval", "0.2",
                "--timeout", str(self.timeout_s), *self.args]
        if self.report:
            args += ["--report", str(self.report_of(pod))]
        args += extra
        self.procs[pod] = fork("tidal_agent.cli", args, env=env, log_path=self._fresh_log(pod),
                               cwd=ROOT)
        return pod

    def log_path(self, pod: str) -> Path:
        return self.logs / f"{pod}.log"

    def log(self, pod: str) -> str:
        return self.log_path(pod).read_text()

    def kill(self, pod: str) -> None:
        """SIGKILL: the pod's node went, or the kernel's OOM killer came."""
        self.procs[pod].send_signal(signal.SIGKILL)
        self.procs[pod].wait()

    def wait(self, pod: str, timeout_s: float) -> int:
        try:
            return self.procs[pod].wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{pod} still runs:\n{self.log(pod)[-3000:]}") from None

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class Observer:
    """The job's status as seen every ``every_s``, in a thread: what the operator would watch.
    ``seen`` holds every distinct status in order, or only the newest without ``history``
    (a long run's)."""

    def __init__(self, api: Client, name: str = "tiny", *, history: bool = True,
                 every_s: float = 0.05):
        self.api, self.name, self.history, self.every_s = api, name, history, every_s
        self.seen: list[dict[str, Any]] = []
        self.error: BaseException | None = None  # what stopped the thread, if anything
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        try:
            while not self._stop.is_set():
                now = status(self.api, self.name)
                if not self.seen or now != self.seen[-1]:
                    self.seen = [*self.seen, now] if self.history else [now]
                time.sleep(self.every_s)
        except BaseException as err:  # noqa: BLE001 - raised in the caller's thread by until
            self.error = err

    @property
    def latest(self) -> dict[str, Any]:
        return self.seen[-1] if self.seen else {}

    def until(self, check, timeout_s: float, what: str):
        """The first status seen that passes ``check``; an error that stopped the observer
        is raised at once, not waited out as a status that never changes."""
        def seen():
            if self.error is not None:
                raise AssertionError(f"the observer stopped waiting for {what}") from self.error
            return self.seen and check(self.seen[-1]) and self.seen[-1]

        return until(seen, timeout_s, what, every_s=self.every_s / 2)

    def stop(self):
        self._stop.set()
        self._thread.join(5)


def finish(pods: Pods, observer: Observer, survivors, steps: int) -> None:
    """The survivors train to the last step and exit 0."""
    for pod in survivors:
        assert pods.wait(pod, 180) == 0, pods.log(pod)
    observer.until(lambda s: s.get("step") == steps, 10, "the final step")


def static_run(doc: dict[str, Any], steps: int, workers: int = 2) -> dict[str, Any]:
    """The report of ``doc``'s job run by a fixed ``workers`` (``tidal run``'s launcher)."""
    from tidal_agent.runner import run_local
    from tidal_api import parse_job
    from tidal_plan.layout import resolve_layout

    job = parse_job(doc)
    return run_local(job, resolve_layout(job, workers=workers), steps=steps, timeout_s=120)


def differing_bits(report: dict[str, Any], static: dict[str, Any], steps: int) -> str | None:
    """Where ``report`` is not the bits of ``static``, a run of ``steps`` steps that never
    changed; None where it is: every step once, the same loss at each (``float.hex``) and the
    same final parameters (their sha256)."""
    done = [s["step"] for s in report["steps"]]
    if done != list(range(steps)):
        return f"the report's steps are not 0 to {steps - 1} once each: {done}"
    for mine, theirs in zip(report["steps"], static["steps"], strict=True):
        if mine["loss_hex"] != theirs["loss_hex"]:
            return (f"step {mine['step']}: loss {mine['loss_hex']}, the static run's "
                    f"{theirs['loss_hex']}")
    if report["params_sha256"] != static["params_sha256"]:
        return (f"the final parameters' sha256 is {report['params_sha256']}, the static run's "
                f"{static['params_sha256']}")
    return None


def assert_bits_of_a_static_run(report: dict[str, Any], doc: dict[str, Any], steps: int) -> None:
    """Every step once, with the losses and final parameters of a fixed 2-worker run."""
    differs = differing_bits(report, static_run(doc, steps), steps)
    assert differs is None, differs
