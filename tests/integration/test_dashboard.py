"""Every query of the Grafana dashboard returns data from a real Prometheus (issue 7, item 4).

An elastic run end to end: the Kubernetes API emulator with the local scheduler and kubelet
(one node of 3 GPUs), the real ``tidal-operator`` process, and one ``tidal agent`` process per
worker pod that the operator creates, started as a kubelet would with the pod's environment
(the rendezvous on localhost). The job starts at 2 workers and grows into the idle GPU. A real
Prometheus (Debian's ``prometheus`` package, installed by make test) scrapes the operator and
every agent each second; then every panel query and annotation of
charts/tidal/dashboards/tidal.json, with the template variables filled in, must return a
series with a number in it, and the variables' ``label_values`` must offer the job.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from lightkube import Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod

from tidal_api import keys
from tidal_kube import localcluster
from tidal_kube.serving import EmulatorThread, load_manifests
from tidal_local.processes import Forked, fork, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DASHBOARD = ROOT / "charts" / "tidal" / "dashboards" / "tidal.json"
ETJ = create_namespaced_resource("tidal.dev", "v1alpha1", "ElasticTrainingJob",
                                 "elastictrainingjobs")
NS, JOB = "default", "tiny"
GPUS = 3  # the job runs at 2 workers until a third GPU comes, then grows to 3
# Grafana's $__rate_interval is at least 4 scrape intervals; 10 s (10 scrapes) leaves room for
# scrapes a loaded machine misses, so that an increase still has two samples to show in.
VARIABLES = {"$namespace": NS, "$job": JOB, "$__rate_interval": "10s", "$__interval": "2s"}
PREREQUISITES = [  # what the chart installs besides the operator
    {"apiVersion": "v1", "kind": "ServiceAccount",
     "metadata": {"name": "tidal-worker", "namespace": NS}},
    *({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
       "value": value} for name, value in (("tidal-elastic", 100), ("tidal-default", 1000))),
]


def wait_for(what: str, check, timeout_s: float, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def stop(proc: subprocess.Popen | Forked) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class WorkerPods:
    """The kubelet's part for the job's pods: a ``tidal agent`` process for each worker pod
    that runs, with the pod's environment, its own metrics port and the rendezvous on
    localhost (a pod's address here), and the rendezvous pod's ``tidal rendezvous``."""

    def __init__(self, api: Client, kubeconfig: Path, logs: Path, max_workers: int) -> None:
        self.api, self.kubeconfig, self.logs = api, kubeconfig, logs
        self.rendezvous_port = free_port()
        self.metrics_ports = {f"{JOB}-worker-{i}": free_port() for i in range(max_workers)}
        self.procs: dict[str, Forked] = {}

    def poll(self) -> None:
        """Start an agent for every running pod that has none; fail on an agent's error."""
        for pod in self.api.list(Pod, namespace=NS, labels={keys.JOB_LABEL: JOB}):
            name = pod.metadata.name
            if name not in self.procs and pod.status and pod.status.phase == "Running":
                self.start(pod)
        for name, proc in self.procs.items():
            assert proc.poll() in (None, 0), f"{name} failed:\n{self.log(name)[-3000:]}"

    def start(self, pod: Pod) -> None:
        name = pod.metadata.name
        container = pod.spec.containers[0]
        env = {e.name: e.value for e in container.env if e.value is not None}
        env.update({keys.ENV_POD: name, keys.ENV_RENDEZVOUS_HOST: "127.0.0.1",
                    keys.ENV_RENDEZVOUS_PORT: str(self.rendezvous_port), "OMP_NUM_THREADS": "1"})
        base = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
        assert container.command[0] == "tidal", container.command
        args = [*container.command[1:]]
        if pod.metadata.labels[keys.ROLE_LABEL] == "worker":
            args += ["--kubeconfig", str(self.kubeconfig), "--modeled-table",  # as tidal local
                     "--publish-interval", "0.5",
                     "--timeout", "90", "--metrics-port", str(self.metrics_ports[name])]
        # a fork of this process's warmed server, as tidal local's pods are
        self.procs[name] = fork("tidal_cli", args, env={**base, **env},
                                log_path=self.logs / f"{name}.log", cwd=ROOT)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def stop(self) -> None:
        for proc in self.procs.values():
            stop(proc)


class Prometheus:
    """A Prometheus server scraping static targets every second, and its HTTP API."""

    def __init__(self, workdir: Path, targets: dict[str, list[int]]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("the prometheus binary is not installed: apt-get install prometheus "
                        "(make test does it where apt-get can)")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            # Tidal's series carry namespace and job labels of their own: keep them.
            "scrape_configs": [
                {"job_name": name, "honor_labels": True,
                 "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}
                for name, ports in targets.items()],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = workdir / "prometheus.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"],
                stdout=out, stderr=subprocess.STDOUT)
        wait_for("Prometheus to be ready", self.ready, 30)

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited:\n{self.log.read_text()[-3000:]}"
        try:
            return urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> list | dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]

    def range(self, expr: str, start: float, end: float) -> list[dict]:
        data = self.api("query_range", query=expr, start=start, end=end, step="1s")
        assert data["resultType"] == "matrix"
        return data["result"]


