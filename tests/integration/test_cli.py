"""The ``tidal`` command as a user runs it: real processes, real files."""

import json
import re

import pytest
import yaml

from tests.commands import ROOT, TINY, tidal, tidal_here
from tidal_agent.cli import load_job
from tidal_api import ScaleTable



def _write_job(tmp_path, mutate):
    doc = yaml.safe_load(TINY.read_text())
    mutate(doc)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _bad(doc_field):
    def mutate(doc):
        doc["spec"]["model"]["layerz"] = doc_field
    return mutate


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "20"], "no layout for 20 workers: pp=20 (dp=1) exceeds the model's 8 "
                              "placement units: use at most 8 workers"),
        (["--workers", "20", "--schedule", "1f1b"],
         "20 workers need 20 stages but the model has only 8 placement units"),
        (["--workers", "3", "--partition", "3,3,3"], "partition [3, 3, 3] covers 9 units"),
        (["--workers", "3", "--partition", "4,4,0"], "has an empty stage"),
        (["--workers", "2", "--partition", "a,b"], "expected units per stage"),
        (["--steps", "500"], "exceeds spec.training.steps (200)"),
        (["--device", "cpu", "--transport", "nccl"], "transport nccl computes on cuda, not cpu"),
        (["--device", "cuda", "--transport", "gloo"], "on cuda use transport nccl or host"),
    ],
)
def test_bad_flags_get_one_clear_line(args, message):
    result = tidal("run", TINY, *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_bad(3), "spec.model.layerz: unknown field"),
        (lambda d: d["spec"]["workers"].update(min=5, max=2), "must not exceed workers.max"),
        (lambda d: d["spec"]["training"].update(microBatchSize=3), "must divide"),
    ],
)
def test_bad_manifests_get_one_clear_line(tmp_path, mutate, message):
    result = tidal("run", _write_job(tmp_path, mutate))
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_missing_and_broken_files(tmp_path):
    missing = tidal("run", tmp_path / "none.yaml")
    assert missing.returncode != 0 and "No such file" in missing.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed\n")
    result = tidal("run", broken)
    assert "not valid YAML" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_run_writes_the_report(tmp_path):
    report = tmp_path / "out" / "report.json"
    result = tidal("run", TINY, "--workers", "2", "--steps", "3", "--schedule", "zb",
                   "--device", "cpu", "--transport", "gloo", "--report", report)
    assert result.returncode == 0, result.stderr
    assert "step     2  pp2  loss" in result.stderr
    data = json.loads(report.read_text())
    # Where the workers trained, as the leader said; strict on the CPU fixes the threads and
    # inductor's deterministic mode.
    assert (data["device"], data["backend"], data["transport"]) == ("cpu", "gloo", "gloo")
    assert data["determinism"] == {"threads": 1, "torch._inductor.config.deterministic": True,
                                   "torch._inductor.config.fallback_random": True}
    assert [s["step"] for s in data["steps"]] == [0, 1, 2]
    for step in data["steps"]:
        assert float.fromhex(step["loss_hex"]) == step["loss"]
        assert step["layout"]["pp"] == 2 and step["layout"]["schedule"] == "zb"
        assert step["seconds"] > 0
    assert len(data["params_sha256"]) == 64
    [gen] = data["layouts"]  # forced by --schedule, still predicted
    assert gen["layout"]["schedule"] == "zb" and gen["predictor"] == "modeled"
    assert gen["predicted_step_s"] > 0 and gen["measured_step_s"] > 0


@pytest.mark.slow
def test_run_uses_the_planners_layout(tmp_path):
    from tidal_plan.devices import DEVICES
    from tidal_plan.planner import LayoutPlanner

    report = tmp_path / "report.json"
    result = tidal("run", TINY, "--workers", "3", "--steps", "3", "--report", report)
    assert result.returncode == 0, result.stderr
    assert "planned (modeled" in result.stderr and "measured" in result.stderr
    # It says which device it planned for: cpu by default, where tidal plan's is h100.
    assert re.search(r"predicted [\d.]+ ms/step on device cpu\)", result.stderr), result.stderr
    [gen] = json.loads(report.read_text())["layouts"]
    job = load_job(TINY)
    expected, prediction = LayoutPlanner(job, DEVICES["cpu"]).layout(3)
    assert gen["layout"] == expected.to_dict()
    assert gen["predicted_step_s"] == prediction.step_seconds


