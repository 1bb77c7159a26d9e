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
