"""The transports keep NCCL's rules, and the nccl-model transport makes NCCL's deadlocks happen
on CPU: posted one by one, the 1F1B lists the runtime used to post stop there and are reported
as a deadlock within the timeout; posted as the runtime now plans them, they run with the bits
of gloo. Ranks are threads of this process, each with its own world (gloo groups over a store)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.jobs import small_job
from tidal_agent.trainer import Trainer
from tidal_agent.transport import TransportDeadlock, recv, send
from tidal_agent.world import Rendezvous, build_world
from tidal_plan.dryrun import plan_step
from tidal_plan.exchanges import exchange_plan
from tidal_plan.layout import resolve_layout

TIMEOUT_S = 3.0


def _in_worlds(size: int, transport: str, body, timeout_s: float = TIMEOUT_S) -> list:
    """Run ``body(world)`` on ``size`` ranks (threads) of one world; each rank's result or
    the exception it raised."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30), use_libuv=True)
    rendezvous = Rendezvous(host="127.0.0.1", port=store.port, prefix=f"t{time.monotonic_ns()}/",
                            timeout_s=timeout_s, transport=transport)
    members = tuple(f"w{i}" for i in range(size))
    results: list = [None] * size

    def rank(i: int) -> None:
        world = build_world(rendezvous, 0, members, members[i])
        try:
            results[i] = body(world)
        except Exception as err:  # noqa: BLE001 - the test looks at it
            results[i] = err
        finally:
            world.close(abort=isinstance(results[i], Exception))

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 30)
    assert not any(t.is_alive() for t in threads), "a rank hung past the transport's timeout"
    return results


def test_both_ends_sending_first_deadlocks_under_nccl_rules_not_in_one_group():
    def one_by_one(world):
        peer, mine, theirs = 1 - world.rank, torch.full((4,), float(world.rank)), torch.empty(4)
        world.exchange([send(mine, peer)]).wait()  # TiedGradients' old order
        world.exchange([recv(theirs, peer)]).wait()
        return theirs

    started = time.monotonic()
    results = _in_worlds(2, "nccl-model", one_by_one)
    assert all(isinstance(r, TransportDeadlock) for r in results), results
    assert "deadlock" in str(results[0])
    assert time.monotonic() - started < TIMEOUT_S + 10

    def grouped(world):
        peer, mine, theirs = 1 - world.rank, torch.full((4,), float(world.rank)), torch.empty(4)
        world.exchange([send(mine, peer), recv(theirs, peer)]).wait()
        return theirs

    for transport in ("gloo", "nccl-model", "host"):
        got = _in_worlds(2, transport, grouped)
        assert [r.tolist() for r in got] == [[1.0] * 4, [0.0] * 4], transport


def test_nccl_model_matches_in_order_and_refuses_ends_that_disagree():
    def mismatched(world):
        if world.rank == 0:
            world.exchange([send(torch.zeros(4), 1), send(torch.zeros(8), 1)]).wait()
        else:  # receives the two messages the other way round: NCCL would corrupt them
            world.exchange([recv(torch.empty(8), 0), recv(torch.empty(4), 0)]).wait()

    results = _in_worlds(2, "nccl-model", mismatched)
    assert any("disagree on the order" in str(r) for r in results), results


def test_a_tensor_on_another_device_never_reaches_a_group():
    def wrong_device(world):
        world.all_reduce(torch.zeros(1, device="meta"))

    (result,) = _in_worlds(1, "gloo", wrong_device)
    assert isinstance(result, ValueError) and "must be on cpu" in str(result)


@pytest.mark.parametrize("transport", ["gloo", "nccl-model", "host"])
def test_collectives_on_every_transport(transport):
    def collectives(world):
        x = torch.tensor([1.0 + world.rank, 10.0])
        world.all_reduce(x)
        gathered = torch.empty(4)
        world.all_gather_into(gathered, torch.tensor([float(world.rank), 5.0]))
        swapped = world.all_to_all(torch.tensor([10.0 * world.rank, 10.0 * world.rank + 1]))
        world.barrier()
        return x.tolist(), gathered.tolist(), swapped.tolist()

    got = _in_worlds(2, transport, collectives)
    assert got[0] == ([3.0, 20.0], [0.0, 5.0, 1.0, 5.0], [0.0, 10.0])
    assert got[1] == ([3.0, 20.0], [0.0, 5.0, 1.0, 5.0], [1.0, 11.0])


def _pipeline(grouped: bool, transport: str):
    """Two steps of a 2-rank 1F1B pipeline; with ``grouped=False`` its lowered lists posted one
    action at a time, in the lowering's order (the runtime's posting before NCCL's rules)."""
    job = small_job("t", model={"layers": 4, "dModel": 16, "heads": 2, "vocab": 32, "seqLen": 8},
                    training={"steps": 2, "globalBatchSize": 8, "microBatchSize": 2})
    layout = resolve_layout(job, workers=2, schedule="1f1b")

    def train(world):
        torch.set_num_threads(1)
        trainer = Trainer(spec=job.spec, layout=layout, world=world, device=world.device)
        if not grouped:
            trainer.plan = exchange_plan(plan_step(layout)[trainer.pp_rank], grouped=False)
        return [float.hex(trainer.step(s).loss) for s in range(2)]

    return _in_worlds(2, transport, train)


def test_one_by_one_1f1b_deadlocks_under_nccl_model_and_the_plan_does_not():
    started = time.monotonic()
    old = _pipeline(grouped=False, transport="nccl-model")
    assert any(isinstance(r, TransportDeadlock) for r in old), old
    assert time.monotonic() - started < TIMEOUT_S + 15  # reported within the timeout, no hang
    planned = _pipeline(grouped=True, transport="nccl-model")
    assert planned[0] == planned[1] == _pipeline(grouped=True, transport="gloo")[0]
    assert not isinstance(planned[0], Exception)
