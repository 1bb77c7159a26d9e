"""``torchx run`` of Tidal's components (tidal_cli.torchx_components): what torchx builds from
a command line, in this process, and the real ``torchx`` binary with its local_cwd scheduler
training a tiny job with ``tidal run`` and submitting one to the API emulator with ``kubectl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchx.specs.builders import materialize_appdef
from torchx.specs.finder import get_component

from tests import tools
from tidal_cli import torchx_components

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.yaml"
CRD = ROOT / "crds" / "elastictrainingjobs.tidal.dev.yaml"
BIN = Path(sys.executable).parent
TORCHX = BIN / "torchx"


def appdef(component, *argv: str):
    return materialize_appdef(component, list(argv))


def torchx(*args: str, cwd: Path, kubeconfig: Path | None = None) -> subprocess.CompletedProcess:
    """``torchx run -s local_cwd ARGS`` with the virtual environment's bin/ (tidal, kubectl)
    first on the PATH, as ``. .venv/bin/activate`` leaves it."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    return subprocess.run([str(TORCHX), "run", "-s", "local_cwd", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["tidal", "tidal_k8s"])
def test_torchx_finds_the_components_by_module_with_no_validation_errors(name):
    component = get_component(f"tidal_cli.torchx_components:{name}")
    assert component.fn is getattr(torchx_components, name)
    assert component.description  # the docstring's summary, which `torchx run ... --help` shows


def test_the_help_says_what_each_parameter_means(capsys):
    with pytest.raises(SystemExit) as exited:
        appdef(torchx_components.tidal, "--help")
    assert exited.value.code == 0
    help_ = " ".join(capsys.readouterr().out.split())
    assert "--workers int worker processes; 0 for the job's spec.workers.min" in help_
    assert "--steps int steps to run; 0 for the job's spec.training.steps" in help_


def test_tidal_runs_tidal_run_as_one_process_with_the_options_asked_for():
    app = appdef(torchx_components.tidal, "--job_file", "jobs/tiny.yaml", "--workers", "3",
                 "--steps", "5", "--report", "runs/r.json", "--", "--schedule", "gpipe")
    (role,) = app.roles
    assert app.name == "tiny"
    assert (role.entrypoint, role.num_replicas, role.env) == ("tidal", 1, {})
    assert role.args == ["run", "jobs/tiny.yaml", "--workers", "3", "--steps", "5",
                         "--report", "runs/r.json", "--schedule", "gpipe"]
    # Left out, the spec decides: `tidal run` gets no option for it.
    (role,) = appdef(torchx_components.tidal, "--job_file", "tiny.yaml").roles
    assert role.args == ["run", "tiny.yaml"]


def test_tidal_k8s_applies_the_manifest_with_kubectl():
    (role,) = appdef(torchx_components.tidal_k8s, "--job_file", "tiny.yaml").roles
    assert (role.entrypoint, role.args, role.num_replicas) == (
        "kubectl", ["apply", "-f", "tiny.yaml"], 1)
    (role,) = appdef(torchx_components.tidal_k8s, "--job_file", "tiny.yaml",
                     "--namespace", "ml").roles
    assert role.args == ["apply", "-f", "tiny.yaml", "--namespace", "ml"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--workers", "-1"], "--workers must be at least 1, or 0 for spec.workers.min; got -1"),
    (["--steps", "-2"], "--steps must be at least 1, or 0 for spec.training.steps; got -2"),
    (["--", "--workers", "3"], "--workers: give it as the component's own option"),
    (["--", "--steps=3"], "--steps=3: give it as the component's own option"),
])
def test_a_bad_argument_says_what_to_do(argv, message):
    with pytest.raises(ValueError, match="^" + message.replace(".", r"\.")):
        appdef(torchx_components.tidal, "--job_file", "tiny.yaml", *argv)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchx_run_trains_a_tiny_job_with_its_local_scheduler(tmp_path):
    report = tmp_path / "report.json"
    done = torchx("tidal_cli.torchx_components:tidal", "--job_file", str(TINY), "--workers", "2",
                  "--steps", "3", "--report", str(report), cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "job finished: SUCCEEDED" in output
    assert "tidal/0 step     2  pp2  loss" in output  # tidal run's own lines, under its role
    steps = json.loads(report.read_text())["steps"]
    assert [s["layout"]["pp"] for s in steps] == [2, 2, 2]
    assert steps[-1]["loss"] < steps[0]["loss"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_torchx_run_fails_with_tidal_runs_error(tmp_path):
    done = torchx("tidal_cli.torchx_components:tidal", "--job_file", "missing.yaml", cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "job finished: FAILED" in output
    assert "tidal/0 Error: missing.yaml: No such file or directory" in output


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_torchx_run_submits_the_job_to_the_cluster(emulator, tmp_path):
    kubectl = [str(tools.kubectl()), "--kubeconfig", str(emulator.kubeconfig)]
    created = subprocess.run([*kubectl, "apply", "-f", str(CRD)], capture_output=True,
                             text=True, timeout=60)
    assert created.returncode == 0, created.stderr
    done = torchx("tidal_cli.torchx_components:tidal_k8s", "--job_file", str(TINY),
                  "--namespace", "default", cwd=tmp_path, kubeconfig=emulator.kubeconfig)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "kubectl/0 elastictrainingjob.tidal.dev/tiny created" in output
    got = subprocess.run([*kubectl, "get", "etj", "tiny", "-o", "json"], capture_output=True,
                         text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["spec"]["workers"] == {"min": 2, "max": 4}
