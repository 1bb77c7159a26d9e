"""``tidal local demo``: an elastic job on the one-machine cluster, grown and shrunk by the
operator, checked bit for bit against a static run.

1. The cluster comes up (:mod:`.cluster`) with its generator of non-elastic GPU jobs, plus one
   deterministic burst after the first scale-up (see :mod:`.arrivals`) so that a scale-down
   happens however the Poisson draws fall.
2. The example job (``examples/demo.yaml``, its ``spec.training.steps`` set to fit the minutes)
   is written to ``<workdir>/job.yaml`` and applied with the real ``kubectl apply -f``.
3. Every second the demo looks at the cluster through the API (:mod:`.observe`): a live view
   on a terminal, one line per decision elsewhere; the looks make the timeline.
4. Once the leader has written its report and the operator has marked the job Succeeded (or
   the time is up) the cluster stops, leaving no process.
5. ``tidal run <workdir>/job.yaml --workers <min>`` trains the same job statically, its
   progress shown as it goes; its per-step ``float.hex`` losses and parameter digest are
   compared with the leader's report.
6. The report (JSON), the plot (PNG) and a summary table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from tidal_local.arrivals import ArrivalConfig
from tidal_local.binaries import ensure_kubectl
from tidal_local.cluster import ClusterConfig, LocalCluster
from tidal_local.observe import DECISIONS, ClusterView, observe, render
from tidal_local.processes import spawn, terminate
from tidal_operator.snapshot import FINISHED_PHASES

# The job's length is set from the minutes: a step of the demo job takes 0.12-0.25 s on a
# 2-core machine (more workers than cores slow it down), and the agents need about half a
# minute to start. The estimate is on the slow side, so the job ends within the minutes.
STEP_SECONDS = 0.2
STARTUP_SECONDS = 30.0
MIN_STEPS = 100
# The operator marks the job Succeeded a round or two after its leader's last step; past this
# the demo goes on without it (the summary shows the phase the job was left in).
SUCCEEDED_WITHIN_S = 30.0
# Without a terminal, the static run's progress is a line per tenth of its steps.
PROGRESS_LINES = 10
# A step line of `tidal run`'s output: "step    12  pp2  loss 5.4820 ..."
STEP_LINE = re.compile(rb"^step +(\d+) ", re.MULTILINE)


class DemoError(RuntimeError):
    """The demo cannot run; the message says why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """What ``tidal local demo`` runs (see the module's docstring)."""

    minutes: float = 3.0
    job_file: Path = Path("examples/demo.yaml")
    steps: int | None = None  # default: from the minutes
    report: Path | None = Path("runs/demo.json")
    plot: Path | None = None  # default: the report's path with .png
    workdir: Path = Path("runs/local")
    nodes: int = 2
    gpus_per_node: int = 4
    port: int = 0
    kubeconfig: Path | None = None
    arrivals: ArrivalConfig = field(default_factory=lambda: ArrivalConfig(
        rate_per_hour=90.0, mean_duration_s=30.0, burst_after_scale_up_s=15.0))
    live: bool | None = None  # default: when the console is a terminal

    @property
    def plot_path(self) -> Path:
        if self.plot is not None:
            return self.plot
        return (self.report or self.workdir / "demo.json").with_suffix(".png")


def demo_steps(minutes: float) -> int:
    """Steps that fit in ``minutes`` at :data:`STEP_SECONDS` after the start-up."""
    return max(MIN_STEPS, int((minutes * 60 - STARTUP_SECONDS) / STEP_SECONDS))


def write_job(config: DemoConfig) -> tuple[Path, dict[str, Any]]:
    """The example job with its steps for this demo, as ``<workdir>/job.yaml``."""
    try:
        doc = yaml.safe_load(config.job_file.read_text())
    except OSError as err:
        raise DemoError(f"{config.job_file}: {err.strerror}; run from the repository root or "
                        "pass --job") from None
    doc.setdefault("metadata", {}).setdefault("namespace", "default")
    doc["spec"]["training"]["steps"] = config.steps or demo_steps(config.minutes)
    path = config.workdir / "job.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {config.job_file} with its steps set for the demo\n"
                    + yaml.safe_dump(doc, sort_keys=False))
    return path, doc


