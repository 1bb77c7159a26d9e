"""The profiling-based predictor against measured step times, layout by layout.

The job is ``examples/tiny.yaml`` by default, whose step is much interpreter and wake-ups;
``--job bench/predictor-job.yaml`` takes its shape at width 128 and 128 tokens per sample,
whose actions are milliseconds of compute. Every round first takes the online profile: one
run of the job in a base layout (pp=2, 1F1B, the job's micro-batch size), the host's sharing
probe included; ``predict_profiled`` then prices every candidate layout (pp 1 to 4, GPipe,
1F1B, interleaved and zero-bubble schedules, uneven partitions, two micro-batch sizes) from
it, and each candidate is trained for real with ``run_local`` and its median step time taken
(warm-up steps dropped). A candidate's prediction is the median of the ``--rounds`` rounds'
predictions and its measured time the median over all its timed steps: the profile is a
measurement of this shared host too, and one taken at a fast or a slow moment of it would
misprice every layout alike. Candidates run in reverse order on odd rounds, so that slow
drift of the machine's load falls on all of them alike.

The predictor models a host whose cores are the job's alone; other processes on a shared host
slow the runs down (and the profile's run too) by as much as twice. So before every candidate
run the benchmark waits, up to ``--quiet-wait`` seconds (three times that before a profile),
for the other processes to leave the cores idle, and reports for each run how many cores they
kept busy meanwhile (``outside_cores``, from /proc/stat less this benchmark's own processes).

Prints a per-layout table on stderr and JSON on stdout: per candidate the predicted and
measured seconds (and per round) and the error |pred - meas| / meas; per round what its
profile measured (``profiles``); ``median_abs_error``, ``max_abs_error`` and ``choice_gap``:
per worker count, measured(lowest predicted) / measured(lowest measured) - 1, the worst over
worker counts.

``memory``: the modeling-based predictor's peak memory per pipeline rank (the ``cpu``
description; memory does not depend on its speeds) against what the trainer allocates, for
every candidate with and without activation checkpointing. Each is a run of ``MEMORY_STEPS``
steps (the last one with AdamW's moments) whose workers count their tensors' bytes
(``run_local(track_memory=True)``: ``tidal_agent.measure.TensorMemory``), apart from the
timed runs, as counting slows every operator. Per rank the signed error (pred - meas) / meas;
``median_abs_error``, ``max_abs_error`` and ``most_under`` (the most negative) over all ranks,
against the targets printed beside them (``MEMORY_TARGETS``). Zero-bubble with checkpointing
is measured but left out of them (``planned: false``): the planner does not pick it, as its
W recomputes each layer again (``tidal_plan.search.SPLIT_RECOMPUTE``). ``--memory-only`` runs this
part alone; ``--precision`` trains the job in fp32 or bf16 instead of its own precision.

    python bench/predictor.py [--job examples/tiny.yaml] [--steps 8] [--rounds 5]
                              [--quiet-wait 20] [--json FILE] [--profile-dir DIR]
                              [--memory-only] [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / root) for root in ("api", "agent", "operator", "doubles")]

import torch  # noqa: E402
import yaml  # noqa: E402

from tidal_agent.runner import run_local  # noqa: E402
from tidal_api import ElasticTrainingJob, parse_job  # noqa: E402
from tidal_api.layout import Layout  # noqa: E402
from tidal_plan.devices import load_device  # noqa: E402
from tidal_plan.layout import build_layout, even_partition  # noqa: E402
from tidal_plan.planner import LayoutPlanner  # noqa: E402
from tidal_plan.profiled import Profile, predict_profiled  # noqa: E402
from tidal_plan.search import SPLIT_RECOMPUTE  # noqa: E402

# (workers, schedule, micro-batch size as a multiple of the job's, partition, virtual stages)
CANDIDATES = [
    (1, "1f1b", 1, None, 1),
    (1, "1f1b", 2, None, 1),
    (2, "1f1b", 1, None, 1),
    (2, "gpipe", 1, None, 1),
    (2, "zb", 1, None, 1),
    (2, "1f1b", 1, "uneven", 1),
    (2, "1f1b", 2, None, 1),
    (2, "interleaved", 1, None, 2),
    (3, "1f1b", 1, None, 1),
    (3, "zb", 1, "uneven", 1),
    (4, "1f1b", 1, None, 1),
    (4, "gpipe", 2, None, 1),
]
TINY = [CANDIDATES[0], CANDIDATES[2], CANDIDATES[6]]
MEMORY_STEPS = 2  # the second has AdamW's moments: a step's peak from then on
# The modeled peak against the measured one, per rank: within 10%, and never more than 5% under.
MEMORY_TARGETS = {"max_abs_error": 0.10, "most_under": -0.05}


def _job(doc: dict, micro_batch_size: int) -> ElasticTrainingJob:
    doc = json.loads(json.dumps(doc))
    doc["spec"]["training"]["microBatchSize"] = micro_batch_size
    return parse_job(doc)


def _uneven(num_units: int, stages: int) -> tuple[int, ...]:
    """An even split with one unit moved from the last stage to the first."""
    parts = list(even_partition(num_units, stages))
    if parts[-1] < 2:
        raise SystemExit(f"no uneven partition of {num_units} units into {stages} stages")
    parts[0], parts[-1] = parts[0] + 1, parts[-1] - 1
    return tuple(parts)


def candidates(doc: dict, chosen: list[tuple]) -> list[tuple[Layout, ElasticTrainingJob]]:
    job = parse_job(doc)
    units, training = job.spec.model.num_units, job.spec.training
    out = []
    for workers, schedule, times, partition, virtual in chosen:
        mbs = training.micro_batch_size * times
        stages = workers * virtual
        layout = build_layout(
            num_units=units, workers=workers, schedule=schedule,
            micro_batch_size=mbs, num_micro_batches=training.global_batch_size // mbs,
            partition=_uneven(units, stages) if partition == "uneven" else None,
            virtual_stages=virtual,
        )
        out.append((layout, _job(doc, mbs)))
    return out


def measure(job: ElasticTrainingJob, layout: Layout, steps: int, warmup: int) -> list[float]:
    report = run_local(job, layout, steps=warmup + steps)
    return [s["seconds"] for s in report["steps"][warmup:]]


def _busy_cpu_s() -> float | None:
    """CPU seconds the host's cores have been busy since boot; None off Linux."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(x) for x in stat.readline().split()[1:]]
    except OSError:
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (the workers)."""
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def wait_until_quiet(limit_s: float, probe_s: float = 1.0, idle_cores: float = 0.1) -> None:
    """Wait, up to ``limit_s``, for a ``probe_s`` in which others keep < ``idle_cores`` busy."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        busy, own = _busy_cpu_s(), _own_cpu_s()
        if busy is None:
            return
        time.sleep(probe_s)
        if (_busy_cpu_s() - busy) - (_own_cpu_s() - own) < idle_cores * probe_s:
            return


