"""The whole system on one machine (issue 7, items 5-7): ``tidal local demo`` and ``tidal local
up`` as a person runs them, checked from outside through the API, the real kubectl and /proc.

Nothing is mocked: the API emulator, the scheduler and kubelet, ``tidal-operator`` and one
``tidal agent`` process per worker pod. The demo's job is short and its burst comes early,
so that a scale-up and a scale-down both happen within a minute on two cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tidal_local.binaries import ensure_kubectl
from tidal_local.processes import RUN_ENV

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIDAL = Path(sys.executable).with_name("tidal")
JOB = "demo"  # examples/demo.yaml: strict, dp 1, pp scaling
DP_JOB = "demo-dp"  # examples/demo-dp.yaml: strict data parallelism too (issue 25)


def survivors(run_id: str) -> list[str]:
    """Processes whose environment carries this run's marker: none may outlive the run."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"{RUN_ENV}={run_id}".encode() in environ.read_bytes().split(b"\0"):
                cmdline = (environ.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                comm = (environ.parent / "comm").read_text().strip()  # a forked pod's name
                found.append(f"{environ.parent.name} ({comm}): "
                             f"{cmdline.decode(errors='replace')}")
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def _get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=10) as rsp:
        return json.load(rsp)


def server_of(kubeconfig: Path) -> str:
    import yaml

    return yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]


class Watcher:
    """The job and its worker pods, read from the API every 0.3 s in a thread, beside the
    demo's own view: what the status says next to what the pods are."""

    def __init__(self, kubeconfig: Path, job: str) -> None:
        self.kubeconfig, self.job, self.samples, self.errors = kubeconfig, job, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and not self.kubeconfig.is_file():
            time.sleep(0.1)
        url = server_of(self.kubeconfig) if self.kubeconfig.is_file() else None
        while url and not self._stop.is_set():
            try:
                job = _get(url, f"/apis/tidal.dev/v1alpha1/namespaces/default/"
                                f"elastictrainingjobs/{self.job}")
                pods = _get(url, f"/api/v1/namespaces/default/pods?labelSelector="
                                 f"tidal.dev/job%3D{self.job},tidal.dev/role%3Dworker")["items"]
                self.samples.append((job.get("status") or {}, {
                    p["metadata"]["name"]: (p.get("status") or {}).get("phase") for p in pods}))
            except OSError as err:  # not there yet, or the cluster has stopped
                self.errors.append(err)
            time.sleep(0.3)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.timeout(420)
