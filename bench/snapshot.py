"""What peer snapshots cost a training step, side by side with the same run without them.

Peer snapshots (``spec.checkpoint.peerSnapshots``, tidal_agent/snapshot.py) copy each worker's
state at every step boundary and swap the copies around the ring of workers, so that a lost
worker costs only the step in flight. This runs the model of bench/reshard.py (about 50M
parameters with AdamW state) on 2 and 3 workers, with and without snapshots, in alternating
rounds, and compares the median seconds from one step's start to the next's (the step and,
with snapshots, the boundary's copy and swap): ``ratio`` is with / without. ``snapshot_s`` is
the median seconds of the copy and swap alone, and ``state_bytes`` the state a worker copies
(the largest stage's).

    python bench/snapshot.py [--rounds 2] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [*(str(ROOT / root) for root in ("api", "agent", "operator", "doubles")), str(ROOT / "bench")]

from reshard import _job  # noqa: E402  (the same model and job as the reshard benchmark)

from tidal_agent.runner import run_local  # noqa: E402
from tidal_agent.snapshot import state_index  # noqa: E402
from tidal_agent.switch import state_metadata  # noqa: E402
from tidal_plan.layout import resolve_layout  # noqa: E402
from tidal_plan.reshard import Placement  # noqa: E402


def _run(workers: int, steps: int, snapshots: bool) -> list[dict]:
    job = _job()
    report = run_local(job, resolve_layout(job, workers=workers), steps=steps, timeout_s=600,
                       peer_snapshots=snapshots)
    return report["steps"]


def _state_bytes(workers: int) -> int:
    job = _job()
    layout = resolve_layout(job, workers=workers)
    placement = Placement(layout=layout, workers=tuple(range(workers)))
    metas = state_metadata(job.spec.model)
    return 4 * max(sum(n for _, n in state_index(metas, placement, w).values())
                   for w in range(workers))  # float32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="steps per run; the first 2 warm up")
    args = parser.parse_args()
    out = {}
    for workers in (2, 3):
        step_s = {True: [], False: []}
        swap_s = []
        for round_ in range(args.rounds):
            for snapshots in ((True, False) if round_ % 2 == 0 else (False, True)):
                print(f"{workers} workers, round {round_ + 1}/{args.rounds}, snapshots "
                      f"{'on' if snapshots else 'off'}", file=sys.stderr, flush=True)
                rows = _run(workers, args.steps, snapshots)[2:]
                step_s[snapshots] += [r["seconds"] + (r["snapshot_s"] or 0.0) for r in rows]
                if snapshots:
                    swap_s += [r["snapshot_s"] for r in rows]
        with_, without = statistics.median(step_s[True]), statistics.median(step_s[False])
        out[f"{workers}_workers"] = {
            "step_s_without": without, "step_s_with": with_, "ratio": with_ / without,
            "snapshot_s": statistics.median(swap_s), "state_bytes": _state_bytes(workers),
            "samples": len(swap_s),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
