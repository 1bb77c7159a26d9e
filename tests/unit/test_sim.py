"""The trace-driven simulator: hand-made traces with known answers, and its invariants."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal_operator.policy import decide
from tidal_plan.keepers import keepers_stay
from tidal_sim import SimConfig, TraceJob, default_nodes, mark_elastic, simulate
from tidal_sim.compare import beaten_by, compare, tradeoff
from tidal_sim.config import QUEUES
from tidal_sim.engine import GPUS_PER_NODE, Simulation, job_table, load_tables


def job(i: int, submit: float, duration: float, gpus: int, size: str | None = None) -> TraceJob:
    return TraceJob(job_id=f"j{i:03d}", submit=submit, duration=duration, gpus=gpus, size=size)


def test_fifo_queue_waits_for_the_gpus():
    jobs = [job(0, 0, 100, 8), job(1, 10, 50, 8)]
    report = simulate(jobs, SimConfig(policy="static", nodes=1))
    assert report["queue_mean_s"] == 45.0  # j001 waits 90 s
    assert report["makespan_s"] == 150.0


def test_backfill_starts_a_small_job_past_a_blocked_head():
    jobs = [job(0, 0, 100, 4), job(1, 1, 10, 8), job(2, 2, 10, 4)]
    sim = Simulation(jobs, SimConfig(policy="static", nodes=1))
    sim.run()
    starts = {j.key: j.start - j.trace.submit for j in sim.jobs}
    assert starts == {"j000": 0.0, "j001": 99.0, "j002": 0.0}


def test_static_elastic_job_runs_its_duration_at_the_minimum():
    report = simulate([job(0, 0, 1000, 8, "small")], SimConfig(policy="static", nodes=4))
    assert report["elastic_jct_mean_s"] == 1000.0
    assert report["scale_ups"] == 0


def test_tidal_grows_into_idle_gpus_and_pays_the_hot_switch():
    report = simulate([job(0, 0, 10000, 32, "small")],
                      SimConfig(policy="tidal", nodes=8, jitter=0.0))
    assert report["scale_ups"] == 1
    assert report["switch_seconds"] == 2.0
    # the small PP table as it is: 4 -> 7 workers at once, 1.97x
    assert 2.0 + 10000 / 1.98 < report["elastic_jct_mean_s"] < 2.0 + 10000 / 1.96


def test_job_table_follows_the_scale_factor_conservatively():
    small = load_tables(SimConfig(policy="tidal", nodes=1))["small"]  # 4..7 workers: 1, 1.14,
    one = job_table(small, 1)  # 1.59, 1.97; a 1-worker job at 2 workers has factor 2 >= 7/4
    assert [(r.workers, r.speedup) for r in one.rows] == [(1, 1.0), (2, small.rows[-1].speedup)]
    eight = job_table(small, 8)  # factor 10/8 = 5/4 at 10 workers, 12/8 = 6/4 at 12, 14/8 at 14
    assert [(r.workers, r.speedup) for r in eight.rows] == [
        (8, 1.0), (10, small.rows[1].speedup), (12, small.rows[2].speedup),
        (14, small.rows[3].speedup)]
    assert eight.max_workers == 14


def test_a_job_may_start_below_its_request_and_grows_back():
    """Two of four nodes are busy when a 4-worker job arrives: under static it waits for them;
    with --start-below 0.5 it starts at once on the two free ones at half speed (linear below
    its request) and grows when the others free up."""
    jobs = [job(0, 0, 1000, 16), job(1, 10, 10000, 32, "small")]
    static = Simulation(jobs, SimConfig(policy="static", nodes=4))
    static.run()
    assert static.jobs[1].start == 1000.0  # queued behind the first job's nodes
    below = Simulation(jobs, SimConfig(policy="tidal", nodes=4, jitter=0.0, start_below=0.5))
    below.run()
    elastic = below.jobs[1]
    assert elastic.start == 10.0 and elastic.count == 2 and elastic.lowest == 2
    assert elastic.speed[2] == 0.5 and elastic.speed[4] == 1.0
    assert elastic.spec.min_workers == 2 and elastic.spec.cap == 7  # 4 x its request's table
    assert below.scale_ups >= 1 and elastic.end - 10.0 < static.jobs[1].end - 10.0
    with pytest.raises(ValueError, match="start_below"):
        SimConfig(policy="tidal", nodes=1, start_below=2.0)


def test_the_tradeoff_runs_tidal_at_each_threshold():
    """Arrivals every 10 minutes before and while an elastic job runs: at threshold 0 it
    grows into the idle node and the arrivals wait for its drains; near 1 it never grows."""
    jobs = [*(job(i, 600 * i, 100, 8) for i in range(1, 40)), job(0, 3000, 20000, 8, "small")]
    static = simulate(jobs, SimConfig(policy="static", nodes=2))
    curve = tradeoff(jobs, 2, [0.0, 0.999999], static)
    assert [p["threshold"] for p in curve] == [0.0, 0.999999]
    eager, cautious = curve
    assert eager["jct_speedup"] > cautious["jct_speedup"] == 1.0
    # static's queue is empty: the eager one's waits have no finite ratio to it
    assert static["queue_mean_s"] == 0 and eager["queue_ratio"] is None
    assert cautious["queue_ratio"] == 1.0


def test_arrival_makes_tidal_shrink_and_waits_for_the_drain():
    jobs = [job(0, 0, 100000, 8, "small"), job(1, 5000, 100, 8)]
    report = simulate(jobs, SimConfig(policy="tidal", nodes=2, jitter=0.0))
    assert report["scale_ups"] == 2 and report["scale_downs"] == 1  # grows back after
    # The released worker trains on to the job's next step boundary (at 2 workers, the small
    # table's 4x row), then hands its state over (2 s).
    small = load_tables(SimConfig(policy="tidal", nodes=1))["small"]
    step = small.rows[0].step_seconds / small.rows[-1].speedup
    assert report["released_at_once"] == 0
    assert 2.0 < report["queue_mean_s"] < 2.0 + step
    # With peer snapshots its keeper, the first worker, holds its state: it leaves at the
    # boundary.
    snap = simulate(jobs, SimConfig(policy="tidal", nodes=2, jitter=0.0, peer_snapshots=True))
    assert snap["released_at_once"] == 1
    assert snap["queue_mean_s"] == report["queue_mean_s"] - 2.0
    static = simulate(jobs, SimConfig(policy="static", nodes=2))
    assert static["queue_mean_s"] == 0.0
    assert report["elastic_jct_mean_s"] < static["elastic_jct_mean_s"]


def test_a_switch_starts_at_a_step_boundary():
    # The job starts at 0 and grows at once: tidal one step past its next boundary (the
    # joiners' world is built while a step trains), a restart at its next boundary.
    step = load_tables(SimConfig(policy="tidal", nodes=1))["small"].rows[0].step_seconds
    for policy, (low, high) in {"tidal": (step, 2 * step), "greedy": (0.0, step)}.items():
        sim = Simulation([job(0, 0, 100000, 8, "small")],
                         SimConfig(policy=policy, nodes=2, jitter=0.0))
        waits = []
        sim.checks.append(lambda s: waits.append(s.jobs[0].switch_at - s.now) if s.now == 0
                          else None)
        sim.run()
        assert sim.scale_ups >= 1 and low <= waits[0] < high, (policy, waits)
        # It trained at the minimum until then, paused, then ran at the 4x row's speed.
        speedup = load_tables(sim.config)["small"].rows[-1].speedup
        pause = sim.switch_seconds
        assert sim.jobs[0].end == pytest.approx(
            waits[0] + pause + (100000 - waits[0]) / speedup, rel=1e-12)


def test_leavers_go_at_once_only_where_their_keepers_stay():
    members = ("a", "b", "c", "d")  # each keeps the copy of the one before it in the ring
    assert keepers_stay(members, ("d",)) and keepers_stay(members, ("b", "d"))
    assert not keepers_stay(members, ("c", "d"))  # c's keeper d leaves too
    # A 32-GPU job grown to 7 of 8 nodes gives back 2 workers, next to each other in its
    # ring, for a 24-GPU job: they hand their state over first (2 s of drain after the boundary).
    jobs = [job(0, 0, 100000, 32, "small"), job(1, 5000, 100, 24)]
    sim = Simulation(jobs, SimConfig(policy="tidal", nodes=8, jitter=0.0, peer_snapshots=True))
    releases = []
    sim.checks.append(lambda s: releases.append(s.jobs[0].spec.releasing)
                      if s.jobs[0].spec is not None and s.jobs[0].spec.releasing else None)
    report = sim.run()
    assert report["scale_downs"] == 1 and report["released_at_once"] == 0
    assert len(releases[0]) == 2 and report["queue_mean_s"] > 2.0


def test_free_switches_pause_nothing_and_drain_at_once():
    jobs = [job(0, 0, 100000, 8, "small"), job(1, 5000, 100, 8)]
    report = simulate(jobs, SimConfig(policy="tidal", nodes=2, pause_scale=0.0))
    assert report["scale_downs"] == 1 and report["switch_seconds"] == 0.0
    assert report["queue_mean_s"] == 0.0  # 2.0 with the hot switch's drain (above)


def test_ceiling_runs_every_elastic_job_at_its_cap_after_static_queue():
    jobs = [job(0, 0, 1000, 8), job(1, 10, 1000, 8, "small")]  # j001 queues 990 s
    sim = Simulation(jobs, SimConfig(policy="static", nodes=1))
    sim.run()
    cap = load_tables(sim.config)["small"].rows[-1].speedup  # a 1-worker job at 2 workers
    assert sim.ceiling_speedup() == 1990 / (990 + 1000 / cap)


def test_flextrain_restarts_cost_more_than_hot_switches():
    jobs = [job(0, 0, 100000, 16, "small"), job(1, 5000, 100, 8), job(2, 20000, 100, 8)]
    runs = compare(jobs, nodes=4, policies=("flextrain", "tidal"))  # grows to all 4
    flextrain, tidal = runs["flextrain"].report, runs["tidal"].report
    assert flextrain["switch_seconds"] > tidal["switch_seconds"] > 0
    assert tidal["jct_speedup"] > flextrain["jct_speedup"] > 1.0
    assert tidal["queue_mean_s"] < flextrain["queue_mean_s"]  # a restart drains for longer


def test_same_seed_same_report_and_the_seed_spreads_the_pauses():
    jobs = [job(0, 0, 100000, 16, "small"), *(job(i, 3000 * i, 500, 8) for i in range(1, 12))]
    config = SimConfig(policy="tidal", nodes=4, seed=7)
    first = simulate(jobs, config)
    assert simulate(jobs, config) == first
    other = simulate(jobs, replace(config, seed=8))
    assert other["scale_ups"] == first["scale_ups"] > 1
    assert other["switch_seconds"] != first["switch_seconds"]


def test_elastic_rule_takes_the_largest_by_gpu_hours():
    jobs = [job(0, 0, 100, 64), job(1, 0, 1000, 8), job(2, 0, 10, 4), job(3, 0, 100, 16)]
    marked = {j.job_id: j.size for j in mark_elastic(jobs, share=0.5)}
    assert marked == {"j000": "medium", "j001": "small", "j002": None, "j003": None}
    assert default_nodes(jobs) == 32  # four times the 64-GPU job: its elastic range
    assert default_nodes(mark_elastic(jobs[1:], share=0.5)) == 4  # four times the elastic 8
    busy = [job(0, 0, 1000, 8), job(1, 0, 1000, 64)]  # 72 GPUs in use for the whole span
    assert default_nodes(busy, load=0.5, reach=1) == 18  # 144 GPUs


_traces = st.lists(
    st.tuples(st.integers(0, 5000), st.integers(1, 4000), st.sampled_from([1, 2, 4, 8, 16]),
              st.booleans()),
    min_size=1, max_size=12,
)


@settings(max_examples=120, deadline=None)
@given(_traces, st.sampled_from(["greedy", "flextrain", "tidal"]), st.integers(2, 5),
       st.sampled_from(["pp", "dp-pp"]), st.sampled_from([1.0, 0.0]), st.booleans(),
       st.sampled_from([0.0, 0.5]), st.sampled_from(QUEUES))
def test_gpus_conserved_jobs_within_bounds_and_all_finish(trace, policy, nodes, elastic, scale,
                                                          snapshots, below, queue):
    jobs = [job(i, s, d, g, "small" if e and g % GPUS_PER_NODE == 0 else None)
            for i, (s, d, g, e) in enumerate(trace)]
    jobs.sort(key=lambda j: (j.submit, j.job_id))
    config = SimConfig(policy=policy, nodes=nodes, elastic=elastic, tick_seconds=300,
                       pause_scale=scale,  # 0: free switches, drains at the same instant
                       peer_snapshots=snapshots, start_below=below, queue=queue)
    sim = Simulation(jobs, config)

    def check(s: Simulation) -> None:
        assert all(0 <= f <= GPUS_PER_NODE for f in s.free.values())
        frees = list(s.free.values())
        assert s.nodes_with == [frees.count(a) for a in range(GPUS_PER_NODE + 1)]
        if not s._may_decide():  # its proof, checked: decide would decide nothing
            assert decide(s._snapshot(), s.now) == ()
        held = sum(p.gpus for j in s.running.values() for p in j.pods)
        assert held == s.held and held + sum(s.free.values()) == GPUS_PER_NODE * nodes
        snapshot = s._snapshot()  # the load as the operator computes it, smoothed as it does
        assert s.owed == round(snapshot.owed_share() * GPUS_PER_NODE * nodes)
        assert snapshot.load == s.load.share and 0 <= s.load.share <= 1
        for j in s.running.values():
            if j.spec is not None:
                assert j.spec.min_workers <= j.spec.workers <= j.spec.cap
                assert len(j.spec.members) == j.spec.workers  # and pods draining, if any
                assert {p.key for p in j.pods} == {*j.spec.members, *j.spec.releasing}

    sim.checks.append(check)
    first = sim.run()
    assert all(j.end is not None and j.end >= j.trace.submit for j in sim.jobs)
    assert not sim.running and not sim.queue
    assert simulate(jobs, config) == first


@pytest.mark.parametrize(("policy", "queue"), [("greedy", "pods"), ("flextrain", "pods"),
                                               ("tidal", "pods"), ("tidal", "workloads"),
                                               ("tidal", "hidden")])
def test_decide_is_skipped_only_where_it_decides_nothing(policy, queue, monkeypatch):
    """A busy trace (queues, idle spells, scale-ups and downs): wherever the run skips
    ``decide``, ``decide`` on the same state returns no decision, and the runs still decide."""
    rng = random.Random(0)
    jobs = mark_elastic(sorted((job(i, rng.uniform(0, 100000), rng.uniform(100, 20000),
                                    rng.choice([1, 2, 4, 8, 8, 16]))
                                for i in range(200)), key=lambda j: (j.submit, j.job_id)),
                        share=0.4)
    may_decide, skipped = Simulation._may_decide, []

    def checked(sim: Simulation) -> bool:
        may = may_decide(sim)
        if not may:
            assert decide(sim._snapshot(), sim.now) == ()
            skipped.append(sim.now)
        return may

    monkeypatch.setattr(Simulation, "_may_decide", checked)
    report = simulate(jobs, SimConfig(policy=policy, nodes=10, tick_seconds=300, queue=queue))
    assert skipped and report["scale_ups"] > 1 and report["scale_downs"] > 1


def test_a_queue_of_workloads_decides_as_its_pods():
    """Queued jobs as Kueue Workloads' records (issue 39's contract: keyed by the Workload, no
    job label, an elastic job's minimum too) decide as their pending pods do: the simulator
    showed queued jobs' demand from their arrival already."""
    rng = random.Random(1)
    jobs = mark_elastic(sorted((job(i, rng.uniform(0, 50000), rng.uniform(100, 20000),
                                    rng.choice([1, 2, 4, 8, 8, 16]))
                                for i in range(120)), key=lambda j: (j.submit, j.job_id)),
                        share=0.4)
    seen = []
    sim = Simulation(jobs, SimConfig(policy="tidal", nodes=8, queue="workloads"))
    sim.checks.append(lambda s: seen.extend(p for j in s.queue for p in j.pending))
    workloads = sim.run()
    assert workloads == simulate(jobs, SimConfig(policy="tidal", nodes=8))
    assert workloads["scale_downs"] > 0 and seen
    assert all(p.key.startswith("kueue:sim/") and p.key.count("/") == 3 and p.job is None
               and p.node is None and p.phase == "Pending" for p in seen)


