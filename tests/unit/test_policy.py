"""The scaling policy: named scenarios and their exact decisions; invariants on random clusters.

The property tests recompute the GPU accounting from the snapshot's pods without the policy's
helpers: which pods hold GPUs where, what a release frees, what a scale-up takes.
"""

import dataclasses
import importlib.util
import math
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal_operator.policy import (BELOW_MINIMUM, IDLE_GPUS, PENDING_GPU_PODS, STARTED, STRAGGLER,
                                   Decision, decide)
from tidal_operator.snapshot import (
    ANYWHERE, ElasticJob, Node, Placement, Pod, Snapshot, Taint, Toleration,
)

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_decide", ROOT / "bench" / "decide.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
scale_table = bench.scale_table

NOW = 100_000.0
HOUR = 3600.0


def job(key, *, on, min_workers=1, max_workers=8, factor=4, gpw=1, tps=None, **settings):
    """An elastic job whose members, in rank order, run on the nodes named by ``on``'s letters."""
    tps = tps or {w: 100.0 * w**0.9 for w in range(min_workers, max_workers + 1)}
    members = tuple(f"{key}-{rank}" for rank in range(len(on)))
    pods = tuple(Pod(m, gpw, node, "Running", key) for m, node in zip(members, on))
    elastic = ElasticJob(
        key=key, min_workers=min_workers, max_workers=max_workers, max_scale_factor=factor,
        gpus_per_worker=gpw, workers=len(on), members=members,
        scale_table=scale_table(key, tps, min_workers, max_workers, gpw), **settings,
    )
    return elastic, pods


def running(key, node, gpus):
    return Pod(key, gpus, node, "Running")


def waiting(key, gpus, created=0.0):
    return Pod(key, gpus, None, "Pending", unschedulable=True, created=created)


def cluster(nodes, *jobs, others=(), arrivals=(), window=8 * HOUR, arrival_gpus=()):
    return Snapshot(
        nodes=tuple(Node(name, gpus) for name, gpus in nodes.items()),
        pods=tuple(p for _, pods in jobs for p in pods) + tuple(others),
        jobs=tuple(j for j, _ in jobs),
        arrivals=tuple(arrivals),
        window_seconds=window,
        arrival_gpus=tuple(arrival_gpus),
    )


def busy_hour(gpus, count=30):
    """``count`` arrivals of ``gpus`` GPUs each over the last hour, for a job that counts an
    hour: the scale-up rule passes (its 2 x 1 s of switching over a gain of 2 or more), but an
    arrival within the release latency (the table's 82 s step at 1 worker, and 1 s) is likely:
    P(none) = exp(-30/h x 83 s) = 0.50 < 0.6."""
    return dict(arrivals=recent(count), arrival_gpus=[gpus] * count)


def lender(**settings):
    return job("j", on="a", max_workers=8, factor=8, switch_seconds=1,
               arrival_window_seconds=HOUR, **settings)


def recent(count, window=HOUR):
    """``count`` arrivals spread over the last ``window`` seconds."""
    return [NOW - window * (i + 0.5) / count for i in range(count)]


def below_min(key, *, on, min_workers, **settings):
    """A job that a fault left with the members ``on``, below its minimum."""
    return job(key, on=on, min_workers=min_workers, **settings)


def new_job(key, min_workers):
    """A job just created: no member yet, its first pods waiting for GPUs."""
    elastic, _ = job(key, on="", min_workers=min_workers, busy=True)
    return elastic, tuple(Pod(f"{key}-{i}", 1, None, "Pending", key) for i in range(min_workers))


def raised_min(entry, min_workers):
    """The spec's minimum raised after the agent built its table (which starts lower)."""
    elastic, pods = entry
    return dataclasses.replace(elastic, min_workers=min_workers), pods


def without_table(entry):
    elastic, pods = entry
    return dataclasses.replace(elastic, scale_table=None), pods


