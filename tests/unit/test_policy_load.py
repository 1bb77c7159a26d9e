"""The scale-up threshold over the cluster's load: the slide, the smoothing, the share owed,
and the operator's snapshot carrying it (issue 39)."""

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.test_policy import HOUR, NOW, cluster, job, recent, running, waiting
from tidal_operator.controller import Controller
from tidal_operator.metrics import Metrics
from tidal_operator.policy import IDLE_GPUS, QUEUE_RISK, Load, decide, threshold_at
from tidal_operator.snapshot import ElasticJob, Node, Pod, Snapshot


def strict(threshold=0.99, loaded=0.95):
    return ElasticJob(key="j", min_workers=1, max_workers=2, workers=1,
                      probability_threshold=threshold, loaded_threshold=loaded)


@pytest.mark.parametrize(("load", "expected"), [
    (0.0, 0.99), (0.1, 0.99),  # QUEUE_RISK x 0.11 < 0.01: the spec's threshold holds
    (0.25, 1 - QUEUE_RISK / 3), (0.4, 1 - QUEUE_RISK * 2 / 3),
    (0.5, 0.95), (0.9, 0.95), (1.0, 0.95),  # never below loadedThreshold
])
def test_the_threshold_slides_from_the_specs_to_the_loaded_one(load, expected):
    assert threshold_at(strict(), load) == pytest.approx(expected)


def test_a_threshold_at_or_below_the_loaded_one_does_not_slide():
    for load in (0.0, 0.5, 0.99, 1.0):
        assert threshold_at(strict(0.6), load) == 0.6
        assert threshold_at(strict(0.99, loaded=0.99), load) == 0.99


@given(st.floats(0, 1), st.floats(0, 1), st.floats(0, 0.999), st.floats(0, 0.999))
def test_the_threshold_never_rises_with_the_load(a, b, threshold, loaded):
    job = strict(threshold, loaded)
    low, high = sorted((a, b))
    assert threshold_at(job, high) <= threshold_at(job, low) <= threshold
    assert threshold_at(job, high) >= min(threshold, loaded)


def gambler(**settings):
    """A job whose one scale-up (gain 1, two 30 s switches) at 2 arrivals an hour passes the
    Poisson rule with P = exp(-2/h x 60 s) = 0.967: above 0.95, below 0.99."""
    return job("j", on="a", max_workers=2, tps={1: 100, 2: 200}, switch_seconds=30,
               arrival_window_seconds=HOUR, probability_threshold=0.99, **settings)


def test_a_loaded_cluster_takes_the_bet_that_a_light_one_does_not():
    light = cluster({"a": 8}, gambler(), arrivals=recent(2))
    assert decide(light, NOW) == ()
    (decision,) = decide(replace(light, load=0.6), NOW)
    assert (decision.kind, decision.reason, decision.to_workers) == ("scale_up", IDLE_GPUS, 2)
    assert decision.probability == pytest.approx(math.exp(-2 / HOUR * 60))
    assert f"> {threshold_at(gambler()[0], 0.6):.2f} at 2.00 arrivals/h" in decision.message
    assert threshold_at(gambler()[0], 0.6) == pytest.approx(1 - QUEUE_RISK * 1.5)  # 0.91


def test_the_load_is_smoothed_over_the_window():
    load = Load()
    assert load.observe(0.0, 0.8, HOUR) == 0.8  # the first share seen, as it is
    assert load.observe(HOUR, 0.2, HOUR) == pytest.approx(0.2 + 0.6 * math.exp(-1))
    assert load.observe(HOUR, 1.0, HOUR) == pytest.approx(0.2 + 0.6 * math.exp(-1))  # no time
    steady = Load(0.0)
    for hour in range(1, 11):
        steady.observe(hour * HOUR, 0.5, HOUR)
    assert steady.share == pytest.approx(0.5, abs=1e-4)


def test_the_share_owed_counts_elastic_jobs_up_to_their_minimum():
    elastic = ElasticJob(key="e", min_workers=2, max_workers=8, workers=5, gpus_per_worker=2)
    pods = (running("x", "a", 4), waiting("queued", 8), running("cordoned", "c", 8),
            Pod("done", 4, "b", "Succeeded"),
            *(Pod(f"e-{i}", 2, "b", "Running", "e") for i in range(5)))
    snapshot = Snapshot(nodes=(Node("a", 8), Node("b", 16)), pods=pods, jobs=(elastic,))
    assert snapshot.owed_share() == pytest.approx((4 + 2 * 2) / 24)
    assert Snapshot(nodes=()).owed_share() == 0.0


def test_the_operators_snapshot_carries_the_smoothed_load():
    controller = Controller(adapter=None, metrics=Metrics())
    controller.nodes = {"a": [Node("a", 8)]}
    controller.pods = {"x": [running("x", "a", 6)]}
    assert controller.snapshot({}, NOW).load == 0.75
    controller.pods = {}
    later = controller.snapshot({}, NOW + 8 * HOUR)  # the default window: 8 hours
    assert later.load == pytest.approx(0.75 * math.exp(-1))
