"""``tidal sim``: every policy over one trace, as a rich table and a JSON report.

``tidal_cli`` mounts the command next to the agent's; heavy work happens inside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from tidal_sim.compare import Outcome, beaten_by, compare, tradeoff
from tidal_sim.config import DEFAULT_LOADED_THRESHOLD, DEFAULT_THRESHOLD, POLICIES, QUEUES
from tidal_sim.trace import (
    DEFAULT_LOAD, DEFAULT_SHARE, GPUS_PER_NODE, default_nodes, load_trace, mark_elastic,
)

_COLUMNS = (
    ("jct_speedup", "JCT speedup", "{:.2f}x"), ("queue_ratio", "queue ratio", "{:.3f}x"),
    ("elastic_jct_mean_s", "JCT mean s", "{:,.0f}"), ("elastic_jct_p99_s", "JCT p99 s", "{:,.0f}"),
    ("queue_mean_s", "queue mean s", "{:,.0f}"), ("queue_p99_s", "queue p99 s", "{:,.0f}"),
    ("gpu_utilisation", "GPU util", "{:.1%}"), ("scale_ups", "ups", "{}"),
    ("scale_downs", "downs", "{}"), ("switch_seconds", "switch s", "{:,.0f}"),
)


def _policies(ctx, param, value: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise click.BadParameter(f"choose from {', '.join(POLICIES)}; got {value!r}")
    return names


def _thresholds(ctx, param, value: str) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        out = (-1.0,)
    if any(not 0 <= t < 1 for t in out):
        raise click.BadParameter(f"give thresholds in [0, 1) separated by commas; got {value!r}")
    return out


def elastic_rule(share: float) -> str:
    return (f"largest jobs by GPU-hours up to {share:.0%} of the trace's, multiples of 8 GPUs "
            f"only; FlexTrain small <= 32 GPUs, medium <= 128, large above; minimum = requested "
            f"GPUs; speedup at w workers = the table's at the largest scale factor <= w / minimum")


def run_trace(trace_path: Path, *, policies=POLICIES, elastic: str = "pp",
              share: float = DEFAULT_SHARE, load: float = DEFAULT_LOAD, nodes: int | None = None,
              seed: int = 0, pause_scale: float = 1.0, peer_snapshots: bool = False,
              threshold: float = DEFAULT_THRESHOLD,
              loaded_threshold: float = DEFAULT_LOADED_THRESHOLD, start_below: float = 0.0,
              queue: str = "pods", tradeoff_at: tuple[float, ...] = (),
              console: Console | None = None) -> tuple[dict, dict[str, Outcome]]:
    """Simulate ``policies`` (and static) over one trace with a progress bar per policy, and
    tidal at each threshold of ``tradeoff_at``; the JSON report and each policy's
    :class:`Outcome`."""
    try:
        jobs = mark_elastic(load_trace(trace_path), share=share)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if not jobs:
        raise click.ClickException(f"{trace_path} has no job with GPUs and a duration")
    nodes = nodes or default_nodes(jobs, load=load)
    names = list(dict.fromkeys(("static", *policies)))
    console = console or Console(stderr=True)
    if not any(j.size for j in jobs):
        console.print(f"[yellow]warning:[/] no job of {trace_path.name} is elastic (only jobs "
                      f"of whole 8-GPU nodes qualify, up to --share {share:g} of the GPU-hours): "
                      f"every policy runs as static does")
    with Progress(TextColumn("{task.description:>24}"), BarColumn(), TaskProgressColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        bars = {n: progress.add_task(f"{trace_path.stem} {n} ({elastic})", total=1.0)
                for n in names}
        try:
            options = dict(elastic=elastic, seed=seed, pause_scale=pause_scale,
                           peer_snapshots=peer_snapshots, start_below=start_below, queue=queue)
            runs = compare(jobs, nodes, policies=policies, threshold=threshold,
                           loaded_threshold=loaded_threshold,
                           progress=lambda n, f: progress.update(bars[n], completed=f),
                           **options)
            curve = tradeoff(jobs, nodes, list(tradeoff_at), runs["static"].report, **options)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
    report = {
        "trace": str(trace_path), "nodes": nodes, "gpus_per_node": GPUS_PER_NODE,
        "gpus": GPUS_PER_NODE * nodes,
        "elastic": elastic, "seed": seed, "share": share, "load": load,
        "pause_scale": pause_scale, "peer_snapshots": peer_snapshots,
        "threshold": threshold, "loaded_threshold": loaded_threshold,
        "start_below": start_below, "queue": queue, "tradeoff": curve,
        "jobs": len(jobs), "elastic_jobs": sum(1 for j in jobs if j.size),
        "elastic_rule": elastic_rule(share),
        "ceiling_jct_speedup": runs["static"].ceiling_speedup,
        "policies": {n: r.report for n, r in runs.items()},
        "tidal_beaten_by": beaten_by({n: r.report for n, r in runs.items()}),
    }
    return report, runs


def print_table(report: dict, console: Console) -> None:
    table = Table(title=f"{Path(report['trace']).name}: {report['nodes']} nodes x "
                        f"{report['gpus_per_node']} GPUs, {report['elastic_jobs']} of "
                        f"{report['jobs']} jobs elastic ({report['elastic']})",
                  caption=f"ceiling: {report['ceiling_jct_speedup']:.2f}x JCT speedup if "
                          f"every elastic job ran at its table's cap, queued as under static")
    table.add_column("policy")
    for _, title, _ in _COLUMNS:
        table.add_column(title, justify="right")
    for name, run in report["policies"].items():
        table.add_row(name, *("n/a" if run[key] is None else fmt.format(run[key])
                              for key, _, fmt in _COLUMNS))
    console.print(table)
    if report["tradeoff"]:
        curve = Table(title="tidal: elastic JCT against non-elastic queue, over the threshold")
        for title in ("threshold", "JCT speedup", "queue ratio"):
            curve.add_column(title, justify="right")
        for point in report["tradeoff"]:
            queue = point["queue_ratio"]
            curve.add_row(f"{point['threshold']:g}", f"{point['jct_speedup']:.2f}x",
                          "n/a" if queue is None else f"{queue:.4f}x")
        console.print(curve)
    if "tidal" in report["policies"]:
        beaten = report["tidal_beaten_by"]
        console.print("tidal beaten on both counts (elastic JCT and queue, beyond 0.5%) by: "
                      + (", ".join(beaten) if beaten else "none"))


@click.command()
@click.option("--trace", "trace_path", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Job trace CSV: job_id, submission_time, duration, num_gpu.")
@click.option("--policy", "policies", default=",".join(POLICIES), show_default=True,
              callback=_policies, help="Comma-separated policies to simulate (static, the "
                                       "baseline, always runs).")
@click.option("--elastic", type=click.Choice(["pp", "dp-pp"]), default="pp", show_default=True,
              help="Which FlexTrain scale tables the elastic jobs use.")
@click.option("--share", type=click.FloatRange(0, 1), default=DEFAULT_SHARE, show_default=True,
              help="Elastic jobs: the largest by GPU-hours up to this share of the trace's.")
@click.option("--load", type=click.FloatRange(0, 1, min_open=True), default=DEFAULT_LOAD,
              show_default=True, help="The default cluster's mean load (see --nodes).")
@click.option("--nodes", type=click.IntRange(min=1), default=None,
              help="8-GPU nodes [default: the trace's mean GPU demand at --load, and at least "
                   "4x the largest elastic job, FlexTrain's elastic range].")
@click.option("--pause-scale", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Multiply every switch's pause and its wait for a step boundary; 0 makes "
                   "switches free and immediate, which shows how much of the result the switch "
                   "cost takes (a diagnostic).")
@click.option("--peer-snapshots/--no-peer-snapshots", default=False, show_default=True,
              help="tidal's jobs keep a peer snapshot at every step boundary "
                   "(snapshotEverySteps: 1), so a scale-down whose released workers' keepers "
                   "stay frees their GPUs at the step boundary. The swap's cost and host "
                   "memory are not modelled.")
@click.option("--threshold", type=click.FloatRange(0, 1, max_open=True),
              default=DEFAULT_THRESHOLD, show_default=True,
              help="tidal's scaling.probabilityThreshold: the Poisson rule's and the headroom "
                   "rule's (flextrain keeps its 0.6, greedy has none), on a lightly used "
                   "cluster.")
@click.option("--loaded-threshold", type=click.FloatRange(0, 1, max_open=True),
              default=DEFAULT_LOADED_THRESHOLD, show_default=True,
              help="tidal's scaling.loadedThreshold: its threshold slides toward this one as "
                   "the share of GPUs owed, smoothed over the arrival window, grows (the "
                   "--threshold itself: no slide).")
@click.option("--tradeoff", "tradeoff_at", callback=_thresholds, default="",
              help="Comma-separated thresholds to run tidal at besides, e.g. "
                   "0.6,0.9,0.99,0.999: its JCT speedup and queue ratio at each.")
@click.option("--start-below", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Elastic jobs may start with this fraction of their request (at least one "
                   "worker) where no more is free, as spec.workers.preferred above "
                   "workers.min lets them, and grow by the rules (0: off; static never).")
@click.option("--queue", type=click.Choice(QUEUES), default="pods", show_default=True,
              help="How queued jobs show to the policy: their pending pods (jobs create "
                   "their pods at once); a Kueue Workload's pending records (jobs wait in a "
                   "batch queue before any pod exists; an elastic job's minimum too); or, "
                   "hidden, nothing of a non-elastic job until it starts (Kueue as the "
                   "operator saw it before issue 39).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seeds the spread of switch pauses and waits; the same seed gives the same "
                   "report.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the JSON report here.")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write PNGs here: normalised JCT and queue time, queue-time CDF, GPUs.")
def sim(trace_path, policies, elastic, share, load, nodes, pause_scale, peer_snapshots,
        threshold, loaded_threshold, tradeoff_at, start_below, queue, seed, report_path,
        plots_dir) -> None:
    """Simulate the scaling policies over a job trace on a simulated clock."""
    report, runs = run_trace(trace_path, policies=policies, elastic=elastic, share=share,
                             load=load, nodes=nodes, seed=seed, pause_scale=pause_scale,
                             peer_snapshots=peer_snapshots, threshold=threshold,
                             loaded_threshold=loaded_threshold, start_below=start_below,
                             queue=queue, tradeoff_at=tradeoff_at)
    # A pipe or file gets the whole table, not one squeezed into 80 columns.
    print_table(report, Console() if sys.stdout.isatty() else Console(width=160))
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    if plots_dir is not None:
        # matplotlib only here: the images leave it out, and --help must not need it
        from tidal_sim.plots import write_plots

        write_plots(runs, report["gpus"], plots_dir, f"{trace_path.stem} ({elastic})")