SCALE_UP = [
    pytest.param(cluster({"a": 8}, job("j", on="aa")),
                 [dict(job="j", kind="scale_up", from_workers=2, to_workers=4, nodes=("a", "a"),
                       reason=IDLE_GPUS, probability=1.0, gain=pytest.approx(2**0.9 - 1))],
                 id="idle-gpus-and-a-good-table"),
    pytest.param(cluster({"a": 8}, job("j", on="aa"), others=[waiting("p", 1)]), [],
                 id="a-pending-pod-blocks-scale-up"),
    pytest.param(cluster({"a": 8}, job("j", on="aa"), others=[waiting("p", 16)]), [],
                 id="a-pending-pod-too-big-for-any-node-still-blocks"),
    pytest.param(cluster({"a": 8}, job("j", on="aa"),
                         others=[Pod("k-1", 1, None, "Pending", "k")]), [],
                 id="an-unbound-joiner-holds-its-gpus"),
    pytest.param(cluster({"a": 8}, job("j", on="aaaa")), [], id="cap-reached"),
    pytest.param(cluster({"a": 16}, job("j", on="aa", min_workers=2, max_workers=16, factor=2)),
                 [dict(to_workers=4)], id="cap-max-scale-factor-times-min"),
    pytest.param(cluster({"a": 8}, job("j", on="aa", max_workers=3)), [dict(to_workers=3)],
                 id="cap-max-workers"),
    pytest.param(cluster({"a": 8}, job("j", on="aa", tps={1: 100, 2: 200, 3: 205, 4: 208})), [],
                 id="gain-below-min-gain"),
    pytest.param(cluster({"a": 8}, job("j", on="aa", tps={1: 100, 2: 200, 3: 250, 4: 210})),
                 [dict(to_workers=3)], id="the-row-with-most-tokens-per-second"),
    pytest.param(cluster({"a": 8}, job("j", on="aa", tps={1: 100, 2: 200, 4: 300}),
                         others=[running("x", "a", 5)]), [],
                 id="no-kept-row-fits"),
    pytest.param(cluster({"a": 8, "b": 8}, job("j", on="ab", gpw=2),
                         others=[running("x", "a", 5), running("y", "b", 5)]), [],
                 id="a-worker-needs-its-gpus-on-one-node"),
    pytest.param(cluster({"a": 8, "b": 8}, job("j", on="aaaaaa", max_workers=12, factor=12),
                         others=[running("x", "a", 1), running("y", "b", 4)]),
                 [dict(to_workers=11, nodes=("a", "b", "b", "b", "b"))],
                 id="best-fit-placement"),
    pytest.param(cluster({"a": 8}, job("j", on="aa", arrival_window_seconds=HOUR),
                         arrivals=recent(100)), [],
                 id="poisson-below-threshold-at-a-high-arrival-rate"),
    pytest.param(cluster({"a": 8}, job("j", on="aa"), arrivals=recent(100), window=HOUR), [],
                 id="poisson-over-the-snapshot-window-by-default"),
    pytest.param(cluster({"a": 8}, job("j", on="a", max_workers=2, tps={1: 100, 2: 200},
                                       arrival_window_seconds=HOUR, switch_seconds=30),
                         arrivals=recent(48)), [],
                 id="poisson-counts-the-switch-back-down"),  # one switch: P = 0.67 > 0.6
    pytest.param(cluster({"a": 8}, job("j", on="a", max_workers=2, tps={1: 100, 2: 200},
                                       arrival_window_seconds=HOUR, switch_seconds=30),
                         arrivals=recent(10)),
                 [dict(to_workers=2, probability=pytest.approx(math.exp(-10 / HOUR * 60)))],
                 id="poisson-passes-at-a-low-arrival-rate"),
    pytest.param(cluster({"a": 8}, job("j", on="aa", arrival_window_seconds=HOUR),
                         arrivals=[NOW - 2 * HOUR] * 1000), [dict(to_workers=4)],
                 id="arrivals-before-the-window-do-not-count"),
    pytest.param(cluster({"a": 8}, job("j", on="aa", last_scale_time=NOW - 10)), [],
                 id="cooldown"),
    pytest.param(cluster({"a": 8}, job("j", on="aa", last_scale_time=NOW - 60)),
                 [dict(to_workers=4)], id="cooldown-over"),
    pytest.param(cluster({"a": 8}, job("j", on="aa", busy=True)), [], id="busy-job"),
    pytest.param(cluster({"a": 8}, job("j", on="aa", enabled=False)), [], id="disabled-job"),
    pytest.param(cluster({"a": 8}, without_table(job("j", on="aa"))), [], id="no-scale-table"),
    # Idle GPUs go first to the most tokens/s gained per GPU added: the completion time saved
    # per GPU-second held (issue 27).
    pytest.param(cluster({"a": 6}, job("flat", on="aa", tps={1: 100, 2: 190, 3: 200, 4: 210}),
                         job("steep", on="aa")),
                 [dict(job="steep", from_workers=2, to_workers=4)],
                 id="the-most-gain-per-gpu-first"),
    pytest.param(cluster({"a": 8}, job("a-few", on="a", factor=8,
                                       tps={1: 100, 2: 120, 3: 140, 4: 150, 5: 160}),
                         job("b-many", on="aaa")),
                 [dict(job="b-many", from_workers=3, to_workers=4),
                  dict(job="a-few", from_workers=1, to_workers=4)],
                 id="not-the-fewest-workers-first-where-another-gains-more"),
    pytest.param(cluster({"a": 7}, job("a", on="a", factor=8, tps={1: 100, 5: 900}),
                         job("b", on="aa")),
                 [dict(job="a", from_workers=1, to_workers=5)],
                 id="a-large-step-first-where-it-gains-most-per-gpu"),
    pytest.param(cluster({"a": 8}, job("a-many", on="aaa"), job("b-few", on="a", factor=8)),
                 [dict(job="b-few", from_workers=1, to_workers=5)],
                 id="a-concave-table-gains-most-where-a-job-has-fewest-workers"),
    # Headroom: the last free GPUs stay free where an arrival needing them is likely within
    # the release latency (issue 27).
    pytest.param(cluster({"a": 8}, lender(), **busy_hour(2)),
                 [dict(to_workers=6, nodes=("a",) * 5)], id="headroom-for-the-arrivals-size"),
    pytest.param(cluster({"a": 8}, lender(), **busy_hour(1)), [dict(to_workers=7)],
                 id="headroom-of-one-gpu-for-one-gpu-arrivals"),
    pytest.param(cluster({"a": 8}, lender(), **busy_hour(9)), [dict(to_workers=8)],
                 id="no-headroom-for-arrivals-too-big-to-fit-anyway"),
    pytest.param(cluster({"a": 8}, lender(), **busy_hour(2, count=10)), [dict(to_workers=8)],
                 id="no-headroom-where-an-arrival-within-the-latency-is-unlikely"),
    pytest.param(cluster({"a": 8}, lender(probability_threshold=0.4), **busy_hour(2)),
                 [dict(to_workers=8)], id="headroom-priced-at-the-jobs-threshold"),
    pytest.param(cluster({"a": 8}, job("few", on="a", gpw=4), job("many", on="aaa")),
                 [dict(job="many", from_workers=3, to_workers=4)],
                 id="the-next-job-takes-what-the-first-cannot-use"),
    pytest.param(cluster({"a": 6}, job("b", on="aa"), job("a", on="aa")),
                 [dict(job="a", to_workers=4)], id="ties-by-job-key"),
]