def run_demo(config: DemoConfig, console: Console | None = None) -> dict[str, Any]:
    """Run the demo; returns the report (also written to ``config.report``)."""
    console = console or Console()
    kubectl = ensure_kubectl()
    job_path, doc = write_job(config)
    name, namespace = doc["metadata"]["name"], doc["metadata"]["namespace"]
    cluster_config = ClusterConfig(
        workdir=config.workdir, nodes=config.nodes, gpus_per_node=config.gpus_per_node,
        port=config.port, kubeconfig=config.kubeconfig, namespace=namespace,
        arrivals=replace(config.arrivals, namespace=namespace,
                         max_gpus=min(config.arrivals.max_gpus, config.gpus_per_node)))
    steps = doc["spec"]["training"]["steps"]
    deadline_s = max(config.minutes * 60 * 1.5, config.minutes * 60 + 60)
    with LocalCluster(cluster_config) as cluster:
        console.print(f"[bold]tidal local demo[/]: {config.nodes} nodes x {config.gpus_per_node} "
                      f"GPUs, job {name} ({steps} steps), up to {deadline_s / 60:.1f} minutes")
        console.print(f"  export KUBECONFIG={cluster.kubeconfig.resolve()}", soft_wrap=True)
        console.print(f"  # then, in another terminal: kubectl get etj,pods; kubectl describe "
                      f"etj {name}", soft_wrap=True)
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig.resolve())}
        applied = subprocess.run([str(kubectl), "apply", "-f", str(job_path)], env=env,
                                 capture_output=True, text=True, timeout=60)
        if applied.returncode != 0:
            raise DemoError(f"kubectl apply -f {job_path}: {applied.stderr.strip()}")
        console.print(f"  kubectl apply -f {job_path}: {applied.stdout.strip()}", soft_wrap=True)
        leader_report = cluster.runtime.report_path(namespace, f"{name}-worker-0")
        timeline, last = _follow(cluster, name, leader_report, deadline_s, config, console)
        arrivals = [asdict(a) for a in cluster.generator.arrivals]
        started_at = cluster.started_at
    elastic = json.loads(leader_report.read_text()) if _complete(leader_report) else None
    report = _report(config, doc, timeline, last, arrivals, elastic, started_at)
    if elastic is not None:
        console.print(f"static run for the bitwise check: tidal run {job_path} --workers "
                      f"{doc['spec']['workers']['min']}")
        static = static_run(job_path, doc["spec"]["workers"]["min"], config.workdir,
                            steps=steps, console=console)
        report.update(compare(elastic, static))
    else:
        report.update(bitwise_equal=False, params_equal=False,
                      bitwise_note="the job did not finish: no leader report to compare")
    from tidal_local.plot import write_plot

    report["plot"] = str(write_plot(config.plot_path, timeline, name, report["decisions"]))
    if config.report is not None:
        config.report.parent.mkdir(parents=True, exist_ok=True)
        config.report.write_text(json.dumps(report, indent=2) + "\n")
        report["report"] = str(config.report)
    console.print(summary_table(report))
    return report


def _follow(cluster: LocalCluster, job: str, report: Path, deadline_s: float,
            config: DemoConfig, console: Console) -> tuple[list[dict[str, Any]], ClusterView]:
    """Look every second until the job's leader has written its report and the operator has
    marked the job finished (:data:`SUCCEEDED_WITHIN_S` at most after the report), or time is
    up. The report alone would leave the summary with the phase before the last one."""
    live = console.is_terminal if config.live is None else config.live
    timeline: list[dict[str, Any]] = []
    seen: set[tuple[str, str, str]] = set()
    started, last_line = time.monotonic(), 0.0
    reported_at: float | None = None
    view = observe(cluster.url, cluster.started_at)
    with Live(render(view), console=console, refresh_per_second=2, transient=False) if live \
            else nullcontext() as screen:
        while time.monotonic() - started < deadline_s:
            cluster.check()
            view = observe(cluster.url, cluster.started_at)
            timeline.append(view.sample())
            if live:
                screen.update(render(view, title=f"tidal local demo ({job})"))
            else:
                for event in view.events:
                    key = (event.at, event.reason, event.message)
                    if key not in seen:
                        seen.add(key)
                        console.print(f"{view.t:6.0f}s {event.job}: {event.reason} "
                                      f"{event.message}", soft_wrap=True)
                if time.monotonic() - last_line > 15:
                    last_line = time.monotonic()
                    console.print(_line(view, job), soft_wrap=True)
            if reported_at is None and _complete(report):
                reported_at = time.monotonic()
            if reported_at is not None and (
                    _phase(view, job) in FINISHED_PHASES
                    or time.monotonic() - reported_at > SUCCEEDED_WITHIN_S):
                break
            time.sleep(1.0)
    return timeline, view


