"""The agent's side of the operator protocol, against a Kubernetes API emulator over HTTP.

The test plays the operator: it creates the ElasticTrainingJob, starts agents as local
processes with a worker pod's environment, and writes ``status.target`` through the status
subresource. Nothing is mocked: real HTTP, a real TCPStore, real gloo worlds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from contextlib import closing
from datetime import timedelta
from functools import partial

import pytest
import torch.distributed as dist
from lightkube.resources.core_v1 import Event
from prometheus_client import CollectorRegistry

from tests.commands import tidal_forked
from tests.integration.agents import (NAMESPACE, Observer, Pods, assert_bits_of_a_static_run,
                                      checkout_env, create,
                                      finish, free_port, job_doc, set_status, status, until)
from tidal_agent import checkpoint
from tidal_agent.events import Stepped, Straggler
from tidal_agent.generations import ControlledGenerations, LeaderRecovering
from tidal_agent.link import ControlError, ControlLink
from tidal_agent.metrics import JobMetrics
from tidal_agent.protocol import Halt, RendezvousLost
from tidal_agent.report import AgentReport
from tidal_api import Target, keys
from tidal_plan.elastic import Generation
from tidal_plan.layout import build_layout


# ---- ControlLink --------------------------------------------------------------------------------


def test_link_reads_the_job_and_follows_its_target(emulator, api):
    create(api, job_doc())
    link = ControlLink("tiny", NAMESPACE, kubeconfig=str(emulator.kubeconfig), watch_timeout_s=1)
    try:
        job = link.job()
        assert job.metadata.name == "tiny" and job.spec.workers.min == 2
        assert link.target() is None
        link.start()
        target = {"workers": 3, "generation": 1, "join": ["tiny-worker-2"], "reason": "IdleGPUs"}
        set_status(api, {"target": target})
        got = until(link.target, 10, "the watch to see the target")
        assert got == Target(workers=3, generation=1, join=("tiny-worker-2",), reason="IdleGPUs")
        set_status(api, {"target": {**target, "generation": 2, "workers": 2, "join": [],
                                     "release": ["tiny-worker-1"]}})
        until(lambda: link.target().generation == 2, 10, "the second target")
        assert link.target().release == ("tiny-worker-1",)
    finally:
        link.close()


def test_publish_patches_only_agent_fields_and_at_most_every_interval(emulator, api):
    create(api, job_doc())
    operator_fields = {"phase": "Running", "workers": 2,
                       "target": {"workers": 2, "generation": 0}}
    set_status(api, operator_fields)
    operator_fields = {key: status(api)[key] for key in operator_fields}  # as defaulted
    link = ControlLink("tiny", NAMESPACE, kubeconfig=emulator.url, publish_interval_s=1.0,
                       watch_timeout_s=1)
    link.start()
    try:
        link.publish(generation=0, members=("tiny-worker-0", "tiny-worker-1"))
        until(lambda: status(api).get("generation") == 0, 5, "generation 0")
        started = time.monotonic()
        for step in range(1, 21):  # faster than the interval: coalesced into one patch
            link.publish(step=step, loss=5.0 - step / 10, tokens_per_second=1000.0 + step)
            time.sleep(0.01)
        until(lambda: status(api).get("step") == 20, 5, "step 20")
        assert time.monotonic() - started >= 0.9  # held back until the interval was over
        # The publisher counts a patch once its response is in: the API may show it sooner.
        until(lambda: link.patches >= 2, 2, "the second patch to be counted")
        assert link.patches == 2
        link.publish(step=21)
        link.publish(generation=1, members=("tiny-worker-0", "tiny-worker-1", "tiny-worker-2"))
        until(lambda: status(api).get("generation") == 1, 0.8, "a new generation at once")
    finally:
        link.close()
    final = status(api)
    assert final["step"] == 21 and final["loss"] == pytest.approx(3.0)
    assert final["tokensPerSecond"] == 1020.0
    assert final["members"] == ["tiny-worker-0", "tiny-worker-1", "tiny-worker-2"]
    for key, value in operator_fields.items():  # the operator's fields are untouched
        assert final[key] == value
    with pytest.raises(ValueError, match="not agent-owned"):
        link.publish(target={"workers": 3, "generation": 1})


def test_stragglers_go_to_status_events_and_metrics(emulator, api):
    """The leader's report of the straggler watch: status.stragglers, an Event per flag
    raised or cleared, and the per-member relative speed and straggler count as metrics."""
    create(api, job_doc())
    link = ControlLink("tiny", NAMESPACE, kubeconfig=emulator.url, publish_interval_s=0.1,
                       watch_timeout_s=1)
    link.job()
    link.start()
    registry = CollectorRegistry()
    report = AgentReport(link, tokens_per_step=64,
                         metrics=JobMetrics(registry, NAMESPACE, "tiny"))
    labels = {"namespace": NAMESPACE, "job": "tiny"}
    layout = build_layout(num_units=8, workers=2, micro_batch_size=2, num_micro_batches=8)
    try:
        report.put(Straggler(worker="tiny-worker-0", member="tiny-worker-1", step=12,
                             flagged=True, slowdown=2.125))
        report.put(Stepped(worker="tiny-worker-0", step=13, loss=1.0, loss_hex="", grad_norm=1.0,
                           lr=1e-3, seconds=0.5, snapshot_s=None, layout=layout,
                           speeds={"tiny-worker-0": 1.0, "tiny-worker-1": 0.5}))
        flagged = [{"member": "tiny-worker-1", "slowdown": 2.125, "sinceStep": 12,
                    "release": False}]
        until(lambda: status(api).get("stragglers") == flagged, 10, "the flag in status")
        assert registry.get_sample_value(
            "tidal_agent_relative_speed", {**labels, "member": "tiny-worker-1"}) == 0.5
        assert registry.get_sample_value("tidal_agent_stragglers", labels) == 1

        report.put(Straggler(worker="tiny-worker-0", member="tiny-worker-1", step=20,
                             flagged=False, slowdown=1.1))
        until(lambda: status(api).get("stragglers") == [], 10, "the flag cleared")

        def events():
            return sorted((e.reason, e.type, e.message) for e in api.list(Event, namespace=NAMESPACE)
                          if e.involvedObject.name == "tiny")

        until(lambda: len(events()) == 2, 10, "two Events")
        assert events() == [
            ("Straggler", "Warning", "step 12: tiny-worker-1 is a straggler: its decoder layers "
             "take 2.12x the other workers' median"),
            ("StragglerRecovered", "Normal", "step 20: tiny-worker-1 is no longer a straggler: "
             "its decoder layers take 1.10x the other workers' median"),
        ]
    finally:
        link.close()


def test_the_last_step_is_left_for_the_leaders_end_to_publish(emulator, api):
    """status.step at the job's last step marks it Succeeded: the last step's loss goes out
    with the step before it, and only the leader's end (its report written) says it is done."""
    create(api, job_doc())
    link = ControlLink("tiny", NAMESPACE, kubeconfig=emulator.url, publish_interval_s=0.1,
                       watch_timeout_s=1)
    link.job()
    link.start()
    report = AgentReport(link, tokens_per_step=64, final_step=15)
    layout = _layout(2)
    try:
        for step, loss in ((13, 2.0), (14, 1.5)):
            report.put(Stepped(worker="tiny-worker-0", step=step, loss=loss, loss_hex="",
                               grad_norm=1.0, lr=1e-3, seconds=0.5, snapshot_s=None,
                               layout=layout, speeds={}))
        until(lambda: status(api).get("loss") == 1.5, 10, "the last step's loss")
        assert status(api)["step"] == 14
        link.publish(step=15)
        until(lambda: status(api).get("step") == 15, 10, "the leader's end")
    finally:
        link.close()