@pytest.mark.parametrize(("snapshot", "expected"), SCALE_UP)
def test_scale_up(snapshot, expected):
    check(decide(snapshot, NOW), expected)


LEAN = {1: 100, 2: 190, 3: 270, 4: 340}  # loses 21% from 4 to 3 workers
WIDE = {1: 100, 2: 150, 3: 180, 4: 190}  # loses 5%

SCALE_DOWN = [
    pytest.param(cluster({"a": 8, "b": 8}, job("lean", on="baaa", max_workers=4, tps=LEAN),
                         job("wide", on="baaa", max_workers=4, tps=WIDE),
                         others=[running("x", "a", 2), running("y", "b", 6), waiting("p", 1)]),
                 [dict(job="wide", kind="scale_down", from_workers=4, to_workers=3,
                       release=("wide-3",), room_for=(("p", "a"),), reason=PENDING_GPU_PODS,
                       gain=pytest.approx(180 / 190 - 1))],
                 id="from-the-job-that-loses-least-per-gpu"),
    pytest.param(cluster({"a": 8, "b": 8, "c": 8}, job("j", on="cabab"),
                         others=[running("x", "a", 6), running("y", "b", 6),
                                 running("z", "c", 7), waiting("p", 2)]),
                 [dict(to_workers=3, release=("j-3", "j-1"), room_for=(("p", "a"),))],
                 id="frees-gpus-on-the-node-where-the-pod-fits"),
    pytest.param(cluster({"a": 8, "b": 8}, job("j", on="baaaaa"),
                         others=[running("x", "a", 3), running("y", "b", 7), waiting("p", 2)]),
                 [dict(from_workers=6, to_workers=4, release=("j-5", "j-4"))],
                 id="partial-scale-down"),
    pytest.param(cluster({"a": 8, "b": 8},
                         job("j", on="baaaab", max_workers=6, tps={1: 100, 2: 190, 4: 340, 6: 450}),
                         others=[running("x", "a", 4), running("y", "b", 6), waiting("p", 1)]),
                 [dict(to_workers=4, release=("j-4", "j-3"))],
                 id="to-a-kept-row"),
    pytest.param(cluster({"a": 8}, job("j", on="aa", min_workers=2),
                         others=[running("x", "a", 6), waiting("p", 1)]), [],
                 id="never-below-min"),
    pytest.param(cluster({"a": 8}, raised_min(job("j", on="aaa"), 2),
                         others=[running("x", "a", 5), waiting("p", 2)]), [],
                 id="never-below-min-where-the-table-goes-lower"),
    pytest.param(cluster({"a": 8}, job("j", on="aa"),
                         others=[running("x", "a", 6), waiting("p", 2)]), [],
                 id="leader-never-released"),
    pytest.param(cluster({"a": 8}, job("j", on="aa"),
                         others=[running("x", "a", 6), waiting("p", 1)]),
                 [dict(to_workers=1, release=("j-1",))], id="the-leader-stays"),
    pytest.param(cluster({"a": 8}, job("j", on="aaa", busy=True),
                         others=[running("x", "a", 5), waiting("p", 1)]), [],
                 id="busy-job-not-touched"),
    pytest.param(cluster({"a": 8}, job("j", on="aaa", enabled=False),
                         others=[running("x", "a", 5), waiting("p", 1)]), [],
                 id="disabled-job-not-touched"),
    pytest.param(cluster({"a": 8}, job("j", on="aaa", last_scale_time=NOW - 1),
                         others=[running("x", "a", 5), waiting("p", 1)]),
                 [dict(to_workers=2)], id="cooldown-does-not-block-scale-down"),
    pytest.param(cluster({"a": 8}, job("x", on="aa", busy=True, releasing=("x-1",)),
                         job("y", on="aaa"), others=[running("z", "a", 3), waiting("p", 1)]), [],
                 id="gpus-being-drained-count-as-free"),
    pytest.param(cluster({"a": 8}, job("j", on="aaa"),
                         others=[running("x", "a", 4), waiting("p", 1)]), [],
                 id="a-pod-that-fits-needs-nothing"),
    pytest.param(cluster({"a": 8}, job("j", on="aaa"),
                         others=[running("x", "a", 4), waiting("p", 1), waiting("q", 1, 1.0)]),
                 [dict(to_workers=2, release=("j-2",), room_for=(("q", "a"),))],
                 id="a-pod-that-fits-keeps-its-gpus"),
    pytest.param(cluster({"a": 8, "b": 8}, job("j", on="ba"),
                         others=[running("x", "a", 7), running("y", "b", 7),
                                 waiting("new", 1, 5.0), waiting("old", 1, 1.0)]),
                 [dict(release=("j-1",), room_for=(("old", "a"),))], id="oldest-pod-first"),
    pytest.param(cluster({"a": 8, "b": 8}, job("j", on="baaa", max_workers=4, tps=LEAN),
                         job("k", on="baaa", max_workers=4, tps=WIDE),
                         others=[running("x", "a", 2), running("y", "b", 6), waiting("p", 4)]),
                 [dict(job="j", to_workers=2, release=("j-3", "j-2"), room_for=(("p", "a"),)),
                  dict(job="k", to_workers=2, release=("k-3", "k-2"), room_for=(("p", "a"),))],
                 id="two-jobs-make-room-for-one-pod"),
    pytest.param(cluster({"a": 8}, job("j", on="aaaa"),
                         others=[running("x", "a", 3), waiting("p", 1), waiting("q", 1, 1.0),
                                 waiting("r", 1, 2.0)]),
                 [dict(from_workers=4, to_workers=2, release=("j-3", "j-2"),
                       room_for=(("q", "a"), ("r", "a")))],
                 id="one-decision-per-job"),
    # An elastic job's minimum is owed like a non-elastic pod's GPUs; above it, GPUs are lent.
    pytest.param(cluster({"a": 8}, job("j", on="aaaaaa", max_workers=6, factor=6),
                         new_job("k", 2), others=[running("x", "a", 2)]),
                 [dict(job="j", to_workers=4, release=("j-5", "j-4"),
                       room_for=(("k-0", "a"), ("k-1", "a")))],
                 id="a-new-elastic-jobs-first-pods-get-room"),
    pytest.param(cluster({"a": 8}, job("j", on="aaaaaa", max_workers=6, factor=6),
                         below_min("k", on="aa", min_workers=3, busy=True),  # (restoring)
                         others=[Pod("k-2", 1, None, "Pending", "k")]),
                 [dict(job="j", to_workers=5, release=("j-5",), room_for=(("k-2", "a"),))],
                 id="a-replacement-below-the-minimum-gets-room"),
    pytest.param(cluster({"a": 8}, job("j", on="aaaaaa", max_workers=6, factor=6),
                         job("k", on="aa", busy=True),
                         others=[Pod("k-2", 1, None, "Pending", "k")]), [],
                 id="a-scale-ups-joiner-gets-none"),
]