def _phase(view: ClusterView, job: str) -> str | None:
    return next((j.phase for j in view.jobs if j.name == job), None)


def _complete(report: Path) -> bool:
    """Whether the leader's report is all there (it is written with one write_text)."""
    try:
        return "params_sha256" in json.loads(report.read_text())
    except (OSError, ValueError):
        return False


def _line(view: ClusterView, job: str) -> str:
    mine = next((j for j in view.jobs if j.name == job), None)
    if mine is None or not mine.workers:
        return f"{view.t:6.0f}s GPUs {view.gpus}, idle {view.idle_gpus}: {job} is starting"
    loss = f"{mine.loss:.4f}" if mine.loss is not None else "-"
    return (f"{view.t:6.0f}s GPUs {view.gpus}, idle {view.idle_gpus}, pending pods "
            f"{view.pending_pods}; {job}: {mine.phase}, {mine.workers} workers "
            f"(dp{mine.dp} x pp{mine.pp}), step {mine.step or 0}/{mine.steps}, loss {loss}")


def _seconds_since(stamp: str, started_at: float) -> float:
    import datetime

    when = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    return round(when - started_at, 1)


def _report(config: DemoConfig, doc: dict[str, Any], timeline: list[dict[str, Any]],
            last: ClusterView, arrivals: list[dict[str, Any]], elastic: dict[str, Any] | None,
            started_at: float) -> dict[str, Any]:
    name = doc["metadata"]["name"]
    events = [{"t": _seconds_since(e.at, started_at), "type": e.type, "reason": e.reason,
               "message": e.message} for e in last.events if e.job == name]
    decisions = [e for e in events if e["reason"] in DECISIONS]
    job = next((j for j in last.jobs if j.name == name), None)
    workers = [s["jobs"][name]["workers"] for s in timeline
               if name in s["jobs"] and s["jobs"][name]["workers"]]
    return {
        "job": name,
        "finished": elastic is not None,
        "phase": job.phase if job else None,
        "scale_ups": sum(e["reason"] == "ScaleUp" for e in events),
        "scale_downs": sum(e["reason"] == "ScaleDown" for e in events),
        "steps": len(elastic["steps"]) if elastic else (job.step if job else 0),
        "seconds": round(timeline[-1]["t"], 1) if timeline else 0.0,
        "workers": {"min": min(workers, default=0), "max": max(workers, default=0)},
        "cluster": {"nodes": config.nodes, "gpus_per_node": config.gpus_per_node},
        "events": events,
        "decisions": decisions,
        "reconfigurations": [
            {**{k: c[k] for k in ("at_step", "workers", "pause_s", "bytes_moved") if k in c},
             "layouts": [{"dp": c[end]["dp"], "pp": c[end]["pp"]} for end in ("from", "to")]}
            for c in (elastic or {}).get("reconfigurations", [])],
        "arrivals": arrivals,
        "timeline": timeline,
    }


