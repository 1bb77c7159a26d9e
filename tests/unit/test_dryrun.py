"""The dry run: hand-checked times, deadlocks shown in a grid, malformed lists refused, shared
cores."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal_api.layout import Layout, ScheduleKind
from tidal_plan.actioncosts import Costs
from tidal_plan.dryrun import DeadlockError, Machine, Span, dry_run, plan_step
from tidal_plan.ir import Action, Kind, parse_actions
from tidal_plan.layout import build_layout
from tidal_plan.lowering import lower
from tidal_plan.schedules import compute_actions


def layout(
    pp: int, m: int, schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B, v: int = 1
) -> Layout:
    return Layout(
        pp=pp,
        partition=(1,) * (pp * v),
        micro_batch_size=1,
        num_micro_batches=m,
        schedule=schedule,
        virtual_stages=v,
    )


def lists(*ranks: str) -> dict[int, list[Action]]:
    return {rank: parse_actions(text) for rank, text in enumerate(ranks)}


def grid_row(grid: str, rank: int) -> list[str]:
    (row,) = [line for line in grid.splitlines() if line.startswith(f"rank {rank} ")]
    return row.split()[2:]


# --- times and memory, checked by hand ----------------------------------------------------------


def test_two_rank_one_f_one_b_matches_hand_computed_times() -> None:
    # rank 0: F0 [0,1] F1 [1,2]; sends arrive at 1.5 and 2.5.
    # rank 1: F0 [1.5,3.5] B0 [3.5,5.5] (grad arrives at 6) F1 [5.5,7.5] B1 [7.5,9.5] (arrives 10).
    # rank 0: B0 [6,8] B1 [10,12].
    lowered = lists(
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
    )
    costs = Costs(forward=(1.0, 2.0), comm=0.5, activation_bytes=(3.0, 5.0))
    result = dry_run(layout(2, 2), lowered, costs)
    assert not result.deadlock
    assert result.makespan == 12.0
    assert result.bubble_fraction == pytest.approx(1 - (6 + 8) / (2 * 12))
    assert result.peak_memory == (6.0, 5.0)
    assert result.timeline[1][0] == Span(0.0, 1.5, Action.parse("1RECV_F0"))  # waited 1.5
    assert result.timeline[0][-1] == Span(10.0, 12.0, Action.parse("0B1"))
    assert "[" not in result.grid
    assert result.raise_on_deadlock() is result


def test_one_rank_makespan_is_its_total_compute() -> None:
    lay = layout(1, 3, ScheduleKind.ZERO_BUBBLE)
    result = dry_run(lay, plan_step(lay), Costs(forward=2.0, input_grad=1.5, weight_grad=0.5))
    assert result.makespan == 3 * (2.0 + 1.5 + 0.5)
    assert result.bubble_fraction == 0.0
    assert result.peak_memory == (1.0,)


def test_weight_gradient_frees_the_activations_of_a_split_backward() -> None:
    lay = layout(1, 2, ScheduleKind.ZERO_BUBBLE)
    deferred = lists("0F0 0I0 0F1 0I1 0W0 0W1")
    assert dry_run(lay, deferred).peak_memory == (2.0,)
    assert dry_run(lay, lists("0F0 0I0 0W0 0F1 0I1 0W1")).peak_memory == (1.0,)


def test_colocated_stages_hand_over_without_messages() -> None:
    # Interleaved on one rank: stage 1 waits for stage 0 of the same micro-batch, locally.
    lay = layout(1, 1, ScheduleKind.INTERLEAVED, v=2)
    result = dry_run(lay, lists("0F0 1F0 1B0 0B0"), Costs(forward=(1.0, 2.0)))
    assert [span.end for span in result.timeline[0]] == [1.0, 3.0, 5.0, 7.0]


@settings(max_examples=40, deadline=None)
@given(
    pp=st.integers(1, 4),
    m=st.integers(1, 6),
    schedule=st.sampled_from([s for s in ScheduleKind if s is not ScheduleKind.INTERLEAVED]),
    times=st.lists(st.floats(0.1, 3.0), min_size=12, max_size=12),
    comm=st.floats(0.0, 1.0),
)
def test_timelines_respect_every_dependency(
    pp: int, m: int, schedule: ScheduleKind, times: list[float], comm: float
) -> None:
    lay = layout(pp, m, schedule)
    costs = Costs(
        forward=tuple(times[:pp]),
        input_grad=tuple(times[4 : 4 + pp]),
        weight_grad=tuple(times[8 : 8 + pp]),
        comm=comm,
    )
    result = dry_run(lay, plan_step(lay), costs)
    span = {s.action: s for rank in result.timeline for s in rank}

    def input_gradient(stage: int, mb: int) -> Span:
        return span.get(Action(stage, Kind.B, mb)) or span[Action(stage, Kind.I, mb)]

    for rank_spans in result.timeline:  # one action at a time, in list order
        assert all(a.end <= b.start + 1e-9 for a, b in zip(rank_spans, rank_spans[1:]))
    for stage in range(pp):
        for mb in range(m):
            forward = span[Action(stage, Kind.F, mb)]
            backward = input_gradient(stage, mb)
            assert backward.start >= forward.end
            if stage > 0:
                assert forward.start >= span[Action(stage - 1, Kind.F, mb)].end + comm - 1e-9
            if stage < pp - 1:
                assert backward.start >= input_gradient(stage + 1, mb).end + comm - 1e-9
    busiest = max(sum(costs.time(s.action) for s in rank) for rank in result.timeline)
    assert result.makespan >= busiest - 1e-9


# --- deadlocks ---------------------------------------------------------------------------------


def test_both_ranks_receiving_first_deadlock() -> None:
    lowered = lists(
        "0RECV_B0 0F0 0SEND_F0 0B0",
        "1RECV_F0 1F0 1B0 1SEND_B0",
    )
    result = dry_run(layout(2, 1), lowered)
    assert result.deadlock
    assert math.isinf(result.makespan)
    assert grid_row(result.grid, 0) == ["[0RECV_B0]", "0F0", "0SEND_F0", "0B0"]
    assert grid_row(result.grid, 1) == ["[1RECV_F0]", "1F0", "1B0", "1SEND_B0"]
    assert "* rank 0 is stuck on 0RECV_B0, waiting for 1SEND_B0 (rank 1 has not run it yet)" in (
        result.grid
    )
    with pytest.raises(DeadlockError, match=r"\[1RECV_F0\]"):
        result.raise_on_deadlock()


def test_deadlock_grid_shows_what_already_ran() -> None:
    # Rank 1 wants both forwards before any backward; rank 0 sends F1 only after B0's gradient.
    lowered = lists(
        "0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0B0 0RECV_B1 0B1",
        "1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
    )
    result = dry_run(layout(2, 2), lowered)
    assert result.deadlock
    assert grid_row(result.grid, 0)[:4] == ["0F0", "0SEND_F0", "[0RECV_B0]", "0F1"]
    assert grid_row(result.grid, 1)[:3] == ["1RECV_F0", "[1RECV_F1]", "1F0"]
    assert result.grid.splitlines()[1].split()[:4] == ["step", "0", "1", "2"]


def test_receive_without_send_is_a_deadlock() -> None:
    lowered = lists(
        "0F0 0SEND_F0 0RECV_B0 0B0",
        "1RECV_F0 1F0 1B0",  # forgot 1SEND_B0
    )
    result = dry_run(layout(2, 1), lowered)
    assert result.deadlock
    assert grid_row(result.grid, 0) == ["0F0", "0SEND_F0", "[0RECV_B0]", "0B0"]
    assert grid_row(result.grid, 1) == ["1RECV_F0", "1F0", "1B0"]  # rank 1 finished
    assert "waiting for 1SEND_B0 (on no rank's list)" in result.grid


def test_compute_out_of_order_on_one_rank_is_a_deadlock() -> None:
    lay = layout(1, 1, ScheduleKind.INTERLEAVED, v=2)
    result = dry_run(lay, lists("1F0 0F0 1B0 0B0"))
    assert result.deadlock
    assert "stuck on 1F0, waiting for 0F0 (rank 0 has not run it yet)" in result.grid


# --- malformed lists ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank0", "rank1", "message"),
    [
        ("0F0 0SEND_F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0", "0SEND_F0 appears twice"),
        ("0F0 0SEND_F0 0B0", "1F0 1B0", "0SEND_F0 is never received: add 1RECV_F0 on rank 1"),
        ("0F0 0B0 1F0", "1B0", "stage 1 runs on rank 1: move it there"),
        ("0F0 0SEND_B0 0B0", "1F0 1B0", "talks to stage -1, which does not exist"),
        ("0F0 0B0 0F3", "1F0 1B0", "micro-batch outside 0..0"),
    ],
)
def test_dry_run_refuses_malformed_lists(rank0: str, rank1: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dry_run(layout(2, 1), lists(rank0, rank1))


def test_dry_run_refuses_messages_between_stages_of_one_rank() -> None:
    lay = layout(1, 1, ScheduleKind.INTERLEAVED, v=2)
    with pytest.raises(ValueError, match="hands tensors between stages of one rank over locally"):
        dry_run(lay, lists("0F0 0SEND_F0 1RECV_F0 1F0 1B0 0B0"))


def test_dry_run_needs_every_rank() -> None:
    with pytest.raises(ValueError, match="needs exactly ranks 0..1"):
        dry_run(layout(2, 1), lists("0F0 0B0"))


# --- costs and plan_step -----------------------------------------------------------------------


def test_costs_must_be_non_negative_and_per_stage() -> None:
    with pytest.raises(ValueError, match="Costs.forward must be non-negative"):
        Costs(forward=-1.0)
    with pytest.raises(ValueError, match="Costs.comm"):
        Costs(comm=-0.1)
    lay = layout(2, 1)
    with pytest.raises(ValueError, match="Costs.input_grad has 3 entries but the layout has 2"):
        dry_run(lay, plan_step(lay), Costs(input_grad=(1.0, 1.0, 1.0)))


def test_costs_of_a_full_backward_is_input_plus_weight_gradient() -> None:
    costs = Costs(input_grad=(1.0, 2.0), weight_grad=(0.5, 0.25))
    assert costs.time(Action.parse("1B0")) == 2.25
    assert costs.time(Action.parse("1SEND_B0")) == 0.0


@pytest.mark.parametrize("schedule", list(ScheduleKind))
def test_plan_step_is_the_lowered_schedule(schedule: ScheduleKind) -> None:
    v = 2 if schedule is ScheduleKind.INTERLEAVED else 1
    lay = layout(2, 4, schedule, v)
    assert plan_step(lay) == lower(lay, compute_actions(lay))


# --- the dry run on shared cores ---------------------------------------------------------------


def _times(result):
    return [t for rank in result.timeline for span in rank for t in (span.start, span.end)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_a_machine_with_a_core_per_rank_changes_nothing(schedule):
    lay = build_layout(num_units=6, workers=3, micro_batch_size=1, num_micro_batches=5,
                       schedule=schedule)
    costs = Costs(forward=(1.0, 2.0, 1.5), input_grad=(2.0, 1.0, 2.5),
                  weight_grad=(0.5, 1.0, 0.2), comm=0.3)
    lowered = plan_step(lay)
    plain = dry_run(lay, lowered, costs)
    shared = dry_run(lay, lowered, costs, Machine(cores=3))
    assert [[s.action for s in rank] for rank in shared.timeline] == [
        [s.action for s in rank] for rank in plain.timeline]
    assert _times(shared) == pytest.approx(_times(plain))
    assert shared.peak_memory == plain.peak_memory


def test_one_core_does_all_the_work_one_piece_at_a_time():
    # r0: F0 [0,1] F1 [1,2]; r1: F0 [1,2] F1 [2,3] B0 [3,4] B1 [4,5]; r0: B0 [4,5] B1 [5,6].
    lay = build_layout(num_units=2, workers=2, micro_batch_size=1, num_micro_batches=2,
                       schedule="gpipe")
    costs = Costs(forward=1.0, input_grad=1.0, weight_grad=0.0)
    lowered = plan_step(lay)
    assert dry_run(lay, lowered, costs).makespan == pytest.approx(6.0)
    one = dry_run(lay, lowered, costs, Machine(cores=1))
    assert one.makespan == pytest.approx(8.0)  # never idle, never two at once
    # Both ranks compute during [1, 3] at half speed: r0's F1 and r1's F0 end at 3.
    (r0_f1,) = [s for s in one.timeline[0] if s.action == Action.parse("0F1")]
    (r1_f0,) = [s for s in one.timeline[1] if s.action == Action.parse("1F0")]
    assert (r0_f1.start, r0_f1.end) == pytest.approx((1.0, 3.0))
    assert (r1_f0.start, r1_f0.end) == pytest.approx((1.0, 3.0))
    two_replicas = dry_run(lay, lowered, costs, Machine(cores=2, replicas=2))
    assert two_replicas.makespan == pytest.approx(8.0)  # two pipelines on two cores


def test_a_receive_posted_after_its_send_waits_for_the_rendezvous():
    # Stage 1 is slower: r1 posts RECV_F1 at 3, after r0's SEND_F1 at 2; the data comes 0.5
    # after the posting. r1: F0 [1,3] F1 [3.5,5.5].
    lay = build_layout(num_units=2, workers=2, micro_batch_size=1, num_micro_batches=2,
                       schedule="gpipe")
    costs = Costs(forward=(1.0, 2.0), input_grad=1.0, weight_grad=0.0)
    lowered = plan_step(lay)
    result = dry_run(lay, lowered, costs, Machine(rendezvous=0.5))
    (f1,) = [s for s in result.timeline[1] if s.action == Action.parse("1F1")]
    assert (f1.start, f1.end) == pytest.approx((3.5, 5.5))
    # r0 waits for each gradient, posted before it is sent: no rendezvous there.
    plain = dry_run(lay, lowered, costs)
    assert result.makespan == pytest.approx(plain.makespan + 0.5)


def test_handling_messages_takes_cores_from_compute():
    lay = build_layout(num_units=4, workers=4, micro_batch_size=1, num_micro_batches=4)
    costs = Costs(forward=1.0, input_grad=1.0, weight_grad=0.0)
    lowered = plan_step(lay)
    roomy = dry_run(lay, lowered, costs, Machine(message_work=0.5)).makespan
    assert roomy == pytest.approx(dry_run(lay, lowered, costs).makespan)
    crowded = dry_run(lay, lowered, costs, Machine(cores=2)).makespan
    assert dry_run(lay, lowered, costs, Machine(cores=2, message_work=0.5)).makespan > crowded


def test_machine_errors():
    for bad in ({"cores": 0}, {"replicas": 0}, {"rendezvous": -1.0}, {"message_work": -1.0}):
        with pytest.raises(ValueError, match="cores must be positive"):
            Machine(**bad)