def test_api_errors_are_retried_not_raised(emulator, api):
    # Publishing to a job that does not exist yet: 404s, retried until it does.
    link = ControlLink("late", NAMESPACE, kubeconfig=emulator.url, publish_interval_s=0.1,
                       watch_timeout_s=1)
    link.start()
    try:
        link.publish(generation=0, step=3)
        time.sleep(1.0)
        create(api, job_doc("late"))
        until(lambda: status(api, "late").get("step") == 3, 10, "the retried patch")
        set_status(api, {"target": {"workers": 3, "generation": 1}}, name="late")
        until(link.target, 10, "the watch to find the job")
    finally:
        link.close()
    with closing(socket.socket()) as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(ControlError, match="cannot read ElasticTrainingJob default/tiny"):
        ControlLink("tiny", NAMESPACE, kubeconfig=nowhere).job(retry_for_s=1.0)


# ---- membership through the rendezvous store ---------------------------------------------------


def _layout(workers: int):
    return build_layout(num_units=8, workers=workers, micro_batch_size=2, num_micro_batches=8)


def _drive(source: ControlledGenerations, me: str, steps: int, trained: list, step_s=0.01):
    """The worker's step-boundary logic (worker._Worker.run) without the training."""
    started = source.start(me)
    if started is None:
        trained.append((me, "released from standby"))
        return
    gen, _ = started
    step, following = gen.at_step, None
    while step < steps:
        if following is None:
            following = source.following(gen, step)
            if isinstance(following, Halt):
                trained.append((me, "halted", following.step))
                if me == source.leader:
                    source.end(step)
                return
        if following is not None and step == following.at_step:
            if me not in following.members:
                trained.append((me, "left", step))
                return
            gen, following = following, None
            continue
        trained.append((me, step, gen.index, gen.members, source.layout(gen).pp))
        time.sleep(step_s)
        done = f"test/step/{step}"  # the step's all-reduce: members move in lockstep
        source.store.add(done, 1)
        while source.store.add(done, 0) < len(gen.members):
            time.sleep(0.001)
        step += 1
    if me == source.leader:
        source.end(steps)