def test_demo_grows_and_shrinks_through_the_operator_bitwise_as_a_static_run(tmp_path):
    """``make demo DEMO_JOB=examples/demo-dp.yaml``, which runs all the machinery of the default
    demo's job and changes dp as well as pp: the planner's layouts for 2, 3 and 4 workers are
    (2,1), (1,3) and (4,1) on the cpu description."""
    run_id = uuid.uuid4().hex
    kubeconfig, report, plot = tmp_path / "kubeconfig", tmp_path / "demo.json", tmp_path / "d.png"
    kubectl = ensure_kubectl()
    watcher = Watcher(kubeconfig, DP_JOB)
    demo = subprocess.Popen(
        [str(TIDAL), "local", "demo", "--job", "examples/demo-dp.yaml", "--minutes", "2",
         "--steps", "120", "--nodes", "1",
         "--gpus-per-node", "4", "--arrival-rate", "0", "--burst-after", "5",
         "--workdir", str(tmp_path / "local"), "--kubeconfig", str(kubeconfig),
         "--report", str(report), "--plot", str(plot), "--no-live"],
        cwd=ROOT, env={**os.environ, RUN_ENV: run_id}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    described = got = ""
    try:
        # While it runs: kubectl shows the printer columns, and every decision as an Event.
        deadline = time.monotonic() + 240
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        while time.monotonic() < deadline and demo.poll() is None:
            if kubeconfig.is_file():
                described = subprocess.run([str(kubectl), "describe", "etj", DP_JOB], env=env,
                                           capture_output=True, text=True, timeout=30).stdout
                if "ScaleDown" in described:
                    got = subprocess.run([str(kubectl), "get", "etj", DP_JOB], env=env,
                                         capture_output=True, text=True, timeout=30).stdout
                    break
            time.sleep(2)
        output, _ = demo.communicate(timeout=300)
    finally:
        watcher.stop()
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 0, output[-4000:]
    assert survivors(run_id) == [], "processes outlived the demo"

    header = got.splitlines()[0].split()
    assert header == ["NAME", "WORKERS", "PP", "DP", "STEP", "PHASE", "AGE"], got
    for reason in ("Created", "ScaleUp", "ScaleDown"):
        assert re.search(rf"Normal +{reason} +\S+ +tidal-operator ", described), described[-3000:]

    result = json.loads(report.read_text())
    assert result["finished"] and result["steps"] == 120
    assert result["phase"] == "Succeeded"  # the summary waited for the operator's verdict
    assert "  static run: step 120/120" in output.splitlines(), output[-4000:]  # its progress
    assert result["scale_ups"] >= 1 and result["scale_downs"] >= 1
    assert result["decisions"][0]["reason"] == "ScaleUp"  # the burst comes after it
    assert result["bitwise_equal"] is True and result["params_equal"] is True
    assert result["static_steps"] == 120
    assert result["plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(a["burst"] for a in result["arrivals"])
    grown = [c for c in result["reconfigurations"] if c["workers"][1] > c["workers"][0]]
    shrunk = [c for c in result["reconfigurations"] if c["workers"][1] < c["workers"][0]]
    assert grown and shrunk, result["reconfigurations"]  # the agent applied both
    shapes = {n: (layout["dp"], layout["pp"]) for c in result["reconfigurations"]
              for n, layout in zip(c["workers"], c["layouts"], strict=True)}
    assert shapes.items() <= {2: (2, 1), 3: (1, 3), 4: (4, 1)}.items(), shapes
    dp_changes = [c for c in result["reconfigurations"]
                  if c["layouts"][0]["dp"] != c["layouts"][1]["dp"]]
    assert dp_changes, result["reconfigurations"]
    for c in dp_changes:  # the summary says so
        (a, b), (old, new) = c["workers"], c["layouts"]
        line = (f"{a} -> {b} workers (dp{old['dp']} x pp{old['pp']} -> "
                f"dp{new['dp']} x pp{new['pp']})")
        assert line in output, output[-4000:]

    # The status agrees with the agent's applied layout and with the pods. In every sample:
    # dp x pp is the member count, every member has its pod, and no worker pod runs that is
    # neither a member nor named by the target. A settled generation (its target applied,
    # nothing else asked) runs exactly its members; on a loaded machine a generation may stay
    # settled for less than a sample's period (the next decision comes within one operator
    # round), so that is asked of one generation after the first, not of each.
    generations, settled = set(), set()
    for status, pods in watcher.samples:
        if "members" not in status or status.get("step", 0) >= result["steps"]:
            continue  # not started, or finished: the pods exit as the job ends
        members, layout, target = status["members"], status["layout"], status["target"]
        generation = status["generation"]
        generations.add(generation)
        assert layout["dp"] * layout["pp"] == len(members), status
        assert set(members) <= set(pods), (status, pods)
        running = {p for p, phase in pods.items() if phase == "Running"}
        named = set(members) | set(target.get("join", ())) | set(target.get("release", ()))
        assert running <= named, (status, pods)
        if target["generation"] == generation and running == set(members):
            settled.add(generation)
    # Generation 0, a scale-up and a scale-down (the report's grow and shrink, above): the
    # samples see at least two of them; one shorter than a sample's period (0.3 s, on a loaded
    # machine) they may miss.
    assert len(generations) >= 2, generations
    assert settled - {0}, (generations, settled)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_local_up_stops_everything_it_started(tmp_path, sig):
    run_id = uuid.uuid4().hex
    kubeconfig = tmp_path / "kubeconfig"
    up = subprocess.Popen(
        [str(TIDAL), "local", "up", "--nodes", "2", "--gpus-per-node", "4", "--arrival-rate",
         "720", "--duration", "60", "--workdir", str(tmp_path / "local"), "--kubeconfig",
         str(kubeconfig), "--no-live"],
        cwd=ROOT, env={**os.environ, RUN_ENV: run_id}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        assert up.stdout.readline().strip() == f"export KUBECONFIG={kubeconfig.resolve()}"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        applied = subprocess.run([str(ensure_kubectl()), "apply", "-f", "examples/demo.yaml"],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert applied.returncode == 0, applied.stderr
        url = server_of(kubeconfig)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # both agents train: the job has done a step
            pods = _get(url, "/api/v1/namespaces/default/pods")["items"]
            running = {p["metadata"]["name"] for p in pods
                       if (p.get("status") or {}).get("phase") == "Running"}
            status = _get(url, f"/apis/tidal.dev/v1alpha1/namespaces/default/"
                               f"elastictrainingjobs/{JOB}").get("status") or {}
            if {f"{JOB}-worker-0", f"{JOB}-worker-1"} <= running and status.get("step", 0) > 0:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the job did not start training: pods {running}, {status}")
        processes = survivors(run_id)
        agents = [p for p in processes if "(tidal agent)" in p]
        # (a third once the operator grows the job into an idle GPU)
        assert len(agents) >= 2 and any("tidal-operator" in p for p in processes), processes
        up.send_signal(sig)
        _, err = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()  # and close the pipes: a leaked one fails a later test
    assert up.returncode == 0, err[-3000:]
    assert "stopping: every pod's process, the operator, the API" in err
    assert survivors(run_id) == []
