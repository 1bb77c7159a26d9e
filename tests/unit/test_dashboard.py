"""The Grafana dashboard and the metrics it reads (issue 7, item 4), without Prometheus.

The checked-in JSON is the generator's output; every series a panel queries is one that the
operator's or the agent's registry exports; the agent's metrics follow the worker's events.
tests/integration/test_dashboard.py runs the queries against a real Prometheus.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import types
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tidal_agent.events import Reconfigured, Recovered, Stepped
from tidal_agent.metrics import AgentMetrics
from tidal_agent.report import AgentReport
from tidal_operator.metrics import Metrics
from tidal_plan.elastic import Generation
from tidal_plan.layout import build_layout

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "tidal" / "dashboards" / "tidal.json"


def _generator() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gen_dashboard", ROOT / "tools" / "gen_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def queries(board: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets (rows included) and annotations."""
    panels = [*board["panels"], *(p for row in board["panels"] for p in row.get("panels", ()))]
    exprs = [t["expr"] for p in panels for t in p.get("targets", ())]
    return exprs + [a["expr"] for a in board["annotations"]["list"] if "expr" in a]


def test_the_checked_in_dashboard_is_the_generators_output(tmp_path):
    gen = _generator()
    assert DASHBOARD.read_text() == gen.render(), "run: python tools/gen_dashboard.py"
    stale = tmp_path / "tidal.json"
    stale.write_text("{}\n")
    assert gen.main(["--check", str(stale)]) == 1
    assert gen.main([str(stale)]) == 0 and gen.main(["--check", str(stale)]) == 0


def test_panels_show_what_the_issue_asks_for_from_one_datasource():
    board = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["job"]["query"] == 'label_values(tidal_job_workers{namespace="$namespace"}, job)'
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    by_title = {p["title"]: p for p in panels if p["type"] != "row"}
    for title in ("Workers and idle GPUs", "Layout", "Throughput", "Loss",
                  "Step time: predicted vs measured", "Scale decisions",
                  "Reconfigurations and their pause"):
        assert title in by_title, title
    exprs = lambda title: [t["expr"] for t in by_title[title]["targets"]]  # noqa: E731
    assert "tidal_idle_gpus" in exprs("Workers and idle GPUs")
    assert any("tidal_agent_predicted_step_seconds" in e for e in exprs("Step time: predicted vs measured"))
    for panel in by_title.values():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
    names = [a["name"] for a in board["annotations"]["list"]]
    assert names == ["Scale decisions", "Reconfigurations"]


def _exported(registry) -> set[str]:
    return {sample.name for family in registry.collect() for sample in family.samples}


def test_every_series_the_dashboard_queries_is_exported():
    """A misspelt metric would only show as an empty panel: check names against registries."""
    agent = AgentMetrics(namespace="ns", job="j", pod="j-worker-0", leader=True)
    agent.job.speeds({"j-worker-0": 1.0}, 0)  # per member: its series come with the members
    operator = Metrics()
    operator.observe_job("ns", "j", workers=2, target_workers=2, generation=0)
    exported = _exported(agent.registry) | _exported(operator.registry)
    board = json.loads(DASHBOARD.read_text())
    used = {name for expr in queries(board) for name in re.findall(r"\btidal_\w+", expr)}
    assert used - exported == set()
    assert len(used) >= 15


def _samples(registry) -> dict[tuple, float]:
    return {(s.name, *sorted(s.labels.items())): s.value
            for family in registry.collect() for s in family.samples}


def stepped(step: int, loss: float, seconds: float, layout) -> Stepped:
    return Stepped(worker="a", step=step, loss=loss, loss_hex=loss.hex(), grad_norm=1.0, lr=1e-3,
                   seconds=seconds, snapshot_s=None, layout=layout)