def static_run(job_path: Path, workers: int, workdir: Path, *, steps: int,
               console: Console | None = None, timeout_s: float = 900) -> dict:
    """``tidal run JOB --workers N``: the same job without any change of worker count, its
    ``steps`` followed in its log: a progress bar on a terminal, else a line per tenth."""
    console = console or Console()
    out = workdir / "static.json"
    log_path = workdir / "logs" / "static.log"
    tidal = Path(sys.executable).with_name("tidal")
    start = log_path.stat().st_size if log_path.is_file() else 0  # the log is appended to
    proc = spawn([str(tidal), "run", str(job_path), "--workers", str(workers), "--report",
                  str(out)], env=dict(os.environ), log_path=log_path)
    try:
        code = follow_static_run(proc, log_path, start, steps, console, timeout_s)
    except BaseException:  # Ctrl-C or the timeout: leave nothing behind
        terminate(proc, grace_s=5.0)
        raise
    if code != 0:
        raise DemoError(f"the static run failed (exit {code}); see {workdir / 'logs/static.log'}")
    return json.loads(out.read_text())


def follow_static_run(proc: subprocess.Popen, log_path: Path, start: int, steps: int,
                      console: Console, timeout_s: float) -> int:
    """Wait for the static run, showing the steps its log has reached past byte ``start``;
    its exit code."""
    deadline = time.monotonic() + timeout_s
    every = max(1, steps // PROGRESS_LINES)
    shown = 0

    def show(done: int) -> None:
        nonlocal shown
        bar.update(task, completed=done)
        if not console.is_terminal and done > shown and (done - shown >= every or done == steps):
            shown = done
            console.print(f"  static run: step {done}/{steps}")

    columns = (TextColumn("static run"), BarColumn(), MofNCompleteColumn(),
               TimeRemainingColumn())
    bar = Progress(*columns, console=console, transient=True)
    task = bar.add_task("static run", total=steps)
    with bar if console.is_terminal else nullcontext():
        while (code := proc.poll()) is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(proc.args, timeout_s)
            show(steps_logged(log_path, start))
            time.sleep(0.5)
        show(steps_logged(log_path, start))  # the steps logged since the last look
    return code


def steps_logged(log_path: Path, start: int = 0) -> int:
    """Steps that ``tidal run`` has reported in its log past byte ``start``."""
    try:
        with log_path.open("rb") as log:
            log.seek(start)
            numbers = STEP_LINE.findall(log.read())
    except OSError:
        return 0
    return max((int(n) + 1 for n in numbers), default=0)


def compare(elastic: dict[str, Any], static: dict[str, Any]) -> dict[str, Any]:
    """Strict mode's promise: the same float.hex loss at every step, the same parameters."""
    ours = [s["loss_hex"] for s in elastic["steps"]]
    theirs = [s["loss_hex"] for s in static["steps"]]
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    return {
        "bitwise_equal": ours == theirs,
        "params_equal": elastic["params_sha256"] == static["params_sha256"],
        "first_difference_at_step": first,
        "static_steps": len(theirs),
        "final_loss": elastic["steps"][-1]["loss"] if elastic["steps"] else None,
    }


def _shape(layout: dict[str, int]) -> str:
    return f"dp{layout['dp']} x pp{layout['pp']}"


def summary_table(report: dict[str, Any]) -> Table:
    table = Table(title=f"tidal local demo: {report['job']}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("finished", f"{report['finished']} ({report['phase']})"),
        ("steps / seconds", f"{report['steps']} in {report['seconds']:.0f} s"),
        ("scale-ups / scale-downs", f"{report['scale_ups']} / {report['scale_downs']}"),
        ("workers", f"{report['workers']['min']} .. {report['workers']['max']}"),
        *((f"switch at step {c['at_step']}", f"{c['workers'][0]} -> {c['workers'][1]} workers "
           f"({_shape(c['layouts'][0])} -> {_shape(c['layouts'][1])}), "
           f"pause {c['pause_s'] * 1e3:.0f} ms, "
           f"{c['bytes_moved'] / 2**20:.1f} MiB moved")
          for c in report["reconfigurations"]),
        ("non-elastic jobs", str(len(report["arrivals"]))),
        ("bitwise equal to a static run", f"losses {report['bitwise_equal']}, parameters "
                                          f"{report.get('params_equal')}"),
        ("plot", report.get("plot", "-")),
    ]
    if "report" in report:
        rows.append(("report", report["report"]))
    for key, value in rows:
        table.add_row(key, value)
    return table
