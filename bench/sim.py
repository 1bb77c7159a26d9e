"""Every policy over every cluster trace, with the defaults: the simulator's headline figures.

For each trace in ``--traces`` (default traces/elasticflow-itp) and each kind of
scale table (PP-only, DP+PP), ``tidal sim``'s run with its defaults: every policy's
``jct_speedup`` (static's mean elastic JCT over the policy's) and ``queue_ratio`` (the mean
non-elastic queue time over static's), then per policy the geometric mean of the speedups over
the traces and the worst queue ratio, and the wall seconds of each trace's run (all policies,
static included; the largest trace's against issue 27's 5 s target). Beside them, each trace's
ceiling: static's mean elastic JCT over what it would be if every elastic job ran at its
table's cap from its start (``Simulation.ceiling_speedup``), and the peers that beat tidal on
both counts there (``tidal_sim.compare.beaten_by``: at least as fast and as kind, beyond half
a percent on one; issue 39's target is none, on every trace, with every queue ratio at most
1.000). Prints JSON.

    python bench/sim.py [--traces DIR] [--out DIR] [--doc FILE] [--section sim]
                        [--json FILE] [--seed 0] [--load 0.8] [--share 0.3]
                        [--cluster default|elasticflow] [--pause-scale 1] [--peer-snapshots]
                        [--threshold 0.99] [--loaded-threshold 0.9]
                        [--tradeoff 0.6,0.9,0.99] [--start-below 0.25]
                        [--queue pods|workloads|hidden]

``--load`` and ``--share`` change the defaults of ``tidal sim`` for a sensitivity run;
``--pause-scale 0`` makes every switch free, to show how much the switch cost takes.
``--peer-snapshots`` lets tidal's scale-downs free their GPUs at the step boundary where the
released workers' keepers stay, as the agent does with peer snapshots.
``--cluster elasticflow`` replaces the default cluster size by the one the traces' publishers
simulated each trace on (ElasticFlow's artifact, ``scheduler/run_fig8b.sh``: 64 nodes of 8
GPUs, 128 for cluster04/07/08/09, 32 for the others).

``--threshold`` is tidal's ``probabilityThreshold`` (the spec's default otherwise), which
slides toward ``--loaded-threshold`` (``loadedThreshold``) as the cluster fills;
``--tradeoff 0.6,0.9,0.99`` also runs tidal at each of those thresholds, held (no slide),
and reports its geometric-mean JCT speedup and worst queue ratio at each, the trade-off
between the two;
``--start-below F`` lets elastic jobs start with ``F`` of their request where no more is free;
``--queue workloads`` shows queued jobs to the policy as Kueue Workloads' records, not pods,
and ``--queue hidden`` shows it nothing of a queued non-elastic job until it starts.

``--out DIR`` also writes each run's report and plots under ``DIR/<trace>-<tables>/`` (and
with ``--tradeoff`` the curve, ``DIR/tradeoff.png``);
``--doc FILE`` puts the Markdown tables into FILE between its ``<!-- sim:begin -->`` and
``<!-- sim:end -->`` lines (``--section NAME`` for another pair; docs/simulator.md is kept
that way).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / root) for root in ("api", "agent", "operator", "doubles")]

from rich.console import Console  # noqa: E402

from tidal_sim.cli import print_table, run_trace  # noqa: E402
from tidal_sim.compare import TOLERANCE, beaten_by, tradeoff  # noqa: E402
from tidal_sim.config import (  # noqa: E402
    DEFAULT_LOADED_THRESHOLD, DEFAULT_THRESHOLD, POLICIES, QUEUES,
)
from tidal_sim.trace import load_trace, mark_elastic  # noqa: E402
from tidal_sim.plots import write_plots, write_tradeoff  # noqa: E402
from tidal_sim.trace import DEFAULT_LOAD, DEFAULT_SHARE  # noqa: E402

# issue 39's: tidal beaten on both counts by no peer, no queue ratio above 1.000
TARGETS = {"beaten_by": [], "queue_ratio_worst_at_most": 1.0, "tolerance": TOLERANCE}
ELASTIC = ("pp", "dp-pp")


def elasticflow_nodes(trace: Path) -> int:
    """The nodes ElasticFlow's artifact (pkusys/ElasticFlow, scheduler/run_fig8b.sh) simulates
    the ITP trace ``trace`` on: n64g8 for clusters 01, 02, 03, 05 and 06, n128g8 for 04, 07,
    08 and 09, n32g8 for the rest."""
    name = trace.stem
    if name in ("cluster01", "cluster02", "cluster03", "cluster05", "cluster06"):
        return 64
    if name in ("cluster04", "cluster07", "cluster08", "cluster09"):
        return 128
    return 32


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summary_markdown(results: list[dict], summary: dict) -> str:
    policies = [p for p in POLICIES if p != "static"]
    lines = []
    for elastic in ELASTIC:
        title = "PP-only" if elastic == "pp" else "DP+PP"
        lines += [f"#### {title} scale tables", "",
                  "| trace | nodes (GPUs) | elastic jobs | "
                  + " | ".join(f"{p} JCT speedup / queue ratio" for p in policies)
                  + " | ceiling | seconds | tidal beaten on both counts by |",
                  "|---|---|---|" + "---|" * len(policies) + "---|---|---|"]
        for r in (r for r in results if r["elastic"] == elastic):
            cells = []
            for p in policies:
                run = r["policies"][p]
                ratio = "n/a" if run["queue_ratio"] is None else f"{run['queue_ratio']:.3f}"
                cells.append(f"{run['jct_speedup']:.2f}x / {ratio}")
            lines.append(f"| {Path(r['trace']).stem} | {r['nodes']} ({r['gpus']}) | "
                         f"{r['elastic_jobs']} of {r['jobs']} | " + " | ".join(cells)
                         + f" | {r['ceiling_jct_speedup']:.2f}x | {r['seconds']:.1f} | "
                         + (", ".join(r["tidal_beaten_by"]) or "none") + " |")
        means = summary[elastic]
        lines.append("| **geometric mean / worst** | | | " + " | ".join(
            f"**{means[p]['jct_speedup_geomean']:.2f}x** / {_worst(means[p])}"
            for p in policies) + f" | {means['ceiling_jct_speedup_geomean']:.2f}x | | "
            + f"beaten on {len(means['tidal_beaten'])} of {means['traces']} |")
        lines += ["", "Target (tidal, issue 39): beaten on both counts by no peer (at least as "
                      "fast and as kind, beyond 0.5% on one), every queue ratio at most 1.000.",
                  ""]
    if any(r["tradeoff"] for r in results):
        lines += ["#### tidal over the threshold (geometric mean JCT speedup / worst queue "
                  "ratio, and the traces where a peer beats it on both counts)", "",
                  "| threshold | PP-only | DP+PP |", "|---|---|---|"]
        for i, point in enumerate(summary["pp"]["tradeoff"]):
            cells = [f"{summary[e]['tradeoff'][i]['jct_speedup_geomean']:.3f}x / "
                     f"{_worst(summary[e]['tradeoff'][i])}, beaten on "
                     f"{summary[e]['tradeoff'][i]['beaten']}" for e in ELASTIC]
            lines.append(f"| {point['threshold']:g} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _worst(entry: dict) -> str:
    worst = entry["queue_ratio_worst"]
    return "n/a" if worst is None else f"{worst:.4f}"


def summarise(points: list[dict], key: str = "jct_speedup") -> dict:
    """The geometric mean of ``key`` over the traces' ``points`` and the worst queue ratio."""
    ratios = [p["queue_ratio"] for p in points]
    return {f"{key}_geomean": geomean([p[key] for p in points]),
            "queue_ratio_worst": None if None in ratios else max(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path,
                        default=ROOT / "traces" / "elasticflow-itp")
    parser.add_argument("--out", type=Path, help="reports and plots here")
    parser.add_argument("--doc", type=Path, help="Markdown file whose tables to rewrite")
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load", type=float, default=DEFAULT_LOAD)
    parser.add_argument("--share", type=float, default=DEFAULT_SHARE)
    parser.add_argument("--cluster", choices=("default", "elasticflow"), default="default",
                        help="cluster size: tidal sim's default, or ElasticFlow's per trace")
    parser.add_argument("--pause-scale", type=float, default=1.0,
                        help="multiply every switch's pause (0: free switches)")
    parser.add_argument("--peer-snapshots", action="store_true",
                        help="tidal's jobs keep peer snapshots (see tidal sim --help)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help="tidal's probabilityThreshold")
    parser.add_argument("--loaded-threshold", type=float, default=DEFAULT_LOADED_THRESHOLD,
                        help="tidal's loadedThreshold (its --threshold: no slide)")
    parser.add_argument("--start-below", type=float, default=0.0,
                        help="elastic jobs may start with this fraction of their request")
    parser.add_argument("--tradeoff", default="",
                        help="comma-separated thresholds to run tidal at besides")
    parser.add_argument("--queue", choices=QUEUES, default="pods",
                        help="queued jobs show as their pods, as Kueue Workloads, or not")
    parser.add_argument("--section", default="sim",
                        help="the --doc section: <!-- SECTION:begin --> ... <!-- SECTION:end -->")
    args = parser.parse_args()
    thresholds = [float(t) for t in args.tradeoff.split(",") if t.strip()]
    traces = sorted(args.traces.glob("*.csv"))
    if not traces:
        parser.error(f"no *.csv trace in {args.traces}")
    console = Console(stderr=True, width=160)
    results = []
    for elastic in ELASTIC:
        for trace in traces:
            started = time.perf_counter()
            nodes = elasticflow_nodes(trace) if args.cluster == "elasticflow" else None
            options = dict(elastic=elastic, seed=args.seed, pause_scale=args.pause_scale,
                           peer_snapshots=args.peer_snapshots, start_below=args.start_below,
                           queue=args.queue)
            report, runs = run_trace(trace, load=args.load, share=args.share, nodes=nodes,
                                     threshold=args.threshold,
                                     loaded_threshold=args.loaded_threshold, console=console,
                                     **options)
            report["seconds"] = time.perf_counter() - started  # all four policies
            jobs = mark_elastic(load_trace(trace), share=args.share)
            report["tradeoff"] = tradeoff(jobs, report["nodes"], thresholds,
                                          runs["static"].report, **options)
            for point in report["tradeoff"]:
                point["beaten_by"] = beaten_by({**report["policies"], "tidal": point})
            print_table(report, console)
            if args.out is not None:
                where = args.out / f"{trace.stem}-{elastic}"
                where.mkdir(parents=True, exist_ok=True)
                (where / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False)
                                                   + "\n")
                write_plots(runs, report["gpus"], where, f"{trace.stem} ({elastic})")
            results.append(report)
    summary: dict = {}
    for elastic in ELASTIC:
        runs = [r for r in results if r["elastic"] == elastic]
        summary[elastic] = {"ceiling_jct_speedup_geomean": geomean(
            [r["ceiling_jct_speedup"] for r in runs])}
        for policy in POLICIES:
            summary[elastic][policy] = summarise([r["policies"][policy] for r in runs])
        summary[elastic]["traces"] = len(runs)
        summary[elastic]["tradeoff"] = [
            {"threshold": t} | summarise([r["tradeoff"][i] for r in runs])
            | {"beaten": sum(bool(r["tradeoff"][i]["beaten_by"]) for r in runs)}
            for i, t in enumerate(thresholds)]
        summary[elastic]["tidal_beaten"] = {Path(r["trace"]).stem: r["tidal_beaten_by"]
                                            for r in runs if r["tidal_beaten_by"]}
    if args.out is not None and thresholds:
        write_tradeoff({e: summary[e]["tradeoff"] for e in ELASTIC}, args.out / "tradeoff.png")
    largest = max(traces, key=lambda t: t.stat().st_size)
    out = {
        "benchmark": "sim", "seed": args.seed, "load": args.load, "share": args.share,
        "cluster": args.cluster, "pause_scale": args.pause_scale,
        "peer_snapshots": args.peer_snapshots, "threshold": args.threshold,
        "loaded_threshold": args.loaded_threshold,
        "start_below": args.start_below, "queue": args.queue,
        "traces": [t.name for t in traces],
        "targets": TARGETS, "summary": summary,
        "largest_trace": largest.name,
        "largest_trace_seconds": {r["elastic"]: r["seconds"] for r in results
                                  if r["trace"] == str(largest)},
        "runs": [{k: r[k] for k in ("trace", "elastic", "nodes", "gpus", "jobs",
                                    "elastic_jobs", "ceiling_jct_speedup", "seconds",
                                    "tradeoff", "tidal_beaten_by")}
                 | {"policies": {p: {k: r["policies"][p][k]
                                     for k in ("jct_speedup", "queue_ratio")}
                                 for p in POLICIES}} for r in results],
    }
    text = json.dumps(out, indent=2, allow_nan=False)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    if args.doc is not None:
        doc = args.doc.read_text()
        begin, end = f"<!-- {args.section}:begin -->\n", f"<!-- {args.section}:end -->"
        if begin not in doc or end not in doc:
            sys.exit(f"{args.doc} has no {begin.strip()} ... {end} section to rewrite")
        head, rest = doc.split(begin, 1)
        args.doc.write_text(head + begin + summary_markdown(results, summary) + "\n"
                            + end + rest.split(end, 1)[1])


if __name__ == "__main__":
    main()