@pytest.mark.parametrize(("snapshot", "expected"), SCALE_DOWN)
def test_scale_down(snapshot, expected):
    check(decide(snapshot, NOW), expected)


RESTORE = [
    pytest.param(cluster({"a": 8}, below_min("j", on="a", min_workers=3, enabled=False,
                                             last_scale_time=NOW - 1),
                         others=[waiting("p", 1)], arrivals=recent(100)),
                 [dict(job="j", kind="scale_up", from_workers=1, to_workers=3, nodes=("a", "a"),
                       reason=BELOW_MINIMUM, gain=None, probability=None)],
                 id="back-to-min-whatever-the-rules-and-before-a-pending-pod"),
    pytest.param(cluster({"a": 2}, below_min("j", on="a", min_workers=2),
                         others=[running("x", "a", 1)]),
                 [dict(to_workers=2, nodes=())], id="created-even-where-no-gpu-is-free"),
    pytest.param(cluster({"a": 8}, below_min("j", on="a", min_workers=2, busy=True)), [],
                 id="a-busy-job-applies-its-target-first"),
    pytest.param(cluster({"a": 8}, below_min("j", on="a", min_workers=2), job("k", on="aaaa"),
                         others=[running("x", "a", 2), waiting("p", 2)]),
                 [dict(job="j", reason=BELOW_MINIMUM, nodes=("a",)),
                  dict(job="k", kind="scale_down", to_workers=2, release=("k-3", "k-2"))],
                 id="the-pending-pod-gets-room-from-others-after"),
    pytest.param(cluster({"a": 8}, below_min("j", on="a", min_workers=2), job("k", on="aa")),
                 [dict(job="j", to_workers=2)], id="no-scale-up-until-the-new-workers-are-bound"),
    pytest.param(cluster({"a": 8}, raised_min(job("j", on="aa"), 3)), [dict(to_workers=3)],
                 id="a-raised-minimum-too"),
]


@pytest.mark.parametrize(("snapshot", "expected"), RESTORE)
def test_restore(snapshot, expected):
    check(decide(snapshot, NOW), expected)


def unstarted(key, *, min_workers, preferred=None, gpw=1):
    """A job the operator has not started yet: no target, no pod."""
    elastic, _ = job(key, on="", min_workers=min_workers, gpw=gpw, busy=True, unstarted=True,
                     preferred_workers=preferred)
    return elastic, ()