def outside_load(run):
    """``run()``'s result and the mean number of cores other processes kept busy meanwhile."""
    busy, own, started = _busy_cpu_s(), _own_cpu_s(), time.monotonic()
    result = run()
    if busy is None:
        return result, None
    others = (_busy_cpu_s() - busy) - (_own_cpu_s() - own)
    return result, max(0.0, others) / (time.monotonic() - started)


def take_profile(job: ElasticTrainingJob, layout: Layout, quiet_wait: float):
    """The online profile of a run of ``layout`` (steps 3-7 of 9, then the sharing probe) and
    the cores other processes kept busy meanwhile."""
    wait_until_quiet(quiet_wait)  # a profile taken under load misprices all
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        _, load = outside_load(lambda: run_local(job, layout, steps=9, profile_out=path))
        return json.loads(path.read_text()), load


def memory_rows(runs: list[tuple[Layout, ElasticTrainingJob]]) -> list[dict]:
    """Per candidate, without and with activation checkpointing: the modeled peak bytes of
    each pipeline rank against the bytes its worker's tensors peaked at (the most of its
    data-parallel replicas)."""
    rows = []
    for layout, job in runs:
        for checkpointing in (False, True):
            lay = dataclasses.replace(layout, activation_checkpointing=checkpointing)
            predicted = LayoutPlanner(job, load_device("cpu")).predict(lay).peak_memory_bytes
            report = run_local(job, lay, steps=MEMORY_STEPS, track_memory=True)
            measured = [0] * lay.pp
            for worker, peak in report["peak_tensor_bytes"].items():
                rank = int(worker.rsplit("-", 1)[1]) % lay.pp
                measured[rank] = max(measured[rank], peak)
            errors = [(p - m) / m for p, m in zip(predicted, measured, strict=True)]
            split = checkpointing and lay.schedule.value == "zb"
            rows.append({"layout": lay.describe(), "checkpointing": checkpointing,
                         "predicted_bytes": list(predicted), "measured_bytes": measured,
                         "errors": errors, "planned": not split,
                         **({"not_planned": SPLIT_RECOMPUTE} if split else {})})
    return rows


