"""The scale-down's search: its heap of bounds finds the plans a scan of every node finds.

``make_room`` expands a node's plans only where a lower bound on their loss does not rule it
out (``tidal_operator.scale_down._Room``); these tests run ``decide`` again with every pod's
search a plain scan of every node, by name, and ask for the same decisions: on random small
clusters, on the benchmark's, and on clusters of identical jobs, where losses tie.
"""

import random

import pytest
from hypothesis import given, settings

from tests.unit.test_policy import NOW, bench, clusters, scale_table
from tidal_operator import scale_down
from tidal_operator.policy import decide
from tidal_operator.snapshot import ElasticJob, Node, Pod, Snapshot


def scanned(snapshot: Snapshot, monkeypatch: pytest.MonkeyPatch, now: float = NOW):
    """``decide`` with each pending pod's search a scan of every node."""
    with monkeypatch.context() as patch:
        patch.setattr(scale_down._Room, "cheapest", lambda room, gpus, allowed: room._scan(
            gpus, frozenset(room.on_node) if allowed is None else allowed))
        return decide(snapshot, now)


def identical_jobs(seed: int) -> Snapshot:
    """A full cluster of jobs with one scale table (every loss ties with another) and pods of
    1 to 8 GPUs waiting."""
    rng = random.Random(seed)
    names = [f"node-{i:02d}" for i in range(24)]
    free = dict.fromkeys(names, 8)
    table = {w: 100.0 * w**0.8 for w in range(1, 17)}
    pods, jobs = [], []
    for j in range(12):
        key, gpw = f"ns/job-{j:02d}", rng.choice([1, 2, 4])
        members = []
        for rank in range(rng.randint(2, 8)):
            node = rng.choice([n for n in names if free[n] >= gpw] or [None])
            if node is None:
                break
            free[node] -= gpw
            members.append(f"{key}-{rank}")
            pods.append(Pod(members[-1], gpw, node, "Running", key))
        jobs.append(ElasticJob(key=key, min_workers=1, max_workers=16, workers=len(members),
                               gpus_per_worker=gpw, members=tuple(members),
                               scale_table=scale_table(key, table, 1, 16, gpw)))
    pods += [Pod(f"other/run-{n}", g, n, "Running") for n, g in free.items() if g]
    pods += [Pod(f"other/wait-{i}", rng.choice([1, 2, 4, 8]), None, "Pending",
                 created=NOW - rng.choice([10.0, 20.0])) for i in range(10)]
    return Snapshot(tuple(Node(n, 8) for n in names), tuple(pods), tuple(jobs))


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_the_search_decides_as_a_scan_of_every_node_on_random_clusters(snapshot):
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert decide(snapshot, NOW) == scanned(snapshot, monkeypatch)


@pytest.mark.parametrize("seed", range(8))
def test_the_search_decides_as_a_scan_where_losses_tie(seed, monkeypatch):
    snapshot = identical_jobs(seed)
    decisions = decide(snapshot, NOW)
    assert any(d.kind == "scale_down" for d in decisions)
    assert decisions == scanned(snapshot, monkeypatch)


@pytest.mark.parametrize("seed", range(4))
def test_the_search_decides_as_a_scan_on_the_benchmark_cluster(seed, monkeypatch):
    size = {"nodes": 80, "gpus_per_node": 8, "jobs": 20, "pods": 600}
    snapshot = bench.build_snapshot("scale_down", seed=seed, **size)
    decisions = decide(snapshot, bench.NOW)
    assert sum(d.kind == "scale_down" for d in decisions) > 1
    assert decisions == scanned(snapshot, monkeypatch, bench.NOW)