START = [
    pytest.param(cluster({"a": 8}, unstarted("j", min_workers=2, preferred=4)),
                 [dict(job="j", kind="start", from_workers=0, to_workers=4,
                       nodes=("a",) * 4, reason=STARTED)],
                 id="the-preferred-count-where-it-is-free"),
    pytest.param(cluster({"a": 8}, unstarted("j", min_workers=2, preferred=4),
                         others=[running("x", "a", 5)]),
                 [dict(to_workers=3, nodes=("a",) * 3)], id="below-preferred-what-is-free"),
    pytest.param(cluster({"a": 8}, unstarted("j", min_workers=2, preferred=4),
                         others=[running("x", "a", 7)]),
                 [dict(to_workers=2, nodes=("a",))], id="never-below-its-minimum"),
    pytest.param(cluster({"a": 8}, unstarted("j", min_workers=2)),
                 [dict(to_workers=2)], id="without-a-preferred-count-its-minimum"),
    pytest.param(cluster({"a": 8, "b": 4}, unstarted("j", min_workers=1, preferred=3, gpw=4)),
                 [dict(to_workers=3, nodes=("b", "a", "a"))], id="a-worker-on-one-node"),
    pytest.param(cluster({"a": 6}, unstarted("j", min_workers=1, preferred=4),
                         unstarted("k", min_workers=1, preferred=4)),
                 [dict(job="j", to_workers=4), dict(job="k", to_workers=2)],
                 id="by-key-each-from-what-the-others-left"),
    pytest.param(cluster({"a": 8}, unstarted("j", min_workers=1, preferred=2), job("k", on="aa")),
                 [dict(job="j", to_workers=2)], id="no-scale-up-in-the-round-of-a-start"),
]


@pytest.mark.parametrize(("snapshot", "expected"), START)
def test_start(snapshot, expected):
    check(decide(snapshot, NOW), expected)


STRAGGLERS = [
    pytest.param(cluster({"a": 4}, job("j", on="aaa", slow=("j-1",))),
                 [dict(job="j", kind="scale_down", from_workers=3, to_workers=2,
                       release=("j-1",), reason=STRAGGLER)],
                 id="released-on-the-agents-request-before-any-scale-up"),
    pytest.param(cluster({"a": 8}, job("j", on="aaa", slow=("j-2",)), job("k", on="a")),
                 [dict(job="j", release=("j-2",)), dict(job="k", kind="scale_up")],
                 id="other-jobs-still-grow"),
    pytest.param(cluster({"a": 3}, job("j", on="aaa", slow=("j-0",))), [],
                 id="never-the-leader"),
    pytest.param(cluster({"a": 2}, job("j", on="aa", min_workers=2, slow=("j-1",))), [],
                 id="never-below-the-minimum"),
    pytest.param(cluster({"a": 3}, job("j", on="aaa", slow=("j-1",), busy=True)), [],
                 id="a-busy-job-applies-its-target-first"),
    pytest.param(cluster({"a": 4}, job("j", on="aaa", slow=("j-1",)),
                         others=[waiting("p", 2)]),
                 [dict(job="j", reason=PENDING_GPU_PODS, release=("j-2",))],
                 id="a-pending-pod-comes-first"),
]


@pytest.mark.parametrize(("snapshot", "expected"), STRAGGLERS)
def test_drop_stragglers(snapshot, expected):
    check(decide(snapshot, NOW), expected)


def check(decisions: tuple[Decision, ...], expected: list[dict]) -> None:
    assert len(decisions) == len(expected), decisions
    for decision, fields in zip(decisions, expected):
        for name, value in fields.items():
            assert getattr(decision, name) == value, (name, decision)
        assert "\n" not in decision.message
        words = {BELOW_MINIMUM: "below its minimum", STARTED: "fit on free GPUs"}
        assert words.get(decision.reason, "tokens/s") in decision.message


def test_messages_give_the_numbers():
    (up,) = decide(cluster({"a": 8}, job("j", on="aa", switch_seconds=12),
                           arrivals=recent(2, window=28800)), NOW)
    assert up.message == ("6 GPUs idle and no GPU pod pending: 2 new workers on a x2, +86.6% "
                          "tokens/s; P(idle window outlasts 24 s of switching) = 1.00 > 0.60 "
                          "at 0.25 arrivals/h")
    (down,) = decide(cluster({"a": 8}, job("j", on="aaaaaa"),
                             others=[running("x", "a", 2), waiting("p", 2)]), NOW)
    assert down.message == ("pending GPU pods: releasing j-5, j-4 to make room for p (2 GPUs) "
                            "on a, -30.6% tokens/s")
    (back,) = decide(cluster({"a": 3}, below_min("j", on="a", min_workers=4)), NOW)
    assert back.message == ("below its minimum (1 of 4 workers): 3 new workers on a x2, 1 "
                            "waiting for GPUs")
    (start,) = decide(cluster({"a": 3}, unstarted("j", min_workers=1, preferred=4)), NOW)
    assert start.message == "3 workers, 1 below its preferred 4: 3 fit on free GPUs (a x3)"


# Random clusters: a few nodes, jobs and pods, so that contention is common.

TAINTS = (Taint("dedicated", "train", "NoSchedule"), Taint("dedicated", "infer", "NoExecute"),
          Taint("flaky", "", "PreferNoSchedule"))
PLACEMENTS = (
    ANYWHERE,
    Placement(frozenset({("gpu", "a100")})),
    Placement(tolerations=(Toleration("dedicated", "Equal", "train", "NoSchedule"),)),
    Placement(frozenset({("gpu", "h100")}), (Toleration(operator="Exists"),)),
)