def test_a_hidden_queue_leaves_the_lent_gpus_lent():
    """A Kueue queue the operator cannot see (before issue 39): the non-elastic job that
    arrives while the elastic job has grown waits until the elastic job ends, where with
    its demand in sight it waits only for a drain."""
    jobs = [job(0, 0, 20000, 8, "small"), job(1, 5000, 100, 8)]
    seen = simulate(jobs, SimConfig(policy="tidal", nodes=2, jitter=0.0))
    hidden = Simulation(jobs, SimConfig(policy="tidal", nodes=2, jitter=0.0, queue="hidden"))
    report = hidden.run()
    assert seen["scale_downs"] == 1 and report["scale_downs"] == 0
    assert hidden.jobs[1].start == hidden.jobs[0].end > 5000 + seen["queue_mean_s"]
    assert list(hidden.arrivals.times) == [hidden.jobs[1].start]  # seen when its pods are
    with pytest.raises(ValueError, match="queue must be"):
        SimConfig(policy="tidal", nodes=1, queue="kueue")


def test_beaten_on_both_counts_means_as_good_on_both_and_better_on_one():
    tidal = {"jct_speedup": 2.0, "queue_ratio": 0.8}

    def beaten(jct: float, queue: float | None, mine: dict = tidal) -> bool:
        return beaten_by({"tidal": mine, "greedy": {"jct_speedup": jct,
                                                    "queue_ratio": queue}}) == ["greedy"]

    assert beaten(2.1, 0.8) and beaten(2.0, 0.79)  # faster, or kinder, beyond half a percent
    assert not beaten(2.009, 0.7965)  # within half a percent on both: a tie
    assert beaten(2.011, 0.803)  # faster beyond it, as kind within it
    assert not beaten(2.2, 0.81)  # faster, but less kind beyond half a percent
    assert not beaten(1.9, 0.5)  # kinder, but slower
    assert not beaten(3.0, None)  # no finite queue ratio: the least kind of all
    assert beaten(2.0, 0.8, {"jct_speedup": 1.9, "queue_ratio": None})
    assert beaten_by({"tidal": tidal}) == []  # no peer ran


