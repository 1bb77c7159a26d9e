"""A lost worker stops the job promptly, by name, and the job resumes with who is left."""

import multiprocessing as mp
import os
import re
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.jobs import NCCL_MODEL, small_job
from tidal_agent import checkpoint
from tidal_agent.runner import RunError, run_elastic, run_local, worker_processes
from tidal_agent.world import Rendezvous, build_world
from tidal_local.processes import free_port
from tidal_plan.elastic import elastic_plan
from tidal_plan.layout import resolve_layout

pytestmark = pytest.mark.slow
TIMEOUT_S = 20
SAVE_TIMEOUT_S = 5  # the savers' rendezvous: what a save in a store rendezvous would wait out


def _job(root):
    return small_job(
        "f", model={"layers": 4, "dModel": 32, "heads": 4, "vocab": 64, "seqLen": 16},
        training={"steps": 12, "globalBatchSize": 8, "microBatchSize": 2, "gradClip": 0.5},
        checkpoint={"path": str(root), "everySteps": 4},
    )


def _kill(name):
    def on_step(event):
        if event["step"] == 5:
            (victim,) = [p for p in mp.active_children() if p.name == f"tidal-{name}"]
            os.kill(victim.pid, signal.SIGKILL)
    return on_step


def test_lost_worker_stops_the_job_and_it_resumes_with_the_rest(tmp_path):
    """Under NCCL's rules (nccl-model) the survivors' pending exchanges fail too."""
    job = _job(tmp_path / "ckpt")
    started = time.monotonic()
    with pytest.raises(RunError, match=r"worker-1 exited with code -9"):
        run_local(job, resolve_layout(job, workers=3), steps=12, timeout_s=TIMEOUT_S,
                  on_step=_kill("worker-1"), devices=NCCL_MODEL)
    assert time.monotonic() - started < 60  # start-up plus a few steps, not a hang
    assert not [p for p in mp.active_children() if p.name.startswith("tidal-")]

    steps_done, latest = checkpoint.latest(tmp_path / "ckpt")
    assert steps_done == 4
    resumed = run_local(_job(tmp_path / "ckpt2"), resolve_layout(job, workers=2), steps=12,
                        timeout_s=TIMEOUT_S, resume_from=latest)
    static = run_local(_job(tmp_path / "ckpt3"), resolve_layout(job, workers=3), steps=12,
                       timeout_s=TIMEOUT_S)
    assert [s["loss_hex"] for s in resumed["steps"]] == [s["loss_hex"] for s in static["steps"][4:]]
    assert resumed["params_sha256"] == static["params_sha256"]


def test_lost_joiner_stops_a_switch(tmp_path):
    job = _job(tmp_path / "ckpt")
    gens, layouts = elastic_plan(job, [(0, 2), (8, 3)])
    with pytest.raises(RunError, match=r"worker-2 exited with code -9"):
        run_elastic(job, gens, layouts, steps=12, timeout_s=TIMEOUT_S, on_step=_kill("worker-2"))
    assert not [p for p in mp.active_children() if p.name.startswith("tidal-")]


def _saver(rank: int, port: int, root: str, errors) -> None:
    """One member of a two-member world that saves a checkpoint; member 1 is lost (exits)
    before the save."""
    import torch

    torch.set_num_threads(1)
    rendezvous = Rendezvous(host="127.0.0.1", port=port, prefix="save/",
                            timeout_s=SAVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0,
                          timeout=timedelta(seconds=SAVE_TIMEOUT_S), use_libuv=True)
    world = build_world(rendezvous, 0, ("a", "b"), "ab"[rank], store=store)
    if rank == 1:
        os._exit(0)  # lost just before the save: stopped, then killed
    started = time.monotonic()
    try:
        checkpoint.save_state({"w": torch.zeros(4)}, world, root, 4, "test", ["w"], 1)
    except Exception as err:  # noqa: BLE001 - what the survivor's fault path would see
        errors.put((type(err).__name__, str(err)[:200], time.monotonic() - started))
    else:
        errors.put(None)


def test_a_member_lost_before_a_save_fails_the_survivor_by_a_closed_connection(tmp_path):
    """A checkpoint's ranks agree through their world, connected as it was built, so a member
    lost before a save fails the survivor's save at once, by a closed connection, and the fault
    path starts: no process group is joined at the save, whose store rendezvous would wait
    for the lost member until the timeout (the hang behind test_drain_deadline's rare
    timeout, when checkpoints joined a default group there)."""
    ctx = worker_processes()
    errors = ctx.Queue()
    port = free_port()
    members = [ctx.Process(target=_saver, args=(rank, port, str(tmp_path), errors))
               for rank in range(2)]
    for member in members:
        member.start()
    try:
        kind, message, _ = errors.get(timeout=3 * TIMEOUT_S)
    finally:
        for member in members:
            member.join(10)
            if member.is_alive():
                member.kill()
    # a closed connection, not the store's timeout (DistStoreError)
    assert kind == "RuntimeError" and re.search(r"Connection (closed|reset) by peer",
                                                message), message
