"""A realistic size on this machine: the 0.5B example in bf16, static and switching live.

Runs ``examples/qwen2-0.5b.yaml`` (Qwen2-0.5B's config, random initial values) twice on this
machine's CPU workers: a static run on 2 workers, and a run that grows live from 2 to 3 workers
after ``--switch-at`` steps, each layout the planner's (modeling-based, the cpu device
description). Prints JSON: each run's float.hex losses and parameter digest and whether the two
are bitwise equal, the median step seconds per layout, the switch's pause and bytes, and each
worker's peak resident memory.

    python bench/large_model.py [--steps 4] [--switch-at 2] [--job examples/qwen2-0.5b.yaml]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / root) for root in ("api", "agent", "operator", "doubles")]

from tidal_agent.cli import load_job  # noqa: E402
from tidal_agent.model import global_parameters  # noqa: E402
from tidal_agent.runner import run_elastic  # noqa: E402
from tidal_plan.devices import load_device  # noqa: E402
from tidal_plan.elastic import elastic_plan  # noqa: E402
from tidal_plan.planner import LayoutPlanner  # noqa: E402

GIB = 2**30


def _run(job, schedule, planner, steps):
    gens, layouts = elastic_plan(job, schedule, choose=lambda n, dp: planner.layout(n, dp)[0])
    print(f"run: {' -> '.join(lay.describe() for lay in layouts)}, {steps} steps",
          file=sys.stderr, flush=True)
    report = run_elastic(
        job, gens, layouts, steps=steps, timeout_s=1800,
        on_step=lambda r: print(f"  step {r['step']}: loss {r['loss']:.4f} "
                                f"({r['seconds']:.1f} s)", file=sys.stderr, flush=True),
    )
    boundaries = [0] + [c["at_step"] for c in report["reconfigurations"]] + [steps]
    per_layout = []
    for layout, (start, end) in zip(layouts, zip(boundaries, boundaries[1:]), strict=True):
        seconds = [s["seconds"] for s in report["steps"][start:end]]
        # the first step of a layout warms up (allocations, autocast's first casts)
        per_layout.append({"layout": layout.describe(), "steps": end - start,
                           "median_step_s": statistics.median(seconds[1:] or seconds)})
    return {
        "losses": [s["loss_hex"] for s in report["steps"]],
        "params_sha256": report["params_sha256"],
        "layouts": per_layout,
        "switches": [{k: c[k] for k in ("at_step", "pause_s", "bytes_moved", "bytes_min")}
                     for c in report["reconfigurations"]],
        "peak_rss_gib": {w: round(b / GIB, 2) for w, b in report["peak_rss_bytes"].items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(ROOT / "examples" / "qwen2-0.5b.yaml"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--switch-at", type=int, default=2)
    args = parser.parse_args()
    job = load_job(args.job)
    planner = LayoutPlanner(job, load_device("cpu"))
    params = sum(shape.numel() for _, shape, _ in global_parameters(job.spec.model))
    print(f"model: {params / 1e6:.0f}M parameters held (a tied embedding twice)",
          file=sys.stderr, flush=True)
    static = _run(job, [(0, 2)], planner, args.steps)
    live = _run(job, [(0, 2), (args.switch_at, 3)], planner, args.steps)
    print(json.dumps({
        "benchmark": "large_model",
        "job": job.metadata.name,
        "parameters_held": params,
        "precision": job.spec.training.precision,
        "tokens_per_step": job.spec.training.global_batch_size * job.spec.model.seq_len,
        "bitwise_equal": (static["losses"], static["params_sha256"])
        == (live["losses"], live["params_sha256"]),
        "static": static,
        "live": live,
    }, indent=2))


if __name__ == "__main__":
    main()
