"""What peer snapshots cost a training step, side by side with the same run without them.

Peer snapshots (``spec.checkpoint.peerSnapshots``, tidal_agent/snapshot.py) copy each worker's
state into host memory at a snapshot boundary and swap the copies around the ring of workers
in the background, so that a lost worker costs only the steps since the newest complete one.
This runs the model of bench/reshard.py (about 50M parameters with AdamW state) on 2 and 3
workers, without snapshots, with one at every step (``snapshotEverySteps: 1``) and at the
default interval (``0``: chosen at run time from their measured cost), in rotating rounds,
and compares the mean seconds from one step's start to the next's over the steps after the
warm-up (the step and, at a snapshot boundary, the copy): ``ratio`` is with / without.
``held_s`` is the median hold of one snapshot on training (the copy, and the wait for the
previous swap), ``snapshots`` how many the measured steps took, ``interval`` the measured
steps per snapshot, and ``state_bytes`` the state a worker copies (the largest stage's).

    python bench/snapshot.py [--rounds 2] [--steps 22]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [*(str(ROOT / root) for root in ("api", "agent", "operator", "doubles")), str(ROOT / "bench")]

from reshard import _job, snapshot_every  # noqa: E402  (the reshard benchmark's model and job)

from tidal_agent.runner import run_local  # noqa: E402
from tidal_agent.snapshot import state_index  # noqa: E402
from tidal_agent.switch import state_metadata  # noqa: E402
from tidal_plan.layout import resolve_layout  # noqa: E402
from tidal_plan.reshard import Placement  # noqa: E402


def _run(workers: int, steps: int, every: int | None) -> list[dict]:
    """The leader's step rows of one run: ``every`` steps between snapshots (None: none)."""
    job = snapshot_every(_job(), every or 0)
    report = run_local(job, resolve_layout(job, workers=workers), steps=steps, timeout_s=600,
                       peer_snapshots=every is not None)
    return report["steps"]


def held_seconds(rows: list[dict]) -> list[float]:
    """Each step's seconds with its snapshot's hold on training (the copy, and the wait for the
    previous swap), from a run's step rows: from one step's start to the next's."""
    return [r["seconds"] + (r["snapshot_s"] or 0.0) for r in rows]


def _state_bytes(workers: int) -> int:
    job = _job()
    layout = resolve_layout(job, workers=workers)
    placement = Placement(layout=layout, workers=tuple(range(workers)))
    metas = state_metadata(job.spec.model)
    return 4 * max(sum(n for _, n in state_index(metas, placement, w).values())
                   for w in range(workers))  # float32


VARIANTS = {"off": None, "every_step": 1, "default": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=22, help="steps per run; the first 2 warm up")
    args = parser.parse_args()
    out = {}
    names = list(VARIANTS)
    for workers in (2, 3):
        step_s = {name: [] for name in names}
        held = {name: [] for name in names}
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                print(f"{workers} workers, round {round_ + 1}/{args.rounds}, snapshots {name}",
                      file=sys.stderr, flush=True)
                rows = _run(workers, args.steps, VARIANTS[name])[2:]
                step_s[name] += held_seconds(rows)
                held[name] += [r["snapshot_s"] for r in rows if r["snapshot_s"]]
        without = statistics.mean(step_s["off"])
        result = {"step_s_without": without, "state_bytes": _state_bytes(workers),
                  "steps": len(step_s["off"])}
        for name in names[1:]:
            mean = statistics.mean(step_s[name])
            result[name] = {
                "step_s": mean, "ratio": mean / without,
                "held_s": statistics.median(held[name]) if held[name] else None,
                "snapshots": len(held[name]),
                "interval": len(step_s[name]) / max(1, len(held[name])),
            }
        out[f"{workers}_workers"] = result
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
