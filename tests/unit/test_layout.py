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