@st.composite
def clusters(draw):
    names = [f"n{i}" for i in range(draw(st.integers(1, 4)))]
    capacity = {name: draw(st.sampled_from([1, 2, 4, 4, 8, 8])) for name in names}
    placed = draw(st.booleans())  # node labels and taints, pods' selectors and tolerations
    nodes = tuple(Node(n, capacity[n]) if not placed else Node(
        n, capacity[n], frozenset({("gpu", draw(st.sampled_from(["a100", "h100"])))}),
        tuple(draw(st.lists(st.sampled_from(TAINTS), max_size=1, unique=True))))
        for n in names)
    placement = st.sampled_from(PLACEMENTS if placed else (ANYWHERE,))
    free = dict(capacity)
    pods, jobs = [], []
    for j in range(draw(st.integers(1, 3))):
        key = f"ns/job-{j}"
        lo = draw(st.integers(1, 3))
        hi = draw(st.integers(lo, lo + 5))
        gpw = draw(st.sampled_from([1, 1, 2]))
        members = []
        for rank in range(draw(st.integers(lo, hi))):
            node = draw(st.sampled_from(names))
            if free[node] >= gpw:
                free[node] -= gpw
                members.append(f"{key}-{rank}")
                pods.append(Pod(members[-1], gpw, node, "Running", key))
        low = max(1, lo - draw(st.integers(0, 1)))  # a table from before min was raised
        kept = sorted({low} | draw(st.sets(st.integers(low, hi))))
        steps = draw(st.lists(st.floats(0.0, 1.0), min_size=len(kept), max_size=len(kept)))
        busy = draw(st.booleans()) and draw(st.booleans())
        jobs.append(ElasticJob(
            key=key, min_workers=lo, max_workers=hi, workers=len(members), gpus_per_worker=gpw,
            max_scale_factor=draw(st.sampled_from([4, 2, 1])), members=tuple(members), busy=busy,
            releasing=tuple(m for m in members[1:] if busy and draw(st.booleans())),
            scale_table=scale_table(key, {w: 100 + 100 * sum(steps[: i + 1])
                                          for i, w in enumerate(kept)}, low, hi, gpw),
            enabled=draw(st.sampled_from([True] * 9 + [False])),
            min_gain=draw(st.sampled_from([0.0, 0.05, 0.3])),
            probability_threshold=draw(st.sampled_from([0.0, 0.6, 0.95])),
            last_scale_time=draw(st.sampled_from([None, NOW - 3600, NOW - 10])),
            switch_seconds=draw(st.sampled_from([0.0, 30.0, 600.0])),
            placement=draw(placement),
        ))
    if draw(st.booleans()) and draw(st.booleans()):  # a job just created: its pods wait
        key, lo, where = "ns/job-new", draw(st.integers(1, 3)), draw(placement)
        gpw = draw(st.sampled_from([1, 2]))
        jobs.append(ElasticJob(key=key, min_workers=lo, max_workers=lo + 2, workers=0,
                               gpus_per_worker=gpw, busy=True, placement=where))
        pods += [Pod(f"{key}-{r}", gpw, None, "Pending", key, created=NOW - 20, placement=where)
                 for r in range(lo)]
    tight = draw(st.booleans())  # other work fills what the jobs left, and pods wait
    for i, node in enumerate(names):
        gpus = draw(st.integers(0, free[node]))
        gpus = free[node] - gpus if tight else gpus
        if gpus:
            phase = draw(st.sampled_from(["Running", "Running", "Pending", "Succeeded"]))
            pods.append(Pod(f"other/run-{i}", gpus, node, phase, created=NOW - 100))
    for i in range(draw(st.integers(1, 3) if tight else st.sampled_from([0, 0, 0, 1]))):
        pods.append(dataclasses.replace(
            waiting(f"other/wait-{i}", draw(st.integers(1, 4)),
                    draw(st.sampled_from([NOW - 50.0, NOW - 5.0]))), placement=draw(placement)))
    arrivals = draw(st.lists(st.floats(NOW - 10 * HOUR, NOW), max_size=20))
    return Snapshot(nodes, tuple(pods), tuple(jobs), tuple(arrivals))


def pending_pods(snapshot) -> list[Pod]:
    """Pods waiting for GPUs: non-elastic ones, and those of a job below its minimum."""
    below = {j.key for j in snapshot.jobs if j.workers < j.min_workers}
    return [p for p in snapshot.pods if p.node is None and p.phase not in ("Succeeded", "Failed")
            and (p.job is None or p.job in below)]


def holding(snapshot) -> dict[str, int]:
    """GPUs each node's unfinished bound pods hold, counted from scratch."""
    held = Counter()
    for pod in snapshot.pods:
        if pod.node is not None and pod.phase not in ("Succeeded", "Failed"):
            held[pod.node] += pod.gpus
    return held