def test_generations_follow_targets_through_the_store():
    steps, leader = 150, "j-worker-0"
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30), use_libuv=True)
    box: dict = {"target": None}

    def source(me):
        store = dist.PrefixStore("j/", dist.TCPStore("127.0.0.1", host.port, is_master=False,
                                                     timeout=timedelta(seconds=30)))
        return ControlledGenerations(
            me=me, leader=leader, store=store, min_workers=2, steps=steps,
            choose=lambda n: (_layout(n), None), target=lambda: box["target"],
            poll_s=0.01,
        )

    trained: list = []
    threads = {}

    def run(me):
        src = source(me)
        threads[me] = threading.Thread(target=_drive, args=(src, me, steps, trained), daemon=True)
        threads[me].start()
        return src

    probe = source("probe").store

    def registered(pod):
        return lambda: probe.check([f"pod/{pod}"])

    run("j-worker-1")
    until(registered("j-worker-1"), 10, "worker-1 to register")
    run("j-worker-3")  # registers second: beyond min, so it waits in standby
    until(registered("j-worker-3"), 10, "worker-3 to register")
    run(leader)
    until(lambda: any(t[0] == leader and t[1] == 3 for t in trained), 10, "step 3")
    # Scale up before the joiner exists: the leader goes on training until it registers.
    box["target"] = Target(workers=3, generation=1, join=("j-worker-2",))
    time.sleep(0.3)
    assert {t[2] for t in trained if len(t) == 5} == {0}
    run("j-worker-2")
    until(lambda: any(len(t) == 5 and t[2] == 1 for t in trained), 10, "generation 1")
    # Scale down, releasing a member that is not the last one.
    box["target"] = Target(workers=2, generation=2, release=("j-worker-1",))
    for thread in threads.values():
        thread.join(30)
        assert not thread.is_alive()

    by_step: dict[int, set] = {}
    for me, step, index, members, pp in (t for t in trained if len(t) == 5):
        by_step.setdefault(step, set()).add((me, index, members, pp))
    assert sorted(by_step) == list(range(steps))
    runs = []  # (generation, members, pp) in step order; every member saw the same one
    for step in range(steps):
        gens = {(i, m, p) for _, i, m, p in by_step[step]}
        assert len(gens) == 1, (step, by_step[step])
        index, members, pp = gens.pop()
        assert {me for me, *_ in by_step[step]} == set(members)
        if not runs or runs[-1][0] != index:
            runs.append((index, members, pp, step))
    assert [r[:3] for r in runs] == [
        (0, ("j-worker-0", "j-worker-1"), 2),
        (1, ("j-worker-0", "j-worker-1", "j-worker-2"), 3),
        (2, ("j-worker-0", "j-worker-2"), 2),
    ]
    left = [t for t in trained if t[1] == "left"]
    assert left == [("j-worker-1", "left", runs[2][3])]
    assert ("j-worker-3", "released from standby") in trained


def test_a_leader_asked_to_stop_halts_the_job_and_the_next_start_resumes(tmp_path):
    """SIGTERM on the leader (its pod deleted, its node drained): every member halts at the
    same boundary and a pod in standby leaves; the job's next start (the operator's restart)
    begins at the newest complete checkpoint, on every member."""
    steps, leader = 100, "j-worker-0"
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30), use_libuv=True)
    stop = threading.Event()

    def source(me, prefix):
        store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", host.port, is_master=False,
                                                       timeout=timedelta(seconds=30)))
        return ControlledGenerations(
            me=me, leader=leader, store=store, min_workers=2, steps=steps,
            choose=lambda n: (_layout(n), None), poll_s=0.01,
            checkpoint_root=str(tmp_path), stop=stop if me == leader else None)

    trained: list = []
    threads = []
    for me in ("j-worker-1", "j-worker-2", leader):  # worker-2 registers beyond min: standby
        src = source(me, "run/")
        threads.append(threading.Thread(target=_drive, args=(src, me, steps, trained),
                                        daemon=True))
        threads[-1].start()
        until(lambda: src.store.check([f"pod/{me}"]), 10, f"{me} to register")
    until(lambda: any(t[0] == leader and t[1] == 5 for t in trained), 10, "step 5")
    stop.set()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()
    halts = {t[0]: t[2] for t in trained if t[1] == "halted"}
    assert set(halts) == {leader, "j-worker-1"} and len(set(halts.values())) == 1
    (halted,) = set(halts.values())
    assert max(t[1] for t in trained if isinstance(t[1], int)) == halted - 1
    assert ("j-worker-2", "released from standby") in trained

    # The restart: the members saved that boundary (and an older one; a newer one is
    # incomplete). Generation 0 starts at the newest complete one, and says which.
    for done, complete in ((halted - 3, True), (halted, True), (halted + 1, False)):
        checkpoint.step_dir(tmp_path, done).mkdir(parents=True)
        if complete:
            (checkpoint.step_dir(tmp_path, done) / checkpoint.MARKER).write_text("{}")
    fresh = {me: source(me, "restart/") for me in (leader, "j-worker-1")}
    fresh["j-worker-1"].register()
    gen, previous = fresh[leader].start(leader)
    assert (gen.index, gen.at_step, previous) == (0, halted, None)
    assert fresh["j-worker-1"].start("j-worker-1") == (gen, None)
    expected = str(checkpoint.step_dir(tmp_path, halted))
    assert fresh[leader].resume_from == fresh["j-worker-1"].resume_from == expected


