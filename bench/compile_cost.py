"""What compiling the units costs: at start-up, and at a live switch.

One job (bench/hf_step.py's Hugging Face Llama, fp32 unless ``--precision`` says bf16) runs a
live pp 1 -> 2 -> 1 switch three times as worker processes (``run_elastic``): with
``training.compile: off``; ``on`` with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` a
fresh directory: what a new machine pays); and ``on`` again with the cache the cold run left
(what a restarted job pays). For each: the first step's seconds (start-up: everything compiles
there), the median of the other steps of the first generation (the steady step), each switch's
pause and the seconds of the first step after it (where anything new would compile: the
joiner compiles its units in standby, before it), the graphs the leader had compiled at each
step (``compiled_graphs``), and whether the two compiled runs have the same bits (they must).

Prints JSON; ``startup_ratio`` is the cold compiled run's first step over the eager one's,
``switch_ratio`` the compiled (warm) run's worst first-step-after-a-switch over the eager
run's, and ``graphs_at_switches`` the graphs the switches compiled on the leader (0: nothing
compiled again).

    python bench/compile_cost.py [--tiny] [--steps 9] [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [*(str(ROOT / root) for root in ("api", "agent", "operator", "doubles")),
                str(ROOT / "bench")]

from hf_step import CONFIG, SEQ_LEN, TINY, hf_job  # noqa: E402
from tidal_agent.runner import run_elastic  # noqa: E402
from tidal_plan.elastic import elastic_plan  # noqa: E402


def _run(config: dict, seq_len: int, precision: str, steps: int, compile_: str,
         cache: str) -> dict:
    job = hf_job(config, seq_len, precision, name=f"compile-{compile_}",
                 training={"steps": steps, "compile": compile_}, max_workers=2)
    third = steps // 3
    gens, layouts = elastic_plan(job, [(0, 1), (third, 2), (2 * third, 1)])
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the workers inherit it
    try:
        report = run_elastic(job, gens, layouts, steps=steps, timeout_s=1800)
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
    seconds = [s["seconds"] for s in report["steps"]]
    switches = [c["at_step"] for c in report["reconfigurations"]]
    graphs = [s["compiled_graphs"] for s in report["steps"]]
    return {
        "compile": compile_,
        "first_step_s": seconds[0],
        "steady_step_s": statistics.median(seconds[1:third]),
        "switches": [{"at_step": c["at_step"], "pause_s": c["pause_s"],
                      "first_step_s": seconds[c["at_step"]],
                      "graphs_before": graphs[c["at_step"] - 1],
                      "graphs_after": graphs[c["at_step"]]}
                     for c in report["reconfigurations"]],
        "at_steps": switches,
        "losses_hex": [s["loss_hex"] for s in report["steps"]],
        "params_sha256": report["params_sha256"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a toy model: checks the bench runs")
    parser.add_argument("--steps", type=int, default=9,
                        help="steps of each run, a multiple of 3 (a third per generation)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    if args.steps < 9 or args.steps % 3:
        raise SystemExit("--steps must be a multiple of 3, at least 9")
    config = {**CONFIG, **(TINY if args.tiny else {})}
    seq_len = SEQ_LEN["tiny" if args.tiny else "full"]
    with tempfile.TemporaryDirectory() as cache:
        runs = {}
        for name, compile_ in (("eager", "off"), ("cold", "on"), ("warm", "on")):
            print(f"compile_cost: {name}...", file=sys.stderr, flush=True)
            runs[name] = _run(config, seq_len, args.precision, args.steps, compile_, cache)
    eager, cold, warm = runs["eager"], runs["cold"], runs["warm"]

    def after_switch(run: dict) -> float:
        return max(s["first_step_s"] for s in run["switches"])

    report = {
        "benchmark": "compile_cost",
        "baseline": "the same job and switches with training.compile: off",
        "config": config, "seq_len": seq_len, "precision": args.precision, "steps": args.steps,
        "runs": {name: {k: v for k, v in run.items() if k not in ("losses_hex",)}
                 for name, run in runs.items()},
        "startup_ratio": cold["first_step_s"] / eager["first_step_s"],
        "startup_warm_ratio": warm["first_step_s"] / eager["first_step_s"],
        "steady_ratio": warm["steady_step_s"] / eager["steady_step_s"],
        "switch_ratio": after_switch(warm) / after_switch(eager),
        "graphs_at_switches": [s["graphs_after"] - s["graphs_before"]
                               for run in (cold, warm) for s in run["switches"]],
        "compiled_bits_equal": (cold["losses_hex"], cold["params_sha256"]) == (
            warm["losses_hex"], warm["params_sha256"]),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