@pytest.mark.slow
def test_run_writes_a_measured_device_that_plan_reads(tmp_path, monkeypatch):
    from tidal_agent import runner
    from tidal_plan.devices import DEVICES, load_device
    from tidal_plan.measured import measured_device
    from tidal_plan.modelshape import ModelShape
    from tidal_plan.planner import job_device

    monkeypatch.setattr(runner, "_add_sharing", lambda *args: None)  # not what this measures
    device, profile = tmp_path / "cpu.json", tmp_path / "profile.json"
    result = tidal_here("run", TINY, "--workers", "2", "--steps", "4", "--device", "cpu",
                        "--profile", profile, "--write-device", device)
    assert result.returncode == 0, result.stderr
    assert "(cpu-measured: mfu" in result.stderr
    job, cpu = load_job(TINY), DEVICES["cpu"]
    measured = load_device(device)
    # The efficiency its profile implies, not the built-in guess.
    assert measured == measured_device(json.loads(profile.read_text()),
                                       ModelShape.of(job.spec.model), job_device(job.spec, cpu))
    assert measured.name == "cpu-measured" and measured.mfu != cpu.mfu
    assert measured.memory_overhead_bytes == 0.0  # a CPU has no allocator's peak to compare
    planned = tidal_here("plan", TINY, "--device", device, "--json")
    builtin = tidal_here("plan", TINY, "--device", "cpu", "--json")
    assert planned.returncode == builtin.returncode == 0, planned.stderr + builtin.stderr
    table = ScaleTable.model_validate_json(planned.stdout)
    assert table.device == "cpu-measured"
    guessed = ScaleTable.model_validate_json(builtin.stdout)
    assert [r.step_seconds for r in table.rows] != [r.step_seconds for r in guessed.rows]


def test_run_write_device_needs_a_profiled_run():
    result = tidal("run", TINY, "--steps", "2", "--write-device", "d.json")
    assert result.returncode != 0
    assert "profiling needs at least 3 steps" in result.stderr


def test_plan_prints_the_scale_table(tmp_path):
    out = tmp_path / "table.json"
    result = tidal("plan", TINY, "--device", "cpu", "--json", "--out", out)
    assert result.returncode == 0, result.stderr
    table = ScaleTable.model_validate_json(result.stdout)
    assert ScaleTable.model_validate_json(out.read_text()) == table
    assert (table.min_workers, table.max_workers, table.device) == (2, 4, "cpu")
    assert sorted([r.workers for r in table.rows] + [d.workers for d in table.dropped]) == [2, 3, 4]
    shown = tidal("plan", TINY, "--device", "cpu")
    assert shown.returncode == 0, shown.stderr
    assert "tiny: scale table (modeled predictor, device cpu)" in shown.stdout
    default = tidal("plan", TINY)  # not tidal run's default: it says which
    assert default.returncode == 0, default.stderr
    assert "tiny: scale table (modeled predictor, device h100)" in default.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([TINY, "--device", "tpu"], "unknown device 'tpu'"),
        ([], "give either JOB_FILE or --flextrain NAME"),
        ([TINY, "--flextrain", "small"], "give either JOB_FILE or --flextrain NAME"),
        ([TINY, "--profile", "missing.json"], "missing.json"),
        ([TINY, "--profile", TINY], f"{TINY} is not a profile: write one with tidal run "
                                    "--profile"),
        ([TINY, "--profile", ROOT / "examples" / "scale-tables" / "flextrain-small-pp.json"],
         "flextrain-small-pp.json: profile lacks 'units': write it with tidal run --profile"),
    ],
)
def test_plan_bad_input_gets_one_clear_line(args, message):
    result = tidal("plan", *args)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_profile_that_is_json_but_no_object_gets_one_clear_line(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]\n")
    result = tidal("plan", TINY, "--profile", listed)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"Error: {listed} is not a profile: write one with tidal " \
                                    "run --profile"


def test_data_synth_into_a_missing_directory_gets_one_clear_line(tmp_path):
    out = tmp_path / "missing" / "tokens.bin"
    result = tidal("data", "synth", out, "--tokens", "100")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"Error: {out}: the directory {out.parent} does not exist"
    made = tidal("data", "synth", tmp_path / "tokens.bin", "--tokens", "100")
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "tokens.bin").stat().st_size == 200


@pytest.mark.slow
def test_token_file_job_is_bitwise_across_layouts(tmp_path):
    tokens = tmp_path / "tokens.bin"
    made = tidal("data", "synth", tokens, "--tokens", "50000", "--vocab", "256")
    assert made.returncode == 0, made.stderr
    assert tokens.stat().st_size == 2 * 50000

    def mutate(doc):
        doc["spec"]["training"]["data"] = {"kind": "tokens", "path": str(tokens)}
    job = _write_job(tmp_path, mutate)
    reports = []
    for workers, partition in ((1, None), (3, "1,4,3")):
        report = tmp_path / f"r{workers}.json"
        extra = ["--partition", partition] if partition else []
        result = tidal_here("run", job, "--workers", workers, "--steps", "4", "--report", report,
                            *extra)
        assert result.returncode == 0, result.stderr
        reports.append(json.loads(report.read_text()))
    one, three = reports
    assert [s["loss_hex"] for s in one["steps"]] == [s["loss_hex"] for s in three["steps"]]
    assert one["params_sha256"] == three["params_sha256"]