def test_without_the_rendezvous_the_members_agree_through_files_on_what_to_save(tmp_path):
    """The rendezvous store gone, recover says so; the members agree through a FileStore
    under the checkpoint root on the newest boundary their peer snapshots hold whole, or on
    nothing if one of them does not report. (Saving it is the worker's: tests/e2e.)"""
    leader, w1, w2 = "j-worker-0", "j-worker-1", "j-worker-2"
    trained = Generation(index=3, at_step=0, members=(leader, w1, w2))
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30), use_libuv=True)

    port = host.port

    def source(me, run="r1", wait_s=30.0, store=None):
        src = ControlledGenerations(me=me, leader=leader, store=store, min_workers=2, steps=100,
                                    choose=lambda n: (_layout(n), None), poll_s=0.01,
                                    checkpoint_root=str(tmp_path), rescue_wait_s=wait_s)
        src.run = run  # as its generation's announcement says
        return src

    sources = {me: source(me, store=dist.PrefixStore("j/", dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))))
        for me in trained.members}
    del host  # the rendezvous's process ends, and its store with it
    with pytest.raises(RendezvousLost, match="the job's rendezvous store is gone"):
        sources[w1].recover(w1, trained, 8, RuntimeError("Connection closed by peer"), {})

    def copy(step, of=None):
        data = {"generation": 3, "members": list(trained.members),
                "layout": _layout(3).to_dict(), "step": step}
        return {**data, "of": of} if of else data

    held = {  # a ring: each keeps its own copies and its predecessor's
        leader: {"own": [copy(7), copy(8)], "ward": [copy(7, w2), copy(8, w2)]},
        w1: {"own": [copy(7), copy(8)], "ward": [copy(7, leader), copy(8, leader)]},
        w2: {"own": [copy(7)], "ward": [copy(7, w1)]},  # a boundary behind: it failed first
    }
    got = {}
    threads = [threading.Thread(target=lambda me=me: got.setdefault(
        me, sources[me].rescue(me, trained, held[me]))) for me in trained.members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    gen, cut, _ = got[w1]
    assert all((g, c) == (gen, cut) for g, c, _ in got.values())
    assert (gen.members, gen.at_step, cut.step) == (trained.members, 7, 7)
    # A member that never reports (its node went with the rendezvous's): no rescue.
    alone = source(w1, run="r2", wait_s=0.3)
    assert alone.rescue(w1, trained, held[w1]) is None
    assert source(w1, run="").rescue(w1, trained, held[w1]) is None  # no run: no agreement


def _connect(host: dist.TCPStore) -> dist.Store:
    return dist.PrefixStore("j/", dist.TCPStore("127.0.0.1", host.port, is_master=False,
                                                timeout=timedelta(seconds=30)))


def _fault_sources(host: dist.TCPStore, pods: tuple[str, ...], box: dict, root,
                   **kw) -> dict[str, ControlledGenerations]:
    """One source per pod over ``host``'s store, with heartbeats, as the fault tests use them."""
    return {me: ControlledGenerations(
        me=me, leader=pods[0], store=_connect(host), steps=100,
        choose=lambda n: (_layout(n), None), target=lambda: box["target"], poll_s=0.01,
        checkpoint_root=str(root), heartbeat=_connect(host), beat_s=0.05, lost_after_s=0.5,
        fault_wait_s=20, **kw) for me in pods}


def _in_threads(calls: dict) -> dict:
    """Run each pod's call in a thread of its own; what each returned or raised."""
    out: dict = {}

    def run(me, call):
        try:
            out[me] = call()
        except Exception as err:  # noqa: BLE001 - the outcome under test
            out[me] = err
    threads = [threading.Thread(target=run, args=item, daemon=True) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()
    return out


def test_recovery_decisions_through_the_store(tmp_path):
    """The fault path's agreement, with threads for pods: a failure nobody died of is raised,
    a silent member is left behind, a member the target releases is not waited for."""
    for done in (4, 8):  # complete checkpoints (their contents are not read here)
        (tmp_path / f"step-{done:08d}").mkdir()
        (tmp_path / f"step-{done:08d}" / "tidal.json").write_text("{}")
    (tmp_path / "step-00000012").mkdir()  # a save that never finished: no marker
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30), use_libuv=True)
    pods = ("j-worker-0", "j-worker-1", "j-worker-2")
    # Generation 0 in this order whichever thread registers first, as the operator names it.
    box: dict = {"target": Target(workers=3, generation=0, join=pods)}

    sources = _fault_sources(host, pods, box, tmp_path, min_workers=3)
    in_threads = _in_threads

    started = in_threads({me: partial(sources[me].start, me) for me in pods})
    gen = started[pods[0]][0]
    assert gen.members == pods and all(started[me][0] == gen for me in pods)

    # A failure with every member alive is a bug: each raises its own error. A member
    # waiting at the next step boundary hears of the leader's recovery from the store.
    boom = RuntimeError("boom")

    def waits_then_recovers():
        with pytest.raises(LeaderRecovering):
            sources[pods[1]].following(gen, 6)
        return sources[pods[1]].recover(pods[1], gen, 6, boom)

    out = in_threads({pods[0]: lambda: sources[pods[0]].recover(pods[0], gen, 5, boom),
                      pods[1]: waits_then_recovers,
                      pods[2]: lambda: sources[pods[2]].recover(pods[2], gen, 5, boom)})
    assert all(out[me] is boom for me in pods)

    # j-worker-2 dies: no report, no heartbeat. The others go on without it from the newest
    # complete checkpoint at or before the failure, under the same generation number.
    sources[pods[2]].stop_beating()
    out = in_threads({me: partial(sources[me].recover, me, gen, 11, boom) for me in pods[:2]})
    assert out[pods[0]] == out[pods[1]]
    recovery = out[pods[0]]
    assert recovery.generation == Generation(index=0, at_step=8, members=pods[:2])
    assert recovery.lost == (pods[2],) and recovery.failed_at == 11
    assert recovery.checkpoint == str(tmp_path / "step-00000008")
    assert recovery.world == "recovery2"
    assert sources[pods[0]].lost == {pods[2]}
    assert sources[pods[0]].layout(recovery.generation).pp == 2

    # The operator asked j-worker-1 to leave; it hangs (its heartbeat goes on) and is
    # deleted at the deadline. The leader does not wait for it: the target's generation
    # runs, from the checkpoint before the failure.
    box["target"] = Target(workers=1, generation=1, release=(pods[1],))
    started_at = time.monotonic()
    recovery = sources[pods[0]].recover(pods[0], recovery.generation, 7, boom)
    assert time.monotonic() - started_at < 0.5  # not lost_after_s
    assert recovery.generation == Generation(index=1, at_step=4, members=pods[:1])
    assert recovery.lost == (pods[1],) and recovery.world == "recovery3"
    assert sources[pods[0]].applied == 1
    # A released pod that reports late learns that it is no member and leaves.
    assert sources[pods[1]].recover(pods[1], gen, 7, boom) is None

    # A replacement joins after three recoveries: it reads the control keys of the fourth
    # epoch, as the leader writes them, not the first.
    leader, alone = sources[pods[0]], recovery.generation
    box["target"] = Target(workers=2, generation=2, join=("j-worker-3",))
    joiner = ControlledGenerations(
        me="j-worker-3", leader=pods[0], store=_connect(host), min_workers=3,
        steps=100, choose=lambda n: (_layout(n), None), target=lambda: box["target"],
        poll_s=0.01)

    def lead():
        step = 8
        while (following := leader.following(alone, step)) is None:
            step += 1
            time.sleep(0.01)
        return following, step

    out = in_threads({"j-worker-3": partial(joiner.start, "j-worker-3"), pods[0]: lead})
    grown, step = out[pods[0]]
    assert out["j-worker-3"] == (grown, alone)
    assert grown.members == (pods[0], "j-worker-3") and joiner.recoveries == leader.recoveries == 3
    out = in_threads({me: partial(src.following, grown, step + 1)
                      for me, src in ((pods[0], leader), ("j-worker-3", joiner))})
    assert out == {pods[0]: None, "j-worker-3": None}

    # Asked to stop (SIGTERM), the joiner departs at a boundary: the leader counts it lost,
    # and as one that left.
    joiner.depart("j-worker-3", step + 2)
    recovery = leader.recover(pods[0], grown, step + 2, boom)
    assert recovery.lost == recovery.left == ("j-worker-3",)
    assert recovery.generation.members == (pods[0],) and recovery.world == "recovery4"
    for source in sources.values():
        source.stop_beating()
    time.sleep(0.1)  # the beats stop before the store does