def test_a_policy_that_never_lends_is_beaten_on_a_trace_with_room():
    """One elastic job of one node on four, and one-GPU jobs every 10 minutes that always
    find room: every policy that lends is faster and none queues anything. Tidal at its
    threshold lends too and beats the restarts; at 0.999999 it never lends, and is beaten."""
    jobs = [*(job(i, 600 * i, 100, 1) for i in range(1, 90)), job(0, 3000, 50000, 8, "small")]
    runs = compare(jobs, 4, elastic="pp", jitter=0.0)
    reports = {n: o.report for n, o in runs.items()}
    assert {r["queue_ratio"] for r in reports.values()} == {1.0}
    assert reports["tidal"]["jct_speedup"] > reports["greedy"]["jct_speedup"] > 1.0
    assert beaten_by(reports) == []
    never = tradeoff(jobs, 4, [0.999999], reports["static"], elastic="pp", jitter=0.0)[0]
    assert never["jct_speedup"] == 1.0
    assert beaten_by({**reports, "tidal": never}) == ["greedy", "flextrain"]


def test_sim_command_writes_the_report(tmp_path):
    import json

    from click.testing import CliRunner

    from tidal_sim.cli import sim

    trace = tmp_path / "trace.csv"
    trace.write_text("job_id,submission_time,duration,num_gpu\n"
                     "a,0,100000,8\nb,5000,100,8\nc,6000,50,1\n")
    out = tmp_path / "r.json"
    result = CliRunner().invoke(sim, ["--trace", str(trace), "--policy", "tidal", "--share",
                                      "0.5", "--nodes", "2", "--report", str(out),
                                      "--plots", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["nodes"] == 2 and set(report["policies"]) == {"static", "tidal"}
    assert 1.0 < report["policies"]["tidal"]["jct_speedup"] < report["ceiling_jct_speedup"]
    assert report["pause_scale"] == 1.0 and "ceiling" in result.output
    # b waits for a's drain (static: no wait), so there is no finite queue ratio
    assert report["policies"]["tidal"]["queue_mean_s"] > 0
    assert report["policies"]["tidal"]["queue_ratio"] is None
    assert "n/a" in result.output
    for name in ("normalised", "queue_cdf", "gpus"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert CliRunner().invoke(sim, ["--trace", str(trace), "--policy", "fast"]).exit_code == 2


def test_sim_command_refuses_bad_traces_in_one_line(tmp_path):
    from click.testing import CliRunner

    from tidal_sim.cli import sim

    cases = {
        "job_id,submission_time,num_gpu\na,0,8\n": "no column duration",
        "job_id,submission_time,duration,num_gpu\na,0,100,eight\n": "line 2: num_gpu must be",
        "job_id,submission_time,duration,num_gpu\n": "has no job with GPUs",
        "job_id,submission_time,duration,num_gpu\na,0,100,64\n": "larger than the cluster",
    }
    for i, (text, message) in enumerate(cases.items()):
        trace = tmp_path / f"t{i}.csv"
        trace.write_text(text)
        extra = ["--nodes", "2"] if "64" in text else []
        result = CliRunner().invoke(sim, ["--trace", str(trace), *extra])
        assert result.exit_code == 1, (text, result.output)
        assert message in result.output and "Traceback" not in result.output, result.output


def test_sim_command_warns_when_no_job_is_elastic(tmp_path):
    from click.testing import CliRunner

    from tidal_sim.cli import sim

    trace = tmp_path / "small.csv"
    trace.write_text("job_id,submission_time,duration,num_gpu\na,0,100,1\nb,10,100,2\n")
    result = CliRunner().invoke(sim, ["--trace", str(trace)])
    assert result.exit_code == 0, result.output
    assert "no job of small.csv is elastic" in " ".join(result.stderr.split())
