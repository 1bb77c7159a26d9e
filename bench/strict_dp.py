"""Strict data parallelism's cost: the logical replicas' fixed tree against the backend's
all-reduce, side by side.

The same job (the built-in GPT of bench/reshard.py's size, 49M parameters) runs at dp 2 and
dp 4 (pp 1) in strict mode (L = 8 logical replicas: each one's gradient taken apart, the
blocks gathered and added in a fixed tree) and in relaxed mode (one gloo all-reduce of the
gradients), alternating runs, the order reversed every other round. Prints JSON: per dp the
median step seconds of each (the first steps of a run are left out) and ``ratio``,
strict / relaxed (target: at most 1.10).

    python bench/strict_dp.py [--rounds 2] [--steps 8] [--dp 2,4] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / root) for root in ("api", "agent", "operator", "doubles")]

from tidal_agent.runner import run_local  # noqa: E402
from tidal_api import parse_job  # noqa: E402
from tidal_plan.elastic import logical_replicas  # noqa: E402
from tidal_plan.layout import build_layout  # noqa: E402

MODEL = {"layers": 13, "dModel": 512, "heads": 8, "vocab": 8192, "seqLen": 64}
TRAINING = {"steps": 1000, "globalBatchSize": 16, "microBatchSize": 2, "seed": 0}
WARMUP = 2


def _job(consistency: str):
    return parse_job({"apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob",
                      "metadata": {"name": f"strict-dp-{consistency}"},
                      "spec": {"workers": {"min": 1, "max": 8}, "model": MODEL,
                               "training": TRAINING,
                               "parallelism": {"elastic": "dp-pp",
                                               "consistency": consistency}}})


def _step_seconds(consistency: str, dp: int, steps: int) -> list[float]:
    job = _job(consistency)
    t = job.spec.training
    layout = build_layout(num_units=job.spec.model.num_units, workers=dp, dp=dp,
                          micro_batch_size=t.micro_batch_size,
                          num_micro_batches=t.num_micro_batches)
    report = run_local(job, layout, steps=steps, timeout_s=600)
    return [s["seconds"] for s in report["steps"][WARMUP:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dp", default="2,4")
    parser.add_argument("--tiny", action="store_true", help="a toy model: checks the bench runs")
    args = parser.parse_args()
    if args.tiny:
        MODEL.update(layers=2, dModel=32, vocab=64, seqLen=16)
    runs = []
    for dp in (int(d) for d in args.dp.split(",")):
        times: dict[str, list[float]] = {"strict": [], "relaxed": []}
        for round_ in range(args.rounds):
            order = ["strict", "relaxed"] if round_ % 2 == 0 else ["relaxed", "strict"]
            for mode in order:
                times[mode] += _step_seconds(mode, dp, args.steps + WARMUP)
                print(f"dp {dp} round {round_}: {mode} {statistics.median(times[mode]):.4f} s",
                      file=sys.stderr, flush=True)
        strict, relaxed = (statistics.median(times[m]) for m in ("strict", "relaxed"))
        runs.append({"dp": dp, "strict_median_s": strict, "relaxed_median_s": relaxed,
                     "ratio": strict / relaxed})
    print(json.dumps({
        "benchmark": "strict_dp",
        "baseline": "relaxed: the gloo all-reduce",
        "model": MODEL,
        "logical_replicas": logical_replicas(_job("strict").spec),
        "runs": runs,
        "ratio": max(r["ratio"] for r in runs),
    }, indent=2))


if __name__ == "__main__":
    main()