def memory_report(rows: list[dict], precision: str) -> dict:
    errors = [e for row in rows if row["planned"] for e in row["errors"]]
    summary = {"median_abs_error": statistics.median(map(abs, errors)),
               "max_abs_error": max(map(abs, errors)), "most_under": min(errors)}
    print(f"\nmemory ({precision}): modeled peak against allocated, per rank "
          "(MB, pred/meas, error)", file=sys.stderr)
    for row in rows:
        ranks = "  ".join(f"{p / 1e6:.2f}/{m / 1e6:.2f} {e:+.1%}" for p, m, e in zip(
            row["predicted_bytes"], row["measured_bytes"], row["errors"], strict=True))
        note = "" if row["planned"] else "  (not planned: left out)"
        print(f"{row['layout']:40s} {ranks}{note}", file=sys.stderr)
    for key, value in summary.items():
        target = MEMORY_TARGETS.get(key)
        shown = f"{value:+.1%}" if key == "most_under" else f"{value:.1%}"
        print(f"{key}: {shown}" + (f" (target {target:+.0%})" if target else ""),
              file=sys.stderr)
    return {"precision": precision, "steps": MEMORY_STEPS, "device": "cpu",
            "targets": MEMORY_TARGETS, "layouts": rows, **summary}


def choice_gap(rows: list[dict]) -> float:
    gaps = []
    for workers in sorted({row["workers"] for row in rows}):
        group = [row for row in rows if row["workers"] == workers]
        chosen = min(group, key=lambda row: row["predicted_s"])
        best = min(group, key=lambda row: row["measured_s"])
        gaps.append(chosen["measured_s"] / best["measured_s"] - 1)
    return max(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(ROOT / "examples" / "tiny.yaml"))
    parser.add_argument("--steps", type=int, default=8, help="timed steps per candidate run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    parser.add_argument("--rounds", type=int, default=5, help="runs of every candidate")
    parser.add_argument("--quiet-wait", type=float, default=20.0,
                        help="seconds to wait before each run for other processes to go idle")
    parser.add_argument("--tiny", action="store_true", help="three layouts, few steps")
    parser.add_argument("--json", type=Path, help="also write the JSON report here")
    parser.add_argument("--profile-dir", type=Path,
                        help="keep the profiles it took here (round-1.json, ...)")
    parser.add_argument("--memory-only", action="store_true",
                        help="only the memory model's part: no profiles, no timed runs")
    parser.add_argument("--precision", choices=["fp32", "bf16"],
                        help="train the job in this precision (default: the job's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.tiny:
        args.steps, args.rounds, args.quiet_wait = min(args.steps, 3), 1, 0.0
    doc = yaml.safe_load(Path(args.job).read_text())
    if args.precision:
        doc["spec"]["training"]["precision"] = args.precision
    base_job = parse_job(doc)
    runs = candidates(doc, TINY if args.tiny else CANDIDATES)
    memory = memory_report(memory_rows(runs), base_job.spec.training.precision)
    if args.memory_only:
        emit({"benchmark": "predictor", "job": base_job.metadata.name, "memory": memory},
             args.json)
        return
    base = candidates(doc, [(2, "1f1b", 1, None, 1)])[0][0]
    seq_len = base_job.spec.model.seq_len

    profiles: list[dict] = []  # per round: what its profile measured
    predicted: list[list[float]] = [[] for _ in runs]  # per candidate, per round
    times: list[list[list[float]]] = [[] for _ in runs]  # per candidate, per round
    outside: list[list[float | None]] = [[] for _ in runs]
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}: profiling {base.describe()}...", file=sys.stderr, flush=True)
        profile_doc, load = take_profile(base_job, base, 3 * args.quiet_wait)
        profile = Profile.from_dict(profile_doc)
        profiles.append({
            "message_latency_s": profile.p2p_seconds,
            "rendezvous_s": profile.rendezvous_s,
            "message_work_s": profile.message_work_s,
            "in_run": profile.calibration.in_run if profile.calibration else None,
            "sharing": profile.sharing,
            "sharing_probe": profile_doc.get("sharing"),
            "outside_cores": load,
        })
        for (layout, _), rounds in zip(runs, predicted, strict=True):
            rounds.append(predict_profiled(profile, layout, seq_len).step_seconds)
        if args.profile_dir:
            args.profile_dir.mkdir(parents=True, exist_ok=True)
            (args.profile_dir / f"round-{round_ + 1}.json").write_text(
                json.dumps(profile_doc, indent=2) + "\n")
        order = list(range(len(runs)))[:: 1 if round_ % 2 == 0 else -1]
        for i in order:
            layout, job = runs[i]
            print(f"round {round_ + 1}: {layout.describe()}", file=sys.stderr, flush=True)
            wait_until_quiet(args.quiet_wait)
            measured, load = outside_load(
                lambda job=job, layout=layout: measure(job, layout, args.steps, args.warmup))
            times[i].append(measured)
            outside[i].append(load)

    rows = []
    for (layout, _), pred_rounds, measured, loads in zip(runs, predicted, times, outside,
                                                         strict=True):
        pred = statistics.median(pred_rounds)
        meas = statistics.median(t for run in measured for t in run)
        rows.append({
            "layout": layout.describe(),
            "workers": layout.world_size,
            "predicted_s": pred,
            "measured_s": meas,
            "predicted_rounds_s": pred_rounds,
            "measured_rounds_s": [statistics.median(run) for run in measured],
            "outside_cores": loads,
            "error": abs(pred - meas) / meas,
        })
    print(f"{'layout':36s} {'pred ms':>8s} {'meas ms':>8s} {'error':>7s}  outside cores",
          file=sys.stderr)
    for row in rows:
        loads = " ".join("-" if x is None else f"{x:.2f}" for x in row["outside_cores"])
        print(f"{row['layout']:36s} {row['predicted_s'] * 1e3:8.1f} "
              f"{row['measured_s'] * 1e3:8.1f} {row['error']:7.1%}  {loads}", file=sys.stderr)
    errors = [row["error"] for row in rows]
    report = {
        "benchmark": "predictor",
        "job": base_job.metadata.name,
        "profiled_layout": base.describe(),
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "profiles": profiles,
        "layouts": rows,
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "choice_gap": choice_gap(rows),
        "memory": memory,
    }
    emit(report, args.json)


def emit(report: dict, path: Path | None) -> None:
    """Print the JSON report, and write it to ``path`` too where given."""
    text = json.dumps(report, indent=2)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