@pytest.mark.parametrize("late", [False, True], ids=["together", "one-late"])
def test_a_lost_leader_is_lost_like_any_member_and_a_survivor_leads(tmp_path, late):
    """The leader dies (its heartbeat falls silent here; a killed one's connection ends):
    members waiting at a step boundary for its word take the fault path, the first survivor
    to see it lost takes the lead from the state the leader kept in the store, and the
    survivors go on in a generation it leads, from the newest checkpoint. A survivor slower
    to see the silence (``late``) learns of the fault from the new leader's word instead."""
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "step-00000004" / "tidal.json").write_text("{}")
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30), use_libuv=True)
    pods = ("j-worker-0", "j-worker-1", "j-worker-2")
    box: dict = {"target": Target(workers=3, generation=0, join=pods)}
    led: list = []
    sources = _fault_sources(host, pods, box, tmp_path, min_workers=2, leader_wait_s=0.1)
    for me, source in sources.items():
        source.on_lead = partial(led.append, me)
    _in_threads({me: partial(sources[me].start, me) for me in pods})
    gen = sources[pods[0]].current
    assert gen.members == pods
    if late:
        sources[pods[2]].lost_after_s = 5.0
    sources[pods[0]].stop_beating()  # the leader is gone: no word at the boundary of step 6

    def survive(me):
        # A survivor learns of the fault from the leader's silence, or, once the first to see
        # it lost has taken the lead and the fault path, from that one's word at the boundary
        # (a race between two that see it together): both come no sooner than the silence.
        started = time.monotonic()
        word = "at step 6: RuntimeError" if late and me == pods[2] else (
            "the leader j-worker-0 is lost|at step 6: RuntimeError")
        with pytest.raises(LeaderRecovering, match=word):
            sources[me].following(gen, 6)
        assert time.monotonic() - started >= 0.5  # lost_after_s: not before its silence
        return sources[me].recover(me, gen, 6, RuntimeError("the leader's step failed"))

    out = _in_threads({me: partial(survive, me) for me in pods[1:]})
    assert len(led) == 1, led  # one survivor took the lead
    (new,) = led
    assert new == pods[1] or not late
    recovery = out[pods[1]]
    assert out[pods[2]] == recovery
    assert recovery.generation == Generation(
        index=0, at_step=4, members=(new, *(p for p in pods[1:] if p != new)))
    assert recovery.lost == (pods[0],) and recovery.checkpoint == str(tmp_path / "step-00000004")
    assert all(sources[me].leader == new for me in pods[1:])
    assert sources[new].lost == {pods[0]} and sources[new].applied == 0
    for source in sources.values():
        source.stop_beating()
    time.sleep(0.1)  # the beats stop before the store does


