import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidal_api.layout import Layout, LayoutError, ScheduleKind
from tidal_plan.layout import build_layout, even_partition


@given(units=st.integers(1, 40), data=st.data())
def test_even_partition_is_contiguous_and_balanced(units, data):
    stages = data.draw(st.integers(1, units))
    parts = even_partition(units, stages)
    assert sum(parts) == units and len(parts) == stages
    assert max(parts) - min(parts) <= 1


def test_stage_units_and_ranks():
    layout = Layout(pp=2, partition=(1, 2, 3, 2), micro_batch_size=1, num_micro_batches=4,
                    schedule=ScheduleKind.INTERLEAVED, virtual_stages=2)
    assert [list(layout.stage_units(s)) for s in range(4)] == [[0], [1, 2], [3, 4, 5], [6, 7]]
    assert layout.rank_stages(0) == (0, 2) and layout.rank_stages(1) == (1, 3)
    assert layout.unit_stage(5) == 2
    assert layout.describe() == "dp1 pp2 [1,2,3,2] interleaved v2 1x4"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"workers": 9}, "9 workers need 9 stages but the model has only 8 placement units"),
        ({"workers": 3, "partition": (3, 3, 3)}, "covers 9 units; the model has 8"),
        ({"workers": 3, "partition": (4, 4, 0)}, "has an empty stage"),
        ({"workers": 2, "partition": (4, 2, 2)}, "has 3 stages"),
        ({"workers": 3, "schedule": "interleaved"}, "use at most 2 workers"),
    ],
)
def test_impossible_layouts_say_how_to_fix(kwargs, message):
    base = {"num_units": 8, "micro_batch_size": 1, "num_micro_batches": 4}
    if kwargs.get("schedule") == "interleaved":
        base["num_units"] = 5
    with pytest.raises(LayoutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_layout(**base, virtual_stages=2, **kwargs)


def test_uneven_shares_place_each_replicas_micro_batches():
    layout = Layout(dp=3, pp=1, partition=(4,), micro_batch_size=2, num_micro_batches=4,
                    shares=(6, 2, 4))
    assert [layout.replica_micro_batches(r) for r in range(3)] == [6, 2, 4]
    assert [layout.replica_offset(r) for r in range(3)] == [0, 6, 8]
    assert layout.global_micro_batches == 12
    assert layout.replica_pipeline(1).num_micro_batches == 2
    assert layout.describe() == "dp3 pp1 [4] 1f1b 2x6/2/4"
    assert Layout(**layout.to_dict()) == layout
    even = Layout(dp=2, pp=1, partition=(4,), micro_batch_size=2, num_micro_batches=4,
                  shares=(4, 4))
    assert even.shares == () and "shares" not in even.to_dict()  # one way to write it
    assert even.replica_pipeline(1) is even and even.replica_offset(1) == 4
    for shares in (6, 2), (6, 3, 4), (12, 0, 0):
        with pytest.raises(LayoutError, match="sum to dp x numMicroBatches = 12"):
            Layout(dp=3, pp=1, partition=(4,), micro_batch_size=2, num_micro_batches=4,
                   shares=shares)