@settings(max_examples=200, deadline=None)
@given(clusters(), st.randoms(use_true_random=False))
def test_invariants_on_random_clusters(snapshot, shuffler):
    decisions = decide(snapshot, NOW)
    jobs = {j.key: j for j in snapshot.jobs}
    pods = {p.key: p for p in snapshot.pods}
    nodes = {n.name: n for n in snapshot.nodes}
    capacity = {n.name: n.gpus for n in snapshot.nodes}
    pending = pending_pods(snapshot)
    assert len({d.job for d in decisions}) == len(decisions), "one decision per job"
    assert {d.job for d in decisions if d.reason == BELOW_MINIMUM} == {
        j.key for j in snapshot.jobs if not j.busy and 0 < j.workers < j.min_workers}
    # New workers go where the job's pods may run; room is made where the pending pod may.
    assert all(jobs[d.job].placement.allows(nodes[n]) for d in decisions for n in d.nodes)
    assert all(pods[key].placement.allows(nodes[n]) for d in decisions for key, n in d.room_for)
    for d in decisions:
        job = jobs[d.job]
        assert not job.busy
        if d.reason == BELOW_MINIMUM:  # a lost worker's replacement: no rule but the minimum
            assert d.kind == "scale_up" and 0 < d.from_workers < d.to_workers == job.min_workers
            assert len(d.nodes) <= d.to_workers - d.from_workers and not d.release
            continue
        assert job.enabled and job.workers >= job.min_workers
        assert job.scale_table.row(d.to_workers) is not None, "a kept row"
        if d.kind == "scale_up":
            assert not pending, "never scale up while a GPU pod is pending"
            assert d.from_workers < d.to_workers <= job.cap
            assert len(d.nodes) == d.to_workers - d.from_workers and not d.release
            assert d.gain >= job.min_gain and d.probability > job.probability_threshold
        else:
            assert job.min_workers <= d.to_workers < d.from_workers
            assert len(set(d.release)) == len(d.release) == d.from_workers - d.to_workers
            assert set(d.release) <= set(job.members[1:]), "the job's pods, never its leader"
            assert d.room_for and not d.nodes
    # Scale-ups fit the idle GPUs.
    held = holding(snapshot)
    for d in decisions:
        for node in d.nodes:
            held[node] += jobs[d.job].gpus_per_worker
    assert all(held[node] <= capacity[node] for d in decisions for node in d.nodes)
    # Each pod given room fits, on its node, once the releases (decided and draining) are done
    # and the replacements of lost workers placed.
    held = holding(snapshot)
    for d in decisions:
        for node in d.nodes if d.reason == BELOW_MINIMUM else ():
            held[node] += jobs[d.job].gpus_per_worker
    for key in [k for j in snapshot.jobs for k in j.releasing] + [
            k for d in decisions for k in d.release]:
        held[pods[key].node] -= pods[key].gpus
    placed = {}
    for d in decisions:
        for key, node in d.room_for:
            assert placed.setdefault(key, node) == node, "one node per pending pod"
    for key, node in placed.items():
        held[node] += pods[key].gpus
    assert all(held[node] <= capacity[node] for node in set(placed.values()))
    # The order of the records does not matter.
    shuffled = Snapshot(*(tuple(shuffler.sample(list(xs), len(xs))) for xs in (
        snapshot.nodes, snapshot.pods, snapshot.jobs, snapshot.arrivals)), snapshot.window_seconds)
    assert decide(shuffled, NOW) == decisions


@settings(max_examples=200, deadline=None)
@given(clusters())
def test_a_lone_pending_pod_gets_room_where_it_can(snapshot):
    """One pending pod that does not fit: if one job alone can free enough GPUs on one node
    (down to its smallest kept row at or above its minimum, keeping its leader), the policy
    makes room; if all the jobs on every node together cannot, it makes none."""
    pending = pending_pods(snapshot)
    if len(pending) != 1 or any(0 < j.workers < j.min_workers for j in snapshot.jobs):
        return  # (replacing lost workers comes first: test_invariants_on_random_clusters)
    (pod,) = pending
    capacity = {n.name: n.gpus for n in snapshot.nodes if pod.placement.allows(n)}
    held = holding(snapshot)
    bound = {p.key: p for p in snapshot.pods if p.node and p.phase not in ("Succeeded", "Failed")}
    for key in (k for j in snapshot.jobs for k in j.releasing):
        held[bound[key].node] -= bound[key].gpus
    decisions = decide(snapshot, NOW)
    if any(capacity[n] - held[n] >= pod.gpus for n in capacity):
        assert decisions == ()
        return
    alone, together = set(), Counter()  # nodes one job can clear; GPUs all jobs can free
    for job in snapshot.jobs:
        if not job.enabled or job.busy or job.scale_table is None:
            continue  # (a new job: busy, no table yet)
        rows = [r.workers for r in job.scale_table.rows
                if job.min_workers <= r.workers < job.workers]
        if not rows or any(m not in bound for m in job.members):
            continue
        for node, count in Counter(bound[m].node for m in job.members[1:]).items():
            if node not in capacity:
                continue
            freeable = min(count, job.workers - rows[0]) * job.gpus_per_worker
            together[node] += freeable
            if capacity[node] - held[node] + freeable >= pod.gpus:
                alone.add(node)
    possible = any(capacity[n] - held[n] + together[n] >= pod.gpus for n in capacity)
    if alone:
        assert decisions and all(d.room_for == ((pod.key, d.room_for[0][1]),) for d in decisions)
    if not possible:
        assert decisions == ()