def dashboard_queries(board: dict) -> list[tuple[str, str]]:
    """(where, expr) of every panel target (rows included) and annotation."""
    panels = [*board["panels"], *(p for row in board["panels"] for p in row.get("panels", ()))]
    found = [(f"panel {p['title']!r}", t["expr"]) for p in panels for t in p.get("targets", ())]
    found += [(f"annotation {a['name']!r}", a["expr"]) for a in board["annotations"]["list"]
              if "expr" in a]
    return found


def substitute(expr: str) -> str:
    for name in sorted(VARIABLES, key=len, reverse=True):  # $__rate_interval before $__interval
        expr = expr.replace(name, VARIABLES[name])
    assert "$" not in expr, f"a template variable is left in {expr!r}"
    return expr


def finite(result: list[dict]) -> list[float]:
    return [float(v) for series in result for _, v in series["values"]
            if math.isfinite(float(v))]


@pytest.mark.timeout(300)
def test_every_dashboard_query_returns_data_from_an_elastic_run(tmp_path):
    board = json.loads(DASHBOARD.read_text())
    doc = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    doc["metadata"] = {"name": JOB, "namespace": NS}
    doc["spec"]["training"]["steps"] = 5000  # longer than the test: it stops the agents
    doc["spec"]["scaling"] = {"probabilityThreshold": 0.5, "cooldownSeconds": 0,
                              "switchOverheadSeconds": 1}

    with EmulatorThread(kubeconfig=tmp_path / "kubeconfig") as emu:
        api = Client(KubeConfig.from_file(emu.kubeconfig).get())
        for obj in [*load_manifests([ROOT / "crds" / "elastictrainingjobs.tidal.dev.yaml"]),
                    *PREREQUISITES]:
            emu.call(emu.emulator.create, obj)
        localcluster.register_nodes(emu.url, count=1, gpus_per_node=GPUS - 1)
        scheduler = emu.submit(localcluster.run(emu.url, interval_s=0.1))
        operator_port = free_port()
        with (tmp_path / "operator.log").open("w") as log:
            operator = subprocess.Popen(
                [str(BIN / "tidal-operator"), "--kubeconfig", str(emu.kubeconfig),
                 "--interval", "0.5", "--metrics-port", str(operator_port)],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        pods = WorkerPods(api, emu.kubeconfig, tmp_path, max_workers=GPUS)
        prometheus = None
        try:
            prometheus = Prometheus(tmp_path, {"tidal-operator": [operator_port],
                                               "tidal-agents": list(pods.metrics_ports.values())})
            started = time.time()
            values = lambda expr: finite(  # noqa: E731
                prometheus.range(substitute(expr), started, time.time()))
            api.create(ETJ(doc))

            # Prometheus must hold the job's decision counter at 0 before the decision: a counter
            # first scraped at 1 shows no increase (Prometheus 2.x takes no created timestamp).
            # So the job trains at 2 workers until then, and only then does a GPU come free.
            def before_the_gpu():
                pods.poll()
                return (set(values('tidal_job_decisions_total{job="$job", kind="scale_up"}')) == {0}
                        and 2 in values('tidal_agent_pp{job="$job"}'))

            wait_for("Prometheus to scrape the job at 2 workers", before_the_gpu, 120)
            localcluster.register_nodes(emu.url, count=1, gpus_per_node=1, prefix="freed")

            def grown():
                pods.poll()
                status = api.get(ETJ, JOB, namespace=NS).get("status") or {}
                return status.get("generation") == 1 and len(status.get("members", ())) == GPUS

            wait_for("the job to grow to 3 workers", grown, 180)
            time.sleep(11)  # scrapes after the switch, beyond one rate interval
            pods.poll()
            end = time.time()

            for where, expr in dashboard_queries(board):
                query = substitute(expr)
                result = prometheus.range(query, started, end)
                assert finite(result), f"{where}: {query} returned no number: {result}"

            # The panels show the run as it was: 2 then 3 workers, one scale-up, one switch.
            assert set(values('tidal_job_workers{job="$job"}')) >= {2, 3}
            assert set(values('tidal_agent_pp{job="$job"}')) == {2, 3}
            assert max(values('tidal_job_decisions_total{job="$job", kind="scale_up"}')) == 1
            assert max(values('tidal_agent_reconfigurations_total{job="$job", direction="grow"}')) == 1
            assert max(values('tidal_agent_last_switch_pause_seconds{job="$job"}')) > 0
            for variable in board["templating"]["list"]:
                if variable["type"] != "query":
                    continue
                selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)",
                                               variable["query"]).groups()
                offered = prometheus.api(f"label/{label}/values",
                                         **{"match[]": substitute(selector)})
                assert {"namespace": NS, "job": JOB}[label] in offered, (variable["name"], offered)
        finally:
            pods.stop()
            stop(operator)
            if prometheus is not None:
                stop(prometheus.proc)
            scheduler.cancel()
            api.close()
