"""Online profiling measures every unit during real steps and changes no bit of the run."""

import json

import pytest

from tests.commands import TINY, tidal_here
from tidal_agent.sharing import sharing_copies
from tidal_plan.profiled import load_profile

pytestmark = pytest.mark.slow


def test_profile_covers_every_unit_and_keeps_the_bits(tmp_path):
    plain, profiled = tmp_path / "plain.json", tmp_path / "profiled.json"
    profile = tmp_path / "profile.json"
    for report, extra in ((plain, []), (profiled, ["--profile", profile])):
        result = tidal_here("run", TINY, "--workers", "3", "--steps", "5", "--report", report, *extra)
        assert result.returncode == 0, result.stderr
    a, b = json.loads(plain.read_text()), json.loads(profiled.read_text())
    assert [s["loss_hex"] for s in a["steps"]] == [s["loss_hex"] for s in b["steps"]]
    assert a["params_sha256"] == b["params_sha256"]

    data = json.loads(profile.read_text())
    assert b["profile"] == str(profile)
    assert data["profiled_steps"] == [1, 2, 3, 4]  # a 5-step run: 1 to the last
    assert sorted(map(int, data["units"])) == list(range(8))  # 6 blocks + embedding + head
    for unit, costs in data["units"].items():
        assert costs["forward_s"] > 0 and costs["input_grad_s"] >= 0
        assert costs["param_bytes"] > 0 and costs["activation_bytes"] > 0
        if costs["rank"] > 0:  # stages with an input measure W apart from I
            assert costs["weight_grad_s"] > 0
    assert data["p2p"]["bytes"] == 2 * 64 * 64 * 4 and data["p2p"]["seconds"] > 0
    assert set(data["ranks"]) == {"0", "1", "2"}
    assert all(r["relative_speed"] > 0 for r in data["ranks"].values())
    assert all(r["peak_gpu_bytes"] is None for r in data["ranks"].values())  # CPU: none
    # What predicts other layouts: calibrated units, action overheads, the plain steps.
    calibration = data["calibration"]
    assert calibration["sizes"] == [2, 4] and calibration["world_size"] == 3
    assert sorted(map(int, calibration["units"])) == list(range(8))
    for costs in calibration["units"].values():
        assert set(costs) == {"forward", "backward", "input_grad", "weight_grad", "post"}
    assert all(v >= 0 for v in calibration["action_overhead_s"].values())
    assert {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"} <= data["actions_s"].keys()
    assert data["collectives_s"] > 0
    assert set(data["step_parts"]) == {"0", "1", "2"}
    # The sharing probe runs copies of a run that leaves cores to share; 3 ranks on 2 do not.
    copies = sharing_copies(3)
    assert data.get("sharing", {}).get("copies", 0) == copies
    assert ("timing shared cores" in result.stderr) == bool(copies)
    loaded = load_profile(profile)
    assert loaded.calibration is not None and loaded.sharing >= 1.0
