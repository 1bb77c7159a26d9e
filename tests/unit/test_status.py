"""The status types as both sides write them: conditions, merge patches, whole bytes, layouts."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from tidal_api import Arrival, Condition, JobStatus, Layout, ScaleTable, Target
from tidal_api.status import set_condition, status_patch

ROOT = Path(__file__).resolve().parents[2]


def _ready(status: str, message: str, at: str) -> Condition:
    return Condition(type="Ready", status=status, reason="R", message=message,
                     last_transition_time=at, observed_generation=1)


def test_condition_transition_time_moves_only_with_its_status():
    first = set_condition((), _ready("False", "m1", "1970-01-01T00:01:40Z"))
    same = set_condition(first, _ready("False", "m2", "1970-01-01T00:03:20Z"))
    flipped = set_condition(same, _ready("True", "m3", "1970-01-01T00:05:00Z"))
    assert first[0].last_transition_time == same[0].last_transition_time == "1970-01-01T00:01:40Z"
    assert same[0].message == "m2"
    assert flipped[0].last_transition_time == "1970-01-01T00:05:00Z"
    assert len(flipped) == 1
    valid = Condition(type="Valid", status="True", reason="V", last_transition_time="t")
    both = set_condition(set_condition(flipped, valid), _ready("True", "m4", "later"))
    assert [(c.type, c.message, c.last_transition_time) for c in both] == [
        ("Ready", "m4", "1970-01-01T00:05:00Z"), ("Valid", "", "t")]


def test_a_status_patch_is_the_wire_form_of_the_fields_given():
    target = Target(workers=4, generation=2, reason="IdleGPUs", join=("j-worker-3",),
                    issued_at="2026-01-01T00:00:00Z")
    patch = status_patch(target=target, last_scale_time="2026-01-01T00:00:00Z",
                         rendezvous_missing_since=None,
                         arrivals=(Arrival(pod="ns/p", created_at="2026-01-01T00:00:00Z"),))
    assert patch == {
        "target": {"workers": 4, "generation": 2, "reason": "IdleGPUs", "join": ["j-worker-3"],
                   "release": [], "issuedAt": "2026-01-01T00:00:00Z", "deadline": None},
        "lastScaleTime": "2026-01-01T00:00:00Z",
        "rendezvousMissingSince": None,  # a merge patch's null deletes the field
        "arrivals": [{"pod": "ns/p", "createdAt": "2026-01-01T00:00:00Z", "gpus": 1}],
    }
    assert status_patch(target=None, members=()) == {"target": None, "members": []}
    with pytest.raises(ValueError, match="phase"):
        status_patch(phase="Sleeping")


def test_scale_table_bytes_are_whole_numbers_on_the_wire():
    text = (ROOT / "examples" / "scale-tables" / "flextrain-small-pp.json").read_text()
    table = ScaleTable.model_validate_json(text)
    row = table.rows[0].model_copy(update={"peak_memory_bytes": 4941824})
    assert json.loads(row.model_dump_json(by_alias=True))["peakMemoryBytes"] == 4941824
    assert '"peakMemoryBytes": 4941824,' in json.dumps(row.model_dump(mode="json", by_alias=True))
    fractional = ScaleTable.model_validate({**json.loads(text), "rows": [
        {**json.loads(table.rows[0].model_dump_json(by_alias=True)), "peakMemoryBytes": 4941823.2},
        *[json.loads(r.model_dump_json(by_alias=True)) for r in table.rows[1:]]]})
    assert fractional.rows[0].peak_memory_bytes == 4941824  # a peak rounds up
    assert all(isinstance(r.peak_memory_bytes, int) for r in table.rows)


def test_the_status_layout_is_the_planners_layout_on_the_wire():
    layout = Layout(dp=2, pp=2, partition=(2, 1, 1, 2), schedule="interleaved",
                    virtual_stages=2, micro_batch_size=1, num_micro_batches=8)
    wire = status_patch(layout=layout)
    assert wire == {"layout": {"dp": 2, "pp": 2, "partition": [2, 1, 1, 2],
                               "schedule": "interleaved", "virtualStages": 2,
                               "microBatchSize": 1, "numMicroBatches": 8,
                               "activationCheckpointing": False}}
    assert JobStatus.model_validate(wire).layout == layout
    table = ScaleTable.model_validate_json(
        (ROOT / "examples" / "scale-tables" / "flextrain-small-pp.json").read_text())
    assert all(isinstance(r.layout, Layout) for r in table.rows)
    # What Layout refuses, the wire refuses too, with its message.
    with pytest.raises(ValidationError, match="needs 4"):
        JobStatus.model_validate({"layout": {**wire["layout"], "partition": [3, 3]}})


def test_scale_table_columns_are_its_rows_and_not_on_the_wire():
    text = (ROOT / "examples" / "scale-tables" / "flextrain-small-pp.json").read_text()
    table = ScaleTable.model_validate_json(text)
    workers, tps, steps = table.columns
    assert workers == tuple(r.workers for r in table.rows)
    assert tps == tuple(r.tokens_per_second for r in table.rows)
    assert steps == tuple(r.step_seconds for r in table.rows)
    assert "columns" not in table.model_dump() and "_columns" not in table.model_dump_json()
    assert table == ScaleTable.model_validate_json(text)  # compared by fields only
    shorter = table.model_copy(update={"rows": table.rows[:2]})  # no validation: read afresh
    assert shorter.columns[0] == workers[:2]
    made = ScaleTable.model_construct(**{k: getattr(table, k) for k in ScaleTable.model_fields})
    assert made.columns == table.columns
