"""Re-planning around a straggler made by real contention, against the unchanged plan.

A GPT of 16 decoder layers (18 placement units) trains at pp=2, each worker pinned to a core
of its own (``os.sched_setaffinity``). At step ``--onset`` a CPU-bound process starts on
worker-1's core, pinned there too, so that worker-1 gets about half of its core: a straggler
made by contention, not by a sleep. The job runs twice with the same contention: with
``spec.stragglers.replan`` off (the unchanged plan) and on (the straggler watch flags worker-1
and the job re-partitions live). Then, with no contention, alternating runs with the watch on
and off price the monitoring.

Prints JSON:
- ``throughput_ratio``: the unchanged plan's median step seconds over the re-planned run's,
  over the same steps (from the re-planned run's switch + 1 to the end): throughput after
  re-planning over throughput of the unchanged plan (ideal 1.5 for a rank at half speed);
- ``onset_to_switch_steps``: from the first contended step to the step the new layout starts;
- ``monitoring``: ``ratio``, the median step seconds with the watch on over off (paired
  rounds), and ``boundary_fraction``, the watch's own seconds at a boundary over a step's.

    python bench/straggler.py [--steps 40] [--onset 8] [--rounds 3] [--tiny]

``--tiny`` (a toy model, for the test that the benchmark runs) may see no re-plan: then
``throughput_ratio`` is null and ``stragglers`` says what the watch saw.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / root) for root in ("api", "agent", "operator", "doubles")]

from tidal_agent.runner import run_local  # noqa: E402
from tidal_api import parse_job  # noqa: E402
from tidal_plan.layout import build_layout  # noqa: E402

MODEL = {"layers": 16, "dModel": 128, "heads": 4, "vocab": 512, "seqLen": 128}
TINY = {"dModel": 32, "vocab": 64, "seqLen": 32}
TRAINING = {"globalBatchSize": 32, "microBatchSize": 4, "lr": 1e-3, "warmupSteps": 0,
            "gradClip": 1.0, "seed": 0}
HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def _job(steps: int, replan: bool, model: dict):
    return parse_job({
        "apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob",
        "metadata": {"name": "straggler"},
        "spec": {"workers": {"min": 2, "max": 2}, "model": model,
                 "training": {**TRAINING, "steps": steps},
                 "stragglers": {"replan": replan}},
    })


def _layout():
    return build_layout(num_units=MODEL["layers"] + 2, workers=2,
                        micro_batch_size=TRAINING["microBatchSize"],
                        num_micro_batches=TRAINING["globalBatchSize"] // TRAINING["microBatchSize"])


def _contended(steps: int, onset: int, replan: bool, model: dict) -> dict:
    """A run whose worker-1 shares its core with a busy process from step ``onset`` on."""
    core = sorted(os.sched_getaffinity(0))[1]
    hog: list[subprocess.Popen] = []

    def on_step(event: dict) -> None:
        if event["step"] == onset - 1 and not hog:  # busy from step ``onset`` on
            hog.append(subprocess.Popen([sys.executable, "-c", HOG, str(core)]))
        print(f"  step {event['step']:3d}  pp{event['layout']['pp']} "
              f"{event['layout']['partition']}  {event['seconds'] * 1e3:7.1f} ms",
              file=sys.stderr, flush=True)

    try:
        return run_local(_job(steps, replan, model), _layout(), steps=steps, timeout_s=600,
                         pin_cores=True, on_step=on_step)
    finally:
        for proc in hog:
            proc.kill()
            proc.wait()


def _seconds(report: dict, first: int) -> list[float]:
    return [s["seconds"] for s in report["steps"] if s["step"] >= first]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--onset", type=int, default=8, help="the first contended step")
    parser.add_argument("--rounds", type=int, default=3, help="watch on/off pairs, no contention")
    parser.add_argument("--monitor-steps", type=int, default=12)
    parser.add_argument("--tiny", action="store_true", help="a toy model: checks the bench runs")
    args = parser.parse_args()
    model = {**MODEL, **TINY} if args.tiny else MODEL
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("this benchmark needs two cores: one per pipeline rank")

    print("unchanged plan, worker-1 contended:", file=sys.stderr, flush=True)
    unchanged = _contended(args.steps, args.onset, False, model)
    print("re-planned, worker-1 contended:", file=sys.stderr, flush=True)
    replanned = _contended(args.steps, args.onset, True, model)
    switch = replanned["reconfigurations"][0] if replanned["reconfigurations"] else None
    if switch is None:
        print(f"no re-plan: stragglers {replanned['stragglers']}", file=sys.stderr)
    after = switch["at_step"] + 1 if switch else args.steps
    before_s = statistics.median(_seconds(unchanged, after)) if switch else None
    after_s = statistics.median(_seconds(replanned, after)) if switch else None
    bits_equal = ([s["loss_hex"] for s in unchanged["steps"]]
                  == [s["loss_hex"] for s in replanned["steps"]]
                  and unchanged["params_sha256"] == replanned["params_sha256"])

    step_s: dict[bool, list[float]] = {True: [], False: []}
    watch_s: list[float] = []
    for round_ in range(args.rounds):
        for watching in ((True, False) if round_ % 2 == 0 else (False, True)):
            print(f"monitoring, round {round_ + 1}/{args.rounds}, watch "
                  f"{'on' if watching else 'off'}", file=sys.stderr, flush=True)
            report = run_local(_job(args.monitor_steps, False, model), _layout(),
                               steps=args.monitor_steps, timeout_s=600, pin_cores=True,
                               watch_stragglers=watching)
            rows = report["steps"][2:]
            step_s[watching] += [r["seconds"] + (r["watch_s"] or 0.0) for r in rows]
            if watching:
                watch_s += [r["watch_s"] for r in rows]
    on, off = statistics.median(step_s[True]), statistics.median(step_s[False])
    print(json.dumps({
        "benchmark": "straggler",
        "baseline": "the same run with stragglers.replan off (the unchanged plan)",
        "model": model, "training": TRAINING, "pp": 2, "units": MODEL["layers"] + 2,
        "onset_step": args.onset,
        "stragglers": replanned["stragglers"],
        "replans": [{k: r[k] for k in ("step", "at_step", "speeds", "gain")}
                    | {"from": r["from"]["partition"], "to": r["to"]["partition"]}
                    for r in replanned["replans"]],
        "unchanged_flags": unchanged["stragglers"],
        "onset_to_switch_steps": switch["at_step"] - args.onset if switch else None,
        "switch_pause_s": switch["pause_s"] if switch else None,
        "steps_compared": [after, args.steps - 1],
        "unchanged_step_s": before_s,
        "replanned_step_s": after_s,
        "throughput_ratio": before_s / after_s if switch else None,
        "bits_equal": bits_equal,
        "monitoring": {"step_s_on": on, "step_s_off": off, "ratio": on / off,
                       "watch_s": statistics.median(watch_s),
                       "boundary_fraction": statistics.median(watch_s) / on},
    }, indent=2))


if __name__ == "__main__":
    main()