def test_bench_snapshot_decides():
    for scenario in ("scale_up", "scale_down"):
        snapshot = bench.build_snapshot(scenario, seed=3, **bench.TINY)
        assert len(snapshot.nodes) == bench.TINY["nodes"]
        assert len(snapshot.pods) == bench.TINY["pods"]
        decisions = decide(snapshot, bench.NOW)
        kinds = {d.kind for d in decisions}
        assert kinds <= {scenario}
        assert decisions == decide(bench.build_snapshot(scenario, seed=3, **bench.TINY), bench.NOW)
    full = bench.plain_cluster("scale_down", **bench.FULL)
    assert len(full["pods"]) == 5000 and len(full["jobs"]) == 200
    waiting = [p[0] for p in full["pods"] if p[2] is None]
    queued = {key.rsplit("/", 1)[0] for key in waiting if ":" in key}  # Workloads, PodGroups
    assert len(queued) + sum(":" not in key for key in waiting) == 100
    assert {key.split(":")[0] for key in queued} == {"kueue", "volcano"}
    assert len(waiting) > 100  # a queued object's pods are records of their own


# Node selectors and taints.

def placed_cluster(nodes, *jobs, others=()):
    """``cluster`` with Node records as given (labels, taints)."""
    return Snapshot(nodes=tuple(nodes), pods=tuple(p for _, pods in jobs for p in pods)
                    + tuple(others), jobs=tuple(j for j, _ in jobs))


A100 = Placement(frozenset({("gpu", "a100")}))
DEDICATED = Taint("dedicated", "train", "NoSchedule")


def test_new_workers_go_only_where_the_jobs_pods_may_run():
    nodes = [Node("a", 8, frozenset({("gpu", "a100")})), Node("b", 8),
             Node("c", 8, frozenset({("gpu", "a100")}), (DEDICATED,))]
    entry = job("j", on="a", max_workers=16, factor=16, gpw=4, placement=A100)
    (d,) = decide(placed_cluster(nodes, entry), NOW)
    assert d.nodes == ("a",) and d.to_workers == 2  # not b (no label), not c (tainted)
    tolerant = dataclasses.replace(A100, tolerations=(
        Toleration("dedicated", "Equal", "train", "NoSchedule"),))
    (d,) = decide(placed_cluster(nodes, job("j", on="a", max_workers=16, factor=16, gpw=4,
                                            placement=tolerant)), NOW)
    assert sorted(d.nodes) == ["a", "c", "c"] and d.to_workers == 4
    # a job without a selector grows anywhere but the tainted node; PreferNoSchedule is no bar
    soft = Node("d", 8, taints=(Taint("flaky", "", "PreferNoSchedule"),))
    (d,) = decide(placed_cluster([*nodes, soft], job("k", on="a", max_workers=16, factor=16,
                                                     gpw=4)), NOW)
    assert d.nodes == ("a", "b", "b", "d", "d") and d.to_workers == 6


def test_room_is_made_only_where_the_pending_pod_may_run():
    nodes = [Node("a", 8), Node("b", 8, frozenset({("gpu", "a100")}))]
    # j's workers fill both nodes; freeing a's is cheaper, but the pod needs an a100
    cheap = job("j", on="aabb", max_workers=4, gpw=4, tps={1: 100, 2: 190, 3: 200, 4: 205})
    pod = dataclasses.replace(waiting("p", 4), placement=A100)
    (d,) = decide(placed_cluster(nodes, cheap, others=[pod]), NOW)
    assert d.kind == "scale_down" and d.room_for == (("p", "b"),)
    assert d.release == ("j-3",)
    # free GPUs on a do not count for it either
    roomy = [Node("a", 12), nodes[1]]
    (d,) = decide(placed_cluster(roomy, cheap, others=[pod]), NOW)
    assert d.room_for == (("p", "b"),) and d.release == ("j-3",)
    # a pod no node admits makes no room, and holds the scale-up back as any pending pod does
    nowhere = dataclasses.replace(pod, placement=Placement(frozenset({("gpu", "h100")})))
    assert decide(placed_cluster(nodes, cheap, others=[nowhere]), NOW) == ()


@pytest.mark.parametrize(("toleration", "taint", "tolerated"), [
    (Toleration("k", "Equal", "v", "NoSchedule"), Taint("k", "v", "NoSchedule"), True),
    (Toleration("k", "Equal", "v", ""), Taint("k", "v", "NoExecute"), True),
    (Toleration("k", "Equal", "w", "NoSchedule"), Taint("k", "v", "NoSchedule"), False),
    (Toleration("k", "Exists", "", "NoSchedule"), Taint("k", "v", "NoSchedule"), True),
    (Toleration("k", "Exists", "", "NoExecute"), Taint("k", "v", "NoSchedule"), False),
    (Toleration("", "Exists", "", ""), Taint("any", "x", "NoExecute"), True),
    (Toleration("", "Equal", "", ""), Taint("any", "", "NoSchedule"), False),
    (Toleration("other", "Exists", "", ""), Taint("k", "", "NoSchedule"), False),
])
def test_tolerations_match_as_the_scheduler_matches_them(toleration, taint, tolerated):
    assert toleration.tolerates(taint) is tolerated
    node = Node("n", 8, taints=(taint,))
    assert Placement(tolerations=(toleration,)).allows(node) is tolerated
