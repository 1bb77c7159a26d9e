"""``tidal sim``: every policy over one trace, as a rich table and a JSON report.

``tidal_cli`` mounts the command next to the agent's; heavy work happens inside it.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from tidal_operator.sim.engine import POLICIES, compare
from tidal_operator.sim.trace import default_nodes, load_trace, mark_elastic

_COLUMNS = (
    ("jct_speedup", "JCT speedup", "{:.2f}x"), ("queue_ratio", "queue ratio", "{:.2f}x"),
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


@click.command()
@click.option("--trace", "trace_path", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Job trace CSV: job_id, submission_time, duration, num_gpu.")
@click.option("--policy", "policies", default=",".join(POLICIES), show_default=True,
              callback=_policies, help="Comma-separated policies to simulate.")
@click.option("--elastic", type=click.Choice(["pp", "dp-pp"]), default="pp", show_default=True,
              help="Which FlexTrain scale tables the elastic jobs use.")
@click.option("--share", type=click.FloatRange(0, 1), default=0.3, show_default=True,
              help="Elastic jobs: the largest by GPU-hours up to this share of the trace's.")
@click.option("--nodes", type=click.IntRange(min=1), default=None,
              help="8-GPU nodes [default: mean demand at 80% load, at least twice the "
                   "largest job].")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the JSON report here.")
def sim(trace_path, policies, elastic, share, nodes, report_path) -> None:
    """Simulate the scaling policies over a job trace on a simulated clock."""
    console = Console(stderr=True)
    jobs = mark_elastic(load_trace(trace_path), share=share)
    nodes = nodes or default_nodes(jobs)
    with console.status(f"simulating {len(jobs)} jobs on {nodes} nodes: "
                        f"{', '.join(policies)} ({elastic})"):
        runs = compare(jobs, nodes, policies=policies, elastic=elastic)
    table = Table(title=f"{trace_path.name}: {nodes} nodes x 8 GPUs, "
                        f"{sum(1 for j in jobs if j.size)} elastic jobs ({elastic})")
    table.add_column("policy")
    for _, title, _ in _COLUMNS:
        table.add_column(title, justify="right")
    for name, run in runs.items():
        table.add_row(name, *(fmt.format(run[key]) for key, _, fmt in _COLUMNS))
    Console().print(table)
    if report_path is not None:
        report = {
            "trace": str(trace_path), "nodes": nodes, "gpus_per_node": 8,
            "gpus": 8 * nodes, "elastic": elastic,
            "elastic_rule": (f"largest jobs by GPU-hours up to {share:.0%} of the trace's, "
                             "multiples of 8 GPUs only; FlexTrain small <= 32 GPUs, "
                             "medium <= 128, large above; minimum = requested GPUs"),
            "policies": runs,
        }
        report_path.write_text(json.dumps(report, indent=2) + "\n")
