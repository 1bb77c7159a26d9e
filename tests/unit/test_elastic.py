import pytest

from tidal_plan.elastic import ScheduleError, all_workers, generations, parse_worker_schedule


def test_generations_keep_survivors_in_order_and_append_joiners():
    gens = generations(parse_worker_schedule("0:2,4:3,8:4,12:2,14:3", steps=20, max_workers=8))
    assert [(g.at_step, g.members) for g in gens] == [
        (0, ("worker-0", "worker-1")),
        (4, ("worker-0", "worker-1", "worker-2")),
        (8, ("worker-0", "worker-1", "worker-2", "worker-3")),
        (12, ("worker-0", "worker-1")),
        (14, ("worker-0", "worker-1", "worker-4")),  # a fresh process, never a returning one
    ]
    assert all_workers(gens) == [f"worker-{i}" for i in range(5)]


def test_entries_that_change_nothing_are_merged():
    gens = generations([(0, 2), (3, 2), (5, 3)])
    assert [g.at_step for g in gens] == [0, 5]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2:2", "must start at step 0"),
        ("0:2,4", "expected STEP:WORKERS"),
        ("0:2,4:3,4:2", "must increase"),
        ("0:2,4:30", "use between 1 and 8 workers"),
        ("0:2,40:3", "past the run's 20 steps"),
    ],
)
def test_bad_schedules(text, message):
    with pytest.raises(ScheduleError, match=message):
        parse_worker_schedule(text, steps=20, max_workers=8)


# ---- generations from the operator's targets ----------------------------------------------------

from tidal_api import JobSpec, Target  # noqa: E402
from tidal_plan.elastic import Generation, TargetError, data_parallel_degree, next_generation  # noqa: E402

CURRENT = Generation(index=1, at_step=4, members=("w-0", "w-1", "w-2"))


def test_joiners_follow_the_survivors_in_target_order():
    target = Target(workers=5, generation=2, join=("w-9", "w-3"))
    assert next_generation(CURRENT, target, at_step=7) == Generation(
        index=2, at_step=7, members=("w-0", "w-1", "w-2", "w-9", "w-3"))


def test_any_member_but_the_leader_can_be_released():
    target = Target(workers=2, generation=3, release=("w-1",))
    assert next_generation(CURRENT, target, at_step=9).members == ("w-0", "w-2")
    target = Target(workers=1, generation=2, release=("w-2", "w-1"))
    assert next_generation(CURRENT, target, at_step=9).members == ("w-0",)


def test_a_target_that_names_no_pod_keeps_the_members():
    gen = next_generation(CURRENT, Target(workers=3, generation=2), at_step=5)
    assert gen.members == CURRENT.members and gen.index == 2


def test_a_target_is_a_desired_state_so_stale_entries_are_harmless():
    # The join of the previous target, left in place by a merge patch, next to a release.
    target = Target(workers=2, generation=2, join=("w-2",), release=("w-1", "w-7"))
    assert next_generation(CURRENT, target, at_step=5).members == ("w-0", "w-2")
    target = Target(workers=4, generation=2, join=("w-1", "w-5", "w-5"))
    assert next_generation(CURRENT, target, at_step=5).members == ("w-0", "w-1", "w-2", "w-5")


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (Target(workers=3, generation=1, join=("w-5",)), "not after the applied 1"),
        (Target(workers=3, generation=2, join=("w-5",), release=("w-1",)),
         r"adds \['w-5'\] and releases \['w-1'\] at once"),
        (Target(workers=3, generation=2, join=("w-5",), release=("w-5",)),
         r"both joins and releases \['w-5'\]"),
        (Target(workers=2, generation=2, release=("w-0",)), "releases the leader w-0"),
        (Target(workers=3, generation=2, release=("w-2",)), "asks for 3 workers but .* = 2"),
        (Target(workers=2, generation=2, release=("w-9",)), "asks for 2 workers but .* = 3"),
    ],
)
def test_targets_that_cannot_be_applied(target, message):
    with pytest.raises(TargetError, match=message):
        next_generation(CURRENT, target, at_step=5)


@pytest.mark.parametrize(
    ("parallelism", "dp"),
    [
        ({"elastic": "pp", "consistency": "strict"}, 1),
        ({"elastic": "pp", "consistency": "relaxed"}, 1),
        ({"elastic": "dp-pp", "consistency": "strict"}, None),  # the planner's pick
        ({"elastic": "dp-pp", "consistency": "relaxed"}, None),
    ],
)
def test_data_parallel_degree(parallelism, dp):
    spec = JobSpec.model_validate({"workers": {"min": 2, "max": 8},
                                   "model": {"layers": 6, "dModel": 64, "heads": 4},
                                   "parallelism": parallelism,
                                   "training": {"globalBatchSize": 16, "microBatchSize": 2}})
    assert data_parallel_degree(spec) == dp


from tidal_api.layout import Layout, LayoutError  # noqa: E402
from tidal_plan.elastic import replica_subtrees, subtrees  # noqa: E402


def test_a_block_of_logical_replicas_ends_as_its_aligned_subtrees():
    assert subtrees(0, 8) == [(3, 0)]
    assert subtrees(0, 5) == [(2, 0), (0, 4)]
    assert subtrees(5, 8) == [(0, 5), (1, 3)]
    assert subtrees(1, 7) == [(0, 1), (1, 1), (1, 2), (0, 6)]
    even = Layout(dp=2, pp=1, partition=(4,), micro_batch_size=1, num_micro_batches=8)
    assert replica_subtrees(even, 4) == [[(1, 0)], [(1, 1)]]
    uneven = Layout(dp=2, pp=1, partition=(4,), micro_batch_size=1, num_micro_batches=8,
                    shares=(12, 4))
    assert replica_subtrees(uneven, 8) == [[(2, 0), (1, 2)], [(1, 3)]]
    with pytest.raises(LayoutError, match="give each replica a multiple of 4"):
        replica_subtrees(Layout(dp=2, pp=1, partition=(4,), micro_batch_size=1,
                                num_micro_batches=8, shares=(10, 6)), 4)