def test_agent_metrics_follow_the_leaders_events():
    metrics = AgentMetrics(namespace="ns", job="j", pod="j-worker-0", leader=True)
    report = AgentReport(None, tokens_per_step=1024, metrics=metrics.job)
    job = (("job", "j"), ("namespace", "ns"))
    before = _samples(metrics.registry)
    assert before[("tidal_agent_up", *job[:1], ("namespace", "ns"), ("pod", "j-worker-0"))] == 1
    assert before[("tidal_agent_reconfigurations_total", ("direction", "grow"), *job)] == 0
    assert before[("tidal_agent_step", *job)] == 0
    for unknown in ("loss", "predicted_step_seconds", "generation", "pp", "last_switch_pause_seconds"):
        assert math.isnan(before[(f"tidal_agent_{unknown}", *job)]), unknown

    two, three = (build_layout(num_units=8, workers=w, micro_batch_size=2, num_micro_batches=8)
                  for w in (2, 3))
    report.planned(0, 0.25)
    report.applied(Generation(index=0, at_step=0, members=("a", "b")), two)
    for step, seconds in enumerate((0.5, 0.3, 0.4)):
        report.put(stepped(step, 5.0 - step, seconds, two))
    report.planned(1, None)
    report.put(Reconfigured(
        worker="a", generation=1, at_step=3, members=("a", "b", "c"), from_layout=two,
        to_layout=three, workers=(2, 3), pause_s=0.07, world_s=0.01, rebuild_s=0.01,
        transfer_s=0.04, bytes_moved=4096, bytes_min=4096, buckets=1, released_at_once=False))
    got = _samples(metrics.registry)
    assert got[("tidal_agent_step", *job)] == 3  # steps completed
    assert got[("tidal_agent_loss", *job)] == 3.0
    assert got[("tidal_agent_step_seconds", *job)] == 0.4  # the last step's
    assert got[("tidal_agent_tokens_per_second", *job)] == 1024 / 0.4  # over the median
    assert (got[("tidal_agent_generation", *job)], got[("tidal_agent_workers", *job)]) == (1, 3)
    assert (got[("tidal_agent_dp", *job)], got[("tidal_agent_pp", *job)]) == (1, 3)
    assert math.isnan(got[("tidal_agent_predicted_step_seconds", *job)])  # none for gen 1
    assert got[("tidal_agent_reconfigurations_total", ("direction", "grow"), *job)] == 1
    assert got[("tidal_agent_reconfigurations_total", ("direction", "shrink"), *job)] == 0
    assert got[("tidal_agent_last_switch_pause_seconds", *job)] == 0.07
    assert got[("tidal_agent_switch_pause_seconds_count", *job)] == 1
    assert got[("tidal_agent_bytes_moved_total", *job)] == 4096

    # A fault: worker c is lost at step 4 and the survivors resume from step 2's checkpoint.
    report.put(stepped(3, 1.5, 0.3, three))
    report.put(Recovered(
        worker="a", failed_at=4, resumed_at=2, snapshot=False, checkpoint="ckpt/step-00000002",
        lost=("c",), left=(), generation=1, members=("a", "b"), layout=two, pause_s=0.4))
    got = _samples(metrics.registry)
    assert [s["step"] for s in report.steps] == [0, 1]  # 2 and 3 are trained again
    assert report.recoveries[-1]["replayed_steps"] == 2
    assert got[("tidal_agent_recoveries_total", *job)] == 1
    assert got[("tidal_agent_lost_workers_total", *job)] == 1
    assert got[("tidal_agent_replayed_steps_total", *job)] == 2
    assert (got[("tidal_agent_workers", *job)], got[("tidal_agent_pp", *job)]) == (2, 2)


def test_only_the_leader_exports_the_jobs_series_and_both_serve_them():
    leader = AgentMetrics(namespace="ns", job="j", pod="j-worker-0", leader=True)
    other = AgentMetrics(namespace="ns", job="j", pod="j-worker-1", leader=False)
    try:
        texts = {}
        for name, metrics in (("leader", leader), ("other", other)):
            port = metrics.serve(0, addr="127.0.0.1")
            texts[name] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                                 timeout=5).read().decode()
    finally:
        leader.close()
        other.close()
    names = {k: {f.name for f in text_string_to_metric_families(t)} for k, t in texts.items()}
    assert names["other"] == {"tidal_agent_up"}
    assert {"tidal_agent_up", "tidal_agent_step", "tidal_agent_reconfigurations"} <= names["leader"]
    assert 'tidal_agent_up{job="j",namespace="ns",pod="j-worker-1"} 1.0' in texts["other"]


def test_operator_counts_each_jobs_decisions_from_zero():
    metrics = Metrics()
    metrics.observe_job("ns", "j", workers=2, target_workers=3, generation=0)
    key = lambda kind: ("tidal_job_decisions_total", ("job", "j"), ("kind", kind),  # noqa: E731
                        ("namespace", "ns"))
    assert _samples(metrics.registry)[key("scale_up")] == 0
    metrics.decided("ns", "j", "scale_up")
    got = _samples(metrics.registry)
    assert got[key("scale_up")] == 1 and got[key("scale_down")] == got[key("restart")] == 0
    assert got[("tidal_decisions_total", ("kind", "scale_up"))] == 1
    metrics.forget_job("ns", "j")
    assert key("scale_up") not in _samples(metrics.registry)
    with pytest.raises(ValueError):  # the job's labels are namespace and job, nothing else
        metrics.job_decisions.labels("ns", "j")