# ---- tidal agent, one process per pod ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_agents_grow_and_shrink_on_targets_bitwise_as_a_static_run(emulator, api, tmp_path):
    from tidal_api import ScaleTable

    steps = 80
    doc = job_doc(steps=steps)
    # A peer snapshot at every boundary, so at the shrink's: its leaver goes at once.
    doc["spec"]["checkpoint"] = {"snapshotEverySteps": 1}
    create(api, doc)
    pods = Pods(str(emulator.kubeconfig), tmp_path, report=tmp_path / "report.json")
    observer = Observer(api)
    # As the operator does: generation 0's target names the first pods, then they start.
    w0, w1, w2 = (f"tiny-worker-{i}" for i in range(3))
    set_status(api, {"target": {"workers": 2, "generation": 0, "join": [w0, w1],
                                 "release": [], "reason": "Initial"}})
    try:
        for index in (2, 1, 0):  # the joiner first: the target, not the order, makes generation 0
            pods.start(index)
        observer.until(lambda s: s.get("members") == [w0, w1], 120, "generation 0")
        observer.until(lambda s: s.get("step", 0) >= 5, 60, "step 5")  # a few steps each
        set_status(api, {"target": {"workers": 3, "generation": 1, "join": [w2],
                                     "reason": "IdleGPUs"}})
        grown = observer.until(lambda s: s.get("generation") == 1, 120, "generation 1")
        observer.until(lambda s: s.get("step", 0) >= grown["step"] + 5, 60, "5 more steps")
        # A merge patch that leaves the last target's join in place: a desired state, harmless.
        set_status(api, {"target": {"workers": 2, "generation": 2, "release": [w1],
                                     "reason": "PendingGPUPods"}})
        observer.until(lambda s: s.get("generation") == 2, 60, "generation 2")
        assert pods.wait(w1, 60) == 0, pods.log(w1)
        finish(pods, observer, (w0, w2), steps)
    finally:
        observer.stop()
        pods.stop()
    assert "released at step" in pods.log(w1)
    # The leader announces a scale-up for the next boundary (its world is built while a step
    # trains) and a scale-down for the boundary it is announced at: a step sooner.
    announced = {int(g): (int(at), int(start)) for at, g, start in re.findall(
        r"step (\d+): generation (\d+) \(.*\) in .* from step (\d+)", pods.log(w0))}
    assert {g: start - at for g, (at, start) in announced.items()} == {1: 1, 2: 0}, announced

    # The status followed the generations, with the planner's layouts.
    applied = []
    for status in observer.seen:
        published = "members" in status  # the CRD defaults generation to 0 before that
        if published and (not applied or applied[-1][0] != status["generation"]):
            applied.append((status["generation"], status["members"], status["layout"]["pp"]))
    assert applied == [(0, [w0, w1], 2), (1, [w0, w1, w2], 3), (2, [w0, w2], 2)]
    progress = [s["step"] for s in observer.seen if "step" in s]
    assert progress == sorted(progress) and len(set(progress)) >= 4 and progress[-1] == steps
    final = observer.seen[-1]
    report = json.loads((tmp_path / "report.json").read_text())
    assert final["loss"] == report["steps"][-1]["loss"]
    # The pods had no GPU (this machine has none): the CPU, gloo, the threads fixed, inductor
    # deterministic.
    assert (report["device"], report["backend"], report["transport"]) == ("cpu", "gloo", "gloo")
    assert report["determinism"] == {"threads": 1, "torch._inductor.config.deterministic": True,
                                   "torch._inductor.config.fallback_random": True}
    assert final["tokensPerSecond"] > 0 and final["stepSeconds"] > 0
    assert final["predictedStepSeconds"] > 0 and final["lastSwitchSeconds"] > 0
    table = ScaleTable.model_validate(final["scaleTable"])
    # Which counts are worth running depends on the measured step times (a busy core drops one
    # that measured slower than fewer workers): every count is one or the other.
    assert sorted([r.workers for r in table.rows] + [d.workers for d in table.dropped]) == [2, 3, 4]
    # The table and the prediction come from the running job's own profile (issue 26): each
    # generation long enough profiles its first steps, the leader plans again from it.
    assert {r.predictor for r in table.rows} == {"profiled"}
    # Every profile, in order (the accuracy leaves out one with no step measured after it).
    profiled = report["profiles"]
    assert profiled and profiled[-1]["layout"]["pp"] == 2
    assert final["predictedStepSeconds"] == profiled[-1]["predicted_s"]
    assert final["target"]["generation"] == 2  # the operator's field, left alone

    # Every step ran once, in the generation's layout; the bits are a static run's.
    pps = [s["layout"]["pp"] for s in report["steps"]]
    assert [s["step"] for s in report["steps"]] == list(range(steps))
    switches = [c["at_step"] for c in report["reconfigurations"]]
    assert len(switches) == 2 and 5 <= switches[0] < switches[0] + 5 <= switches[1] < steps
    # w1's peer snapshot is with its keeper w2, which stays: w1 left at the boundary.
    assert [c["released_at_once"] for c in report["reconfigurations"]] == [False, True]
    assert pps == [2] * switches[0] + [3] * (switches[1] - switches[0]) + [2] * (steps - switches[1])
    assert_bits_of_a_static_run(report, doc, steps)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_agents_replan_around_a_straggler_bitwise_as_a_static_run(emulator, api, tmp_path):
    """tiny-worker-2 made 20x slower from step 4 to 13 (the agent's test hook): the leader flags
    it (status, an Event) and, a pipeline without it being predicted faster, asks the operator
    to release it (status.stragglers[].release; no operator runs here). Meanwhile it
    re-partitions the same members under the operator's generation 0 (a revision the operator
    does not number), and back once the worker recovers, with the bits of a static run."""
    steps = 28
    doc = job_doc(steps=steps)
    doc["spec"]["workers"]["min"] = 3
    doc["spec"]["stragglers"] = {"steps": 3, "factor": 2.0, "replan": True, "minGain": 0.05}
    create(api, doc)
    pods = Pods(str(emulator.kubeconfig), tmp_path, report=tmp_path / "report.json")
    observer = Observer(api)
    w0, w1, w2 = (f"tiny-worker-{i}" for i in range(3))
    try:
        pods.start(2, "--slowdown", "4:14:20.0")
        pods.start(1)
        pods.start(0)
        flagged = observer.until(lambda s: s.get("stragglers"), 120, "the straggler in status")
        assert [(f["member"], f["release"]) for f in flagged["stragglers"]] == [(w2, True)]
        finish(pods, observer, (w0, w1, w2), steps)
    finally:
        observer.stop()
        pods.stop()
    assert observer.seen[-1]["stragglers"] == []
    assert {s.get("generation") for s in observer.seen if "members" in s} == {0}
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(f["member"], f["flagged"], f["release"]) for f in report["stragglers"]] == [
        (w2, True, True), (w2, False, False)]
    there, back = report["replans"]
    assert there["to"]["partition"][2] < there["from"]["partition"][2]
    assert back["to"]["partition"][2] > there["to"]["partition"][2]
    partitions = [s["layout"]["partition"] for s in observer.seen if "layout" in s]
    assert there["to"]["partition"] in partitions and partitions[-1] == back["to"]["partition"]
    assert [(c["at_step"], c["workers"]) for c in report["reconfigurations"]] == [
        (there["at_step"], [3, 3]), (back["at_step"], [3, 3])]
    events = {e.reason: e.message for e in api.list(Event, namespace=NAMESPACE)
              if e.involvedObject.name == "tiny"}
    assert "asking the operator to release it" in events["Straggler"]
    assert {"StragglerRecovered", "Replanned"} <= set(events)
    assert_bits_of_a_static_run(report, doc, steps)


