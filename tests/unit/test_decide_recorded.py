"""``decide`` decides as it did: its decisions on seeded random snapshots against a record.

Making ``decide`` fast at 10,000 nodes (issue 39, ``bench/decide.py``) was to change no
decision. ``decide_recorded.json`` holds a digest of the decisions on each case below, written
by the code before that work; a change that moves decisions on purpose writes it again, and
says why in its commit:

    PYTHONPATH=api:agent:operator:doubles .venv/bin/python -m tests.unit.test_decide_recorded \
        --record

The cases: random clusters of every feature the policy reads (placements and taints, busy and
releasing jobs, cooldowns, new jobs, jobs below their minimum, stragglers, joiners, pending pods
of every kind, arrivals with their GPUs), clusters of identical jobs (losses tie), and the
benchmark's own snapshots at two sizes.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

import pytest

from tests.unit import test_policy
from tests.unit.test_policy import bench
from tests.unit.test_scale_down import identical_jobs
from tidal_operator.policy import decide
from tidal_operator.snapshot import (ElasticJob, Node, Placement, Pod, Snapshot, Taint,
                                     Toleration)

RECORD = Path(__file__).with_name("decide_recorded.json")
NOW = 1_000_000.0
HOUR = 3600.0
LABELS = ({}, {"gpu": "a100"}, {"gpu": "h100"}, {"gpu": "a100", "zone": "b"})
TAINTS = ((), (), (), (Taint("dedicated", "train", "NoSchedule"),),
          (Taint("dedicated", "infer", "NoExecute"),),
          (Taint("flaky", "", "PreferNoSchedule"),))
PLACEMENTS = (
    Placement(), Placement(), Placement(), Placement(frozenset({("gpu", "a100")})),
    Placement(frozenset({("gpu", "h100")})),
    Placement(tolerations=(Toleration("dedicated", "Equal", "train", "NoSchedule"),)),
    Placement(frozenset({("zone", "b")}), (Toleration("", "Exists"),)),
)


def random_cluster(seed: int) -> tuple[Snapshot, float]:
    """A seeded random cluster, and the ``now`` to decide it at."""
    rng = random.Random(seed)
    nodes = tuple(Node(f"n{i:02d}", rng.choice([1, 2, 4, 8, 8, 16]),
                       frozenset(rng.choice(LABELS).items()), rng.choice(TAINTS))
                  for i in range(rng.randint(2, 40)))
    free = {n.name: n.gpus for n in nodes}
    now = NOW - rng.choice([0.0, 30.0, 600.0])
    pods, jobs = [], []
    for j in range(rng.randint(1, 12)):
        key, placement = f"ns/job-{j:02d}", rng.choice(PLACEMENTS)
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, lo * 6)
        gpw = rng.choice([1, 1, 2, 4])
        allowed = [n.name for n in nodes if placement.allows(n)]
        members = []
        for rank in range(rng.randint(lo, hi) if rng.random() < 0.85 else lo - 1):
            fits = [n for n in allowed if free[n] >= gpw]
            if not fits:
                break
            node = rng.choice(fits)
            free[node] -= gpw
            members.append(f"{key}-{rank}")
            pods.append(Pod(members[-1], gpw, node, rng.choice(["Running"] * 9 + ["Pending"]),
                            key, placement=placement))
        low = max(1, lo - rng.randint(0, 1))  # a table from before min was raised
        kept = sorted({low} | {w for w in range(low, hi + 1)
                               if w == len(members) or rng.random() < 0.7})
        tps, speed = {}, 100.0 * rng.uniform(0.5, 20)
        for w in kept:
            speed *= rng.choice([1.0, 1.02, 1.1, 1.3, 1.6, 0.97])  # flat and falling rows too
            tps[w] = speed
        busy = rng.random() < 0.2
        if rng.random() < 0.08:  # its worker asked for and waiting for a node: a joiner
            pods.append(Pod(f"{key}-join", gpw, None, "Pending", key, placement=placement))
        jobs.append(ElasticJob(
            key=key, min_workers=lo, max_workers=hi, workers=len(members), gpus_per_worker=gpw,
            max_scale_factor=rng.choice([4, 4, 2, 1, 8]), members=tuple(members), busy=busy,
            releasing=tuple(m for m in members[1:] if busy and rng.random() < 0.4),
            scale_table=None if rng.random() < 0.05 else bench.scale_table(key, tps, low, hi,
                                                                            gpw),
            enabled=rng.random() > 0.05, min_gain=rng.choice([0.0, 0.05, 0.05, 0.3]),
            probability_threshold=rng.choice([0.0, 0.6, 0.6, 0.95, 0.99]),
            arrival_window_seconds=rng.choice([None, None, HOUR]),
            cooldown_seconds=rng.choice([0.0, 60.0]),
            last_scale_time=rng.choice([None, now - HOUR, now - 10.0]),
            switch_seconds=rng.choice([0.0, 2.0, 30.0, 600.0]), placement=placement,
            slow=tuple(m for m in members[1:] if rng.random() < 0.15),
        ))
    if rng.random() < 0.3:  # a job just created: its pods wait
        lo = rng.randint(1, 3)
        placement, key = rng.choice(PLACEMENTS), "ns/job-new"
        jobs.append(ElasticJob(key=key, min_workers=lo, max_workers=lo + 3, workers=0,
                               gpus_per_worker=rng.choice([1, 2]), busy=True, unstarted=True,
                               preferred_workers=rng.choice([None, lo + 2]),
                               placement=placement))
    for i, node in enumerate(nodes):
        if free[node.name] and rng.random() < 0.7:
            gpus = rng.randint(1, free[node.name])
            pods.append(Pod(f"other/run-{i}", gpus, node.name,
                            rng.choice(["Running", "Running", "Pending", "Succeeded", "Failed"]),
                            created=now - rng.uniform(0, HOUR)))
    for i in range(rng.choice([0, 0, 1, 2, 5, 12])):
        pods.append(Pod(f"other/wait-{i}", rng.choice([1, 1, 2, 4, 8]), None, "Pending",
                        unschedulable=rng.random() < 0.5,
                        created=now - rng.choice([5.0, 50.0, 50.0, 300.0]),
                        placement=rng.choice(PLACEMENTS)))
    count = rng.choice([0, 3, 20, 200])
    arrivals = [now - rng.uniform(0, 10 * HOUR) for _ in range(count)]
    sizes = [rng.choice([1, 2, 4, 8, 16]) for _ in arrivals] if rng.random() < 0.7 else []
    rng.shuffle(pods)
    return Snapshot(nodes, tuple(pods), tuple(jobs), tuple(arrivals), rng.choice([HOUR, 8 * HOUR]),
                    tuple(sizes)), now


SMALL = {"nodes": 120, "gpus_per_node": 8, "jobs": 30, "pods": 900}


def case(name: str) -> tuple[Snapshot, float]:
    """The snapshot and ``now`` of a named case: random-N, tied-N, bench-SCENARIO-SIZE-N."""
    kind, _, rest = name.partition("-")
    if kind == "random":
        return random_cluster(int(rest))
    if kind == "tied":
        return identical_jobs(int(rest)), test_policy.NOW
    scenario, size, seed = rest.split("-")
    sizes = {"small": SMALL, "1k": bench.FULL}
    return bench.build_snapshot(scenario, seed=int(seed), **sizes[size]), bench.NOW


CASES = ([f"random-{s}" for s in range(400)] + [f"tied-{s}" for s in range(8)]
         + [f"bench-{sc}-small-{s}" for sc in ("scale_up", "scale_down") for s in range(8)]
         + [f"bench-{sc}-1k-{s}" for sc in ("scale_up", "scale_down") for s in range(2)])


def digest(name: str) -> str:
    snapshot, now = case(name)
    return hashlib.sha256(repr(decide(snapshot, now)).encode()).hexdigest()[:20]


def test_the_cases_decide_something():
    """The record is worth keeping: most cases decide something, of every kind."""
    kinds = {}
    for name in CASES[::7]:
        for d in decide(*case(name)):
            kinds[d.kind, d.reason] = kinds.get((d.kind, d.reason), 0) + 1
    assert {reason for _, reason in kinds} == {"IdleGPUs", "PendingGPUPods", "BelowMinimum",
                                               "Straggler", "Initial"}, kinds


@pytest.mark.parametrize("chunk", range(8))
def test_decisions_are_as_recorded(chunk):
    recorded = json.loads(RECORD.read_text())
    names = CASES[chunk::8]
    assert {name: digest(name) for name in names} == {name: recorded[name] for name in names}


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    RECORD.write_text(json.dumps({name: digest(name) for name in CASES}, indent=0) + "\n")
    print(f"recorded {len(CASES)} cases in {RECORD}")
