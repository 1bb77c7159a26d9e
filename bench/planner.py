"""The FlexTrain scale tables: how long each takes to build, and whether they are the checked-in ones.

For each configuration of the FlexTrain slides (small, medium, large) and each elastic mode
(``pp``: the slides' DP degree kept, PP scaled; ``dp-pp``: both free), builds the full scale
table on the H100 description with the modeling-based predictor, in a fresh interpreter state
(the simulator's and the cost model's caches cleared), and prints JSON per table: ``seconds`` and
``budget_ratio`` (seconds over the 10-second budget of issue 4), the rows kept and dropped,
the layout chosen at the initial GPU count against the slides' (``initial``), and whether the
table equals the one checked in under examples/scale-tables/ (``matches_checked_in``).

    python bench/planner.py [--only small] [--elastic pp] [--repeat 3] [--write]

``--repeat N`` builds each table N times, each from a cold cache, and reports the fastest as
``seconds`` (every run in ``runs``): on a shared machine one build can take twice as long.
``--write`` rewrites the checked-in tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / root) for root in ("api", "agent", "operator", "doubles")]

from tidal_plan.costmodel import model_unit_costs  # noqa: E402
from tidal_plan.devices import DEVICES  # noqa: E402
from tidal_plan.estimate import clear_caches  # noqa: E402
from tidal_plan.planner import FLEXTRAIN_RUNS, plan_flextrain  # noqa: E402

BUDGET_S = 10.0
TABLES = ROOT / "examples" / "scale-tables"


def table_path(name: str, elastic: str) -> Path:
    return TABLES / f"flextrain-{name}-{elastic}.json"


def build(name: str, elastic: str, write: bool, repeat: int = 1) -> dict:
    runs = []
    for _ in range(repeat):
        clear_caches()
        model_unit_costs.cache_clear()
        started = time.perf_counter()
        table, _ = plan_flextrain(name, DEVICES["h100"], elastic=elastic)
        runs.append(time.perf_counter() - started)
    seconds = min(runs)
    text = table.model_dump_json(by_alias=True, indent=2) + "\n"
    path = table_path(name, elastic)
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    run = FLEXTRAIN_RUNS[name]
    first = table.rows[0] if table.rows else None
    return {
        "table": path.name,
        "seconds": round(seconds, 3),
        "runs": [round(run, 3) for run in runs],
        "budget_ratio": round(seconds / BUDGET_S, 3),
        "rows": len(table.rows),
        "dropped": {r: sum(d.reason == r for d in table.dropped)
                    for r in sorted({d.reason for d in table.dropped})},
        "initial": {
            "gpus": run.gpus[0],
            "slides": {"dp": run.dp, "pp": run.pp, "cp": run.cp, "ep": run.ep},
            "planned": None if first is None else {
                "gpus": first.gpus, "dp": first.layout.dp, "pp": first.layout.pp,
                "schedule": first.layout.schedule.value,
                "peak_gib": round(first.peak_memory_bytes / 2**30, 1),
            },
        },
        "max_speedup": round(max((r.speedup for r in table.rows), default=0.0), 3),
        "matches_checked_in": path.is_file() and path.read_text() == text,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(FLEXTRAIN_RUNS))
    parser.add_argument("--elastic", choices=["pp", "dp-pp"])
    parser.add_argument("--repeat", type=int, default=1,
                        help="build each table this many times and report the fastest")
    parser.add_argument("--write", action="store_true", help="rewrite the checked-in tables")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    results = [
        build(name, elastic, args.write, args.repeat)
        for name in ([args.only] if args.only else sorted(FLEXTRAIN_RUNS))
        for elastic in ([args.elastic] if args.elastic else ["pp", "dp-pp"])
    ]
    for result in results:
        print(json.dumps(result), flush=True)
    print(json.dumps({
        "max_seconds": max(r["seconds"] for r in results),
        "within_budget": all(r["seconds"] <= BUDGET_S for r in results),
        "all_match_checked_in": all(r["matches_checked_in"] for r in results),
    }))


if __name__ == "__main__":
    main()