def agent_run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``tidal agent ...`` as a process of this checkout (a fork, :func:`tests.commands.tidal`),
    run to its end."""
    return tidal_forked("tidal_agent.cli", args, env=env, timeout=120)


def _agent_env(pod="tiny-worker-0", **extra):
    env = checkout_env({k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")})
    return {**env, keys.ENV_JOB: "tiny", keys.ENV_NAMESPACE: NAMESPACE, keys.ENV_POD: pod,
            keys.ENV_RENDEZVOUS_HOST: "127.0.0.1", keys.ENV_RENDEZVOUS_PORT: str(free_port()),
            **extra}


def test_agent_refuses_what_it_cannot_run(emulator, api):
    doc = job_doc()
    doc["spec"]["gpusPerWorker"] = 2
    create(api, doc)
    run = ["agent", "--kubeconfig", str(emulator.kubeconfig)]
    result = agent_run(run, env=_agent_env())
    assert result.returncode == 1
    assert "spec.gpusPerWorker is 2: tidal agent runs one rank per pod" in result.stderr
    env = _agent_env()
    del env[keys.ENV_POD], env[keys.ENV_RENDEZVOUS_HOST]
    result = agent_run(run, env=env)
    assert result.returncode == 1
    assert "set TIDAL_POD, TIDAL_RENDEZVOUS_HOST" in result.stderr
    # NCCL where the pod was given no GPU (none, whatever this machine has).
    result = agent_run([*run, "--backend", "nccl"],
                       env={**_agent_env(), "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1
    assert result.stderr.strip() == ("Error: transport nccl needs a GPU: GPU 0 is not among "
                                     "the 0 this process may use (CUDA_VISIBLE_DEVICES='')"
                                     ), result.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("snapshots", "elastic"), [(False, "pp"), (True, "dp-pp")],
                         ids=["checkpoints", "peer-snapshots-dp"])
def test_agents_recover_from_lost_workers_bitwise_as_a_static_run(emulator, api, tmp_path,
                                                                  snapshots, elastic):
    """The fault path: a pod that does not drain and is deleted at the deadline, then a pod
    killed with no target at all. Each time the survivors go on without a restart, from the
    newest whole peer snapshot (every 2 steps here) or from the last checkpoint, and the
    run's losses and parameters are a static run's, bit for bit. With strict ``dp-pp`` the
    planner's layouts (issue 25) go (4,1) -> (1,3) -> (2,1): the first loss is a replica's.
    PP with peer snapshots: tests/integration/test_soak.py, 20 faults."""
    steps, every = 36, 4
    doc = job_doc(steps=steps)
    doc["spec"]["parallelism"]["elastic"] = elastic
    shapes = ([(1, 4), (1, 3), (1, 2)] if elastic == "pp" else [(4, 1), (1, 3), (2, 1)])
    doc["spec"]["checkpoint"] = {"path": str(tmp_path / "ckpt"), "everySteps": every,
                                 "peerSnapshots": snapshots, "snapshotEverySteps": 2}
    create(api, doc)
    # With peer snapshots, under NCCL's rules (nccl-model): the survivors' exchanges with the
    # lost pod fail, every world is aborted, and the rebuild's buckets post as NCCL runs them.
    backend = ("--backend", "nccl-model") if snapshots else ()
    pods = Pods(str(emulator.kubeconfig), tmp_path, report=tmp_path / "report.json",
                args=("--lost-after", "1", *backend))
    observer = Observer(api)
    w0, w1, w2, w3 = (f"tiny-worker-{i}" for i in range(4))
    set_status(api, {"target": {"workers": 4, "generation": 0, "join": [w0, w1, w2, w3],
                                 "release": [], "reason": "Initial"}})
    try:
        for index in range(4):
            pods.start(index)
        first = observer.until(lambda s: s.get("members") == [w0, w1, w2, w3], 120,
                               "generation 0")
        assert (first["layout"]["dp"], first["layout"]["pp"]) == shapes[0]
        observer.until(lambda s: s.get("step", 0) >= 6, 60, "step 6")
        # w3 hangs (it will not drain), is asked to leave, and is deleted at the deadline.
        pods.procs[w3].send_signal(signal.SIGSTOP)
        set_status(api, {"target": {"workers": 3, "generation": 1, "release": [w3],
                                     "reason": "PendingGPUPods"}})
        time.sleep(1.0)
        pods.procs[w3].kill()
        shrunk = observer.until(lambda s: s.get("members") == [w0, w1, w2], 120,
                                "the survivors of the drain deadline")
        assert shrunk["generation"] == 1  # the target's: the operator sees it applied
        observer.until(lambda s: s.get("step", 0) >= 14, 120, "step 14")
        # w1's node goes: no target names it.
        pods.procs[w1].kill()
        lost = observer.until(lambda s: s.get("members") == [w0, w2], 120, "the second recovery")
        assert lost["generation"] == 1
        finish(pods, observer, (w0, w2), steps)
    finally:
        observer.stop()
        pods.stop()

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["transport"] == ("nccl-model" if snapshots else "gloo")
    first, second = report["recoveries"]
    assert first["lost"] == [w3] and second["lost"] == [w1]
    for recovery, members, shape in ((first, [w0, w1, w2], shapes[1]),
                                     (second, [w0, w2], shapes[2])):
        assert recovery["members"] == members and recovery["generation"] == 1
        assert recovery["snapshot"] is snapshots
        if snapshots:
            # Only the steps since the newest snapshot whole at its keeper are lost: at most
            # twice the interval (2), where the lost pod died before its newest copy had
            # reached its keeper and the one before is the newest whole.
            assert recovery["checkpoint"] is None
            assert 0 <= recovery["failed_at"] - recovery["resumed_at"] <= 2 * 2
        else:
            # The newest checkpoint not past the failure: at most one interval lost.
            assert recovery["resumed_at"] % every == 0
            assert 0 <= recovery["failed_at"] - recovery["resumed_at"] <= every
            assert recovery["checkpoint"].endswith(f"step-{recovery['resumed_at']:08d}")
        assert (recovery["layout"]["dp"], recovery["layout"]["pp"]) == shape
    assert first["failed_at"] >= 6 and second["failed_at"] >= 14
    # Every step once in the final report (the replayed ones replace the lost ones), and the
    # bits of a run that never lost a worker.
    assert_bits_of_a_static_run(report, doc, steps)
    assert "lost at step" in pods.log(w0) and "lost at step" in pods.log(w2)
