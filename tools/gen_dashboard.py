"""Write charts/tidal/dashboards/tidal.json, Tidal's Grafana dashboard, from code.

    python tools/gen_dashboard.py            # rewrite the checked-in dashboard
    python tools/gen_dashboard.py --check    # exit 1 if it is out of date

Built with Grafana's own SDK (grafana-foundation-sdk, a dev dependency), so that panels,
queries and variables are typed rather than hand-written JSON. The chart reads the JSON file
into a ConfigMap labelled ``grafana_dashboard: "1"``; tests/integration/test_dashboard.py runs
every query in it against a real Prometheus that scraped an elastic run.

The series come from operator/tidal_operator/metrics.py (``tidal_*``, the cluster and each
job as the operator sees it) and agent/tidal_agent/metrics.py (``tidal_agent_*``, exported by
the job's leader). Both label jobs with ``namespace`` and ``job``: scrape them with
``honor_labels: true``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import stat, timeseries
from grafana_foundation_sdk.builders.common import VizLegendOptions
from grafana_foundation_sdk.builders.dashboard import (
    AnnotationQuery,
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    AxisPlacement,
    GraphDrawStyle,
    LegendDisplayMode,
    LegendPlacement,
    LineInterpolation,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DynamicConfigValue,
    VariableRefresh,
    VariableSort,
)

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_PATH = ROOT / "charts" / "tidal" / "dashboards" / "tidal.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
JOB = 'namespace="$namespace", job="$job"'  # the selector of the chosen job's series


def query(expr: str, legend: str, ref: str = "A") -> Dataquery:
    return Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)


def chart(title: str, description: str, *queries: tuple[str, str], unit: str = "short",
          width: int = 12, height: int = 8) -> timeseries.Panel:
    """A time-series panel of ``(expr, legend)`` queries."""
    panel = (timeseries.Panel().title(title).description(description).unit(unit)
             .datasource(DATASOURCE).span(width).height(height).fill_opacity(10)
             .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST)
                     .placement(LegendPlacement.BOTTOM).show_legend(True)))
    for ref, (expr, legend) in zip("ABCDEFGH", queries, strict=False):
        panel.with_target(query(expr, legend, ref))
    return panel


def number(title: str, expr: str, unit: str = "none") -> stat.Panel:
    return (stat.Panel().title(title).unit(unit).datasource(DATASOURCE).span(6).height(4)
            .with_target(query(expr, title)))


def dashboard() -> Dashboard:
    board = (
        Dashboard("Tidal: elastic training").uid("tidal").tags(["tidal"]).editable()
        .description("One ElasticTrainingJob against its cluster: workers and idle GPUs, "
                     "layout, throughput, loss, step time and every scale event.")
        .time("now-1h", "now").refresh("30s").tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(QueryVariable("namespace").label("Namespace").datasource(DATASOURCE)
                       .query("label_values(tidal_job_workers, namespace)")
                       .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
                       .sort(VariableSort.ALPHABETICAL_ASC))
        .with_variable(QueryVariable("job").label("Job").datasource(DATASOURCE)
                       .query('label_values(tidal_job_workers{namespace="$namespace"}, job)')
                       .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
                       .sort(VariableSort.ALPHABETICAL_ASC))
        # Every scale decision and every switch, drawn across all panels.
        .annotation(AnnotationQuery().name("Scale decisions").datasource(DATASOURCE)
                    .enable(True).icon_color("orange")
                    .expr(f"increase(tidal_job_decisions_total{{{JOB}}}[$__rate_interval]) > 0"))
        .annotation(AnnotationQuery().name("Reconfigurations").datasource(DATASOURCE)
                    .enable(True).icon_color("purple")
                    .expr(f"changes(tidal_agent_generation{{{JOB}}}[$__rate_interval]) > 0"))
    )

    board.with_row(Row("Job $job"))
    board.with_panel(number("Step", f"tidal_agent_step{{{JOB}}}"))
    board.with_panel(number("Workers", f"tidal_agent_workers{{{JOB}}}"))
    board.with_panel(number("Generation", f"tidal_agent_generation{{{JOB}}}"))
    board.with_panel(number("Agents up", f"sum(tidal_agent_up{{{JOB}}})"))
    board.with_panel(chart(
        "Workers and idle GPUs",
        "The job's workers (applied generation) and the operator's target, against the "
        "cluster's idle GPUs and the GPUs that pending non-elastic pods ask for.",
        (f"tidal_job_workers{{{JOB}}}", "workers"),
        (f"tidal_job_target_workers{{{JOB}}}", "target workers"),
        ("tidal_idle_gpus", "idle GPUs (cluster)"),
        ("tidal_pending_gpu_demand", "pending GPU demand (cluster)"),
    ).line_interpolation(LineInterpolation.STEP_AFTER))
    board.with_panel(chart(
        "Layout",
        "Data- and pipeline-parallel degrees of the layout that trains now.",
        (f"tidal_agent_dp{{{JOB}}}", "dp"),
        (f"tidal_agent_pp{{{JOB}}}", "pp"),
    ).line_interpolation(LineInterpolation.STEP_AFTER))
    board.with_panel(chart(
        "Throughput", "Tokens per second over the last steps of the running layout.",
        (f"tidal_agent_tokens_per_second{{{JOB}}}", "tokens/s"), unit="suffix: tok/s"))
    board.with_panel(chart(
        "Loss", "Training loss of the last step.", (f"tidal_agent_loss{{{JOB}}}", "loss")))
    board.with_panel(chart(
        "Step time: predicted vs measured",
        "The last step's seconds against the planner's prediction for the running layout: "
        "the modeling-based one, then the running job's own profile's once its first steps "
        "are profiled.",
        (f"tidal_agent_step_seconds{{{JOB}}}", "measured"),
        (f"tidal_agent_predicted_step_seconds{{{JOB}}}", "predicted"), unit="s"))
    board.with_panel(chart(
        "Worker speed",
        "Each worker's decoder-layer speed relative to the fastest (1: as fast), and the "
        "workers flagged as stragglers (details in the job's Events).",
        (f"tidal_agent_relative_speed{{{JOB}}}", "{{member}}"),
        (f"tidal_agent_stragglers{{{JOB}}}", "stragglers"),
    ))
    board.with_panel(chart(
        "Scale decisions",
        "The operator's decisions for this job in each interval, restarts included (details "
        "in the job's Events).",
        (f"increase(tidal_job_decisions_total{{{JOB}}}[$__rate_interval])", "{{kind}}"),
    ).draw_style(GraphDrawStyle.BARS).fill_opacity(80))
    board.with_panel(chart(
        "Reconfigurations and their pause",
        "Switches of the worker count in each interval, and the pause of the last one.",
        (f"increase(tidal_agent_reconfigurations_total{{{JOB}}}[$__rate_interval])",
         "{{direction}}"),
        (f"tidal_agent_last_switch_pause_seconds{{{JOB}}}", "last pause"),
    ).draw_style(GraphDrawStyle.BARS).fill_opacity(80).override_by_name("last pause", [
        DynamicConfigValue(id_val="unit", value="s"),
        DynamicConfigValue(id_val="custom.drawStyle", value="line"),
        DynamicConfigValue(id_val="custom.lineInterpolation", value="stepAfter"),
        DynamicConfigValue(id_val="custom.axisPlacement", value=AxisPlacement.RIGHT),
    ]))
    board.with_panel(chart(
        "State moved by switches", "Bytes of parameters and optimizer state moved per interval.",
        (f"increase(tidal_agent_bytes_moved_total{{{JOB}}}[$__rate_interval])", "moved"),
        unit="bytes").draw_style(GraphDrawStyle.BARS).fill_opacity(80))
    board.with_panel(chart(
        "Faults",
        "Workers lost (deleted at a drain deadline, or gone with their node) and the steps "
        "trained again from the peer snapshot or checkpoint resumed from, per interval.",
        (f"increase(tidal_agent_lost_workers_total{{{JOB}}}[$__rate_interval])", "lost workers"),
        (f"increase(tidal_agent_replayed_steps_total{{{JOB}}}[$__rate_interval])",
         "replayed steps"),
    ).draw_style(GraphDrawStyle.BARS).fill_opacity(80))

    board.with_row(Row("Cluster"))
    board.with_panel(chart(
        "GPUs", "Allocatable, idle, and asked for by pending non-elastic pods.",
        ("tidal_gpus", "GPUs"), ("tidal_idle_gpus", "idle"),
        ("tidal_pending_gpu_demand", "pending demand"), ("tidal_pending_gpu_pods", "pending pods"),
        width=8,
    ).line_interpolation(LineInterpolation.STEP_AFTER))
    board.with_panel(chart(
        "Non-elastic arrivals", "Arrivals per hour over the arrival window (the Poisson rate).",
        ("tidal_arrival_rate_per_hour", "arrivals/h"), width=8))
    board.with_panel(chart(
        "Decision latency", "Seconds to snapshot the cluster and decide, per round.",
        ("histogram_quantile(0.5, sum by (le) (rate(tidal_decision_seconds_bucket"
         "[$__rate_interval])))", "p50"),
        ("histogram_quantile(0.99, sum by (le) (rate(tidal_decision_seconds_bucket"
         "[$__rate_interval])))", "p99"),
        unit="s", width=8))
    return board


def render() -> str:
    """The dashboard as the JSON text that is checked in."""
    board = dashboard().build()
    for number_, panel in enumerate(board.panels or (), start=1):
        panel.id_val = number_  # stable ids: Grafana needs them unique
    return json.dumps(board, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is out of date")
    parser.add_argument("path", nargs="?", type=Path, default=DASHBOARD_PATH)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.path.exists() or args.path.read_text() != text:
            print(f"{args.path} is out of date: run python tools/gen_dashboard.py",
                  file=sys.stderr)
            return 1
        return 0
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
