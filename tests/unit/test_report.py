"""The report's history in the rendezvous store: a leader journals it, and the pod that takes
the lead from a lost leader reads it whole (tidal_agent.report)."""

from __future__ import annotations

import torch.distributed as dist

from tidal_agent.events import Recovered, Stepped, Straggler
from tidal_agent.report import AgentReport
from tidal_plan.elastic import Generation
from tidal_plan.layout import build_layout

TWO = build_layout(num_units=8, workers=2, micro_batch_size=2, num_micro_batches=8)
ONE = build_layout(num_units=8, workers=1, micro_batch_size=2, num_micro_batches=8)


def _stepped(worker: str, step: int) -> Stepped:
    loss = 4.0 - step / 8
    return Stepped(worker=worker, step=step, loss=loss, loss_hex=float.hex(loss), grad_norm=1.0,
                   lr=1e-3, seconds=0.5, snapshot_s=None, layout=TWO, speeds={})


def _leader(journal: dist.Store) -> AgentReport:
    report = AgentReport(None, tokens_per_step=64)
    report.lead(None, journal=journal)
    return report


def test_a_new_leader_takes_the_history_the_leaders_before_it_kept():
    journal = dist.HashStore()
    first = _leader(journal)
    first.applied(Generation(index=0, at_step=0, members=("w0", "w1")), TWO)
    for step in range(6):
        first.put(_stepped("w0", step))
    first.put(Straggler(worker="w0", member="w1", step=3, flagged=True, slowdown=2.0))

    # w0 is lost in step 6; w1 takes the lead, with w0's history, and resumes at step 4.
    second = _leader(journal)
    assert (second.steps, second.generations, second.stragglers) == (
        first.steps, first.generations, first.stragglers)
    assert second.link is None and second.journal is journal
    second.put(Recovered(worker="w1", failed_at=6, resumed_at=4, snapshot=True, checkpoint=None,
                         lost=("w0",), left=(), generation=0, members=("w1",), layout=ONE,
                         pause_s=0.2))
    assert [s["step"] for s in second.steps] == [0, 1, 2, 3]
    assert second.recoveries[0]["replayed_steps"] == 2
    for step in range(4, 9):
        second.put(_stepped("w1", step))

    # And the next leader after it: every step once, the replayed ones as replayed.
    third = _leader(journal)
    assert [s["step"] for s in third.steps] == list(range(9))
    assert third.steps == second.steps and third.recoveries == second.recoveries
    assert [(g["generation"], g["at_step"], g["members"]) for g in third.generations] == [
        (0, 0, ["w0", "w1"]), (0, 4, ["w1"])]
    assert third.stragglers == second.stragglers


def test_a_first_leader_starts_with_an_empty_history():
    report = _leader(dist.HashStore())
    assert (report.steps, report.generations, report.recoveries) == ([], [], [])
