"""The parts of ``tidal local`` that the demo's outcome hides: the arrival workload (seeded,
scaled, capped) and the pod runtime (the environment it rewrites, a pod's process from start
to SIGTERM). Fast: no agent, no operator."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal_api import ElasticTrainingJob, keys, parse_job
from tidal_operator.builders import worker_pod
from tidal_local.arrivals import ArrivalConfig, Workload, batch_pod
from tidal_local.cluster import prerequisites
from tidal_local.processes import AGENT_PRELOAD, HF_PRELOAD, RUN_ENV, AgentProcesses

ROOT = Path(__file__).resolve().parents[2]


def test_arrivals_are_seeded_poisson_with_capped_gpus():
    config = ArrivalConfig(rate_per_hour=3600, mean_duration_s=20, max_gpus=2, seed=7,
                           min_duration_s=1, max_duration_s=1000)
    one, two = Workload(config), Workload(config)
    draws = [(one.interarrival_s(), *one.job()) for _ in range(2000)]
    assert draws == [(two.interarrival_s(), *two.job()) for _ in range(2000)]
    gaps, durations, gpus = zip(*draws, strict=True)
    assert statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)  # 3600 per hour
    assert statistics.mean(durations) == pytest.approx(20, rel=0.1)
    assert set(gpus) == {1, 2}  # 4-GPU draws capped to the node's 2
    assert Workload(ArrivalConfig(rate_per_hour=0)).interarrival_s() == float("inf")


def test_trace_durations_are_scaled_and_clamped(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("job_id,submission_time,duration,num_gpu\n"
                     "a,0,8000,1\nb,10,400000,64\nc,20,600,2\n")
    workload = Workload(ArrivalConfig(trace=trace, time_scale=400, min_duration_s=5,
                                      max_duration_s=120, max_gpus=4))
    jobs = {workload.job() for _ in range(200)}
    assert jobs == {(20.0, 1), (120.0, 4), (5.0, 2)}  # 8000/400; clamped; clamped
    with pytest.raises(ValueError, match="min_duration_s <= max_duration_s"):
        ArrivalConfig(min_duration_s=10, max_duration_s=5)


def test_batch_pods_and_prerequisites_pass_the_emulators_admission():
    from tidal_kube.serving import EmulatorThread

    with EmulatorThread() as cluster:
        for obj in prerequisites("default"):
            cluster.call(cluster.emulator.create, obj)
        created = cluster.call(cluster.emulator.create, batch_pod("batch-0001", "default", 2, 30))
    assert created["spec"]["priority"] == 1000  # tidal-default, above elastic workers
    limits = created["spec"]["containers"][0]["resources"]
    assert limits["requests"]["nvidia.com/gpu"] == limits["limits"]["nvidia.com/gpu"] == 2
    assert created["metadata"]["annotations"]["tidal.dev/duration-seconds"] == "30"
    assert keys.JOB_LABEL not in created["metadata"]["labels"]  # non-elastic


def _pod(job: ElasticTrainingJob, index: int, uid: str) -> dict:
    pod = worker_pod(job, uid="job-uid", index=index, generation=0)
    pod["metadata"]["uid"] = uid
    pod["spec"]["nodeName"] = "node-0"
    pod["spec"]["terminationGracePeriodSeconds"] = 5
    return pod


def _job(name: str) -> ElasticTrainingJob:
    import yaml

    doc = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": "default"}
    return parse_job(doc)


def test_worker_pods_run_as_processes_with_a_local_rendezvous(tmp_path):
    # A stand-in for tidal: it writes its arguments and environment, then waits.
    fake = tmp_path / "tidal"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys, time\n"
                    f"out = os.path.join({str(tmp_path)!r}, os.environ['TIDAL_POD'] + '.json')\n"
                    "open(out + '.tmp', 'w').write(json.dumps("
                    "{'argv': sys.argv[1:], 'env': dict(os.environ)}))\n"
                    "os.rename(out + '.tmp', out)\ntime.sleep(60)\n")
    fake.chmod(0o755)
    runtime = AgentProcesses(kubeconfig=tmp_path / "kubeconfig", workdir=tmp_path,
                             run_id="r1", tidal=fake)
    demo, other = _job("demo"), _job("other")
    pods = [_pod(demo, 0, "u0"), _pod(demo, 1, "u1"), _pod(other, 0, "u2")]
    try:
        assert all(runtime.takes(p) for p in pods)
        assert not runtime.takes({"metadata": {"labels": {}}})
        for pod in pods:
            runtime.start(pod)
            runtime.start(pod)  # a second start of one pod does nothing
        assert len(runtime.pids()) == 3
        seen = {}
        deadline = time.monotonic() + 30
        while len(seen) < 3 and time.monotonic() < deadline:
            for name in ("demo-worker-0", "demo-worker-1", "other-worker-0"):
                if (tmp_path / f"{name}.json").is_file():
                    seen[name] = json.loads((tmp_path / f"{name}.json").read_text())
            time.sleep(0.05)
        assert all(runtime.exit_code(p) is None for p in pods)
        # The pod's env, with the rendezvous on this host: one port per job.
        env = {name: s["env"] for name, s in seen.items()}
        assert {e[keys.ENV_RENDEZVOUS_HOST] for e in env.values()} == {"127.0.0.1"}
        ports = {name: e[keys.ENV_RENDEZVOUS_PORT] for name, e in env.items()}
        assert ports["demo-worker-0"] == ports["demo-worker-1"] != ports["other-worker-0"]
        assert env["demo-worker-1"][keys.ENV_POD] == "demo-worker-1"  # from the fieldRef
        assert env["demo-worker-1"][keys.ENV_JOB] == "demo"
        assert env["demo-worker-1"][RUN_ENV] == "r1"
        assert env["demo-worker-1"]["OMP_NUM_THREADS"] == "1"
        assert seen["demo-worker-0"]["argv"] == [
            "agent", "--kubeconfig", str(tmp_path / "kubeconfig"), "--threads", "1",
            "--backend", "gloo", "--modeled-table",
            "--publish-interval", "1.0", "--report",
            str(tmp_path / "reports" / "default" / "demo-worker-0.json")]
        # Deleted: SIGTERM, gone within the grace period; force-deleted: stopped as well.
        deleted = {**pods[0], "metadata": {**pods[0]["metadata"],
                                           "deletionGracePeriodSeconds": 5}}
        deadline = time.monotonic() + 5
        while not runtime.stop(deleted):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        deadline = time.monotonic() + 5
        while set(runtime.pids()) != {"default/demo-worker-1"}:  # u2 is gone from the API
            runtime.keep_only({"u1"})
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert runtime.exit_code(pods[1]) is None
    finally:
        runtime.close(grace_s=5)
    assert runtime.pids() == {}
    runtime.start(pods[1])  # closed: nothing starts any more
    assert runtime.pids() == {}


def test_the_live_view_shows_gpus_workers_layout_step_loss_and_decisions():
    from rich.console import Console

    from tidal_local.observe import ClusterView, EventView, JobView, render

    job = JobView(name="demo", namespace="default", phase="Running", workers=3, target_workers=3,
                  generation=2, target_generation=2, members=("demo-worker-0",), dp=1, pp=3,
                  step=120, steps=750, loss=1.2345, tokens_per_second=9000.0,
                  last_decision=None, pods={"demo-worker-0": "Running",
                                            "demo-worker-3": "Terminating"})
    view = ClusterView(t=42.0, gpus=8, idle_gpus=1, pending_pods=1, pending_gpus=2,
                       batch_running=2, nodes={"node-0": list("EEEB"), "node-1": list("EB..")},
                       jobs=(job,), events=(
                           EventView("2026-01-01T00:00:30Z", "demo", "Normal", "ScaleDown",
                                     "PendingGPUPods: 4 -> 3 workers"),))
    console = Console(width=160, record=True, force_terminal=True)
    console.print(render(view))
    text = console.export_text()
    for shown in ("GPUs 8", "idle 1", "pending pods 1 (2 GPUs)", "node-0 ███", "dp1 x pp3",
                  "120/750", "1.2345", "9,000", "0:R 3:T", "ScaleDown PendingGPUPods: 4 -> 3"):
        assert shown in text, (shown, text)


def test_the_set_up_puts_kubectl_and_helm_in_the_venv_and_installs_prometheus(tmp_path):
    """The Makefile's set-up (the .venv rule, run by `make test` and `make demo`) extracts
    kubectl and helm next to the virtual environment's python, where `source
    .venv/bin/activate` puts them on the PATH, and installs Prometheus where it is missing."""
    setup = subprocess.run(["make", "-n", "-B", ".venv/.installed"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert setup.returncode == 0, setup.stderr
    assert ".venv/bin/python -m tidal_local.binaries" in setup.stdout.splitlines()
    assert "apt-get install -y -qq --no-install-recommends prometheus" in setup.stdout
    test = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert "command -v prometheus" in test.stdout  # checked again before the tests

    done = subprocess.run([sys.executable, "-m", "tidal_local.binaries", "--into",
                           str(tmp_path / "bin")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    kubectl = subprocess.run([str(tmp_path / "bin" / "kubectl"), "version", "--client"],
                             capture_output=True, text=True, timeout=60)
    assert "Client Version: v1.33" in kubectl.stdout, kubectl.stderr
    helm = subprocess.run([str(tmp_path / "bin" / "helm"), "version", "--short"],
                          capture_output=True, text=True, timeout=60)
    assert helm.stdout.startswith("v4."), helm.stderr


def test_the_static_run_shows_its_progress_from_its_log(tmp_path):
    """The demo's static re-run is a `tidal run` process: its step lines, read from its log,
    make a line per tenth of the steps where no terminal shows a bar."""
    from rich.console import Console

    from tidal_local.demo import follow_static_run, steps_logged
    from tidal_local.processes import spawn

    log = tmp_path / "static.log"
    log.write_text("step    99  pp1  loss 1.0000  an earlier run's\n")
    start = log.stat().st_size
    fake_run = ("import sys, time\n"
                "print('tiny: 20 steps\\n  from step     0: 2 workers, dp1 pp2', flush=True)\n"
                "for step in range(20):\n"
                "    print(f'step {step:5d}  pp2  loss 5.0000     10.0 ms', flush=True)\n"
                "    time.sleep(0.15)\n")
    proc = spawn([sys.executable, "-c", fake_run], env={}, log_path=log)
    console = Console(record=True, force_terminal=False, width=100)
    assert follow_static_run(proc, log, start, 20, console, timeout_s=60) == 0
    lines = console.export_text().splitlines()
    assert lines[-1] == "  static run: step 20/20", lines
    assert 2 <= len(lines) <= 11 and all(line.startswith("  static run: step ") for line in lines)
    assert steps_logged(log, start) == 20 and steps_logged(log) == 100
    assert steps_logged(tmp_path / "missing.log") == 0


def test_the_pods_fork_server_imports_what_the_workers_does():
    """A process has one fork server, for both, whichever starts it."""
    from tidal_agent.runner import HF_PRELOAD as RUNNER_HF_PRELOAD
    from tidal_agent.runner import PRELOAD

    assert (AGENT_PRELOAD, HF_PRELOAD) == (PRELOAD, RUNNER_HF_PRELOAD)
