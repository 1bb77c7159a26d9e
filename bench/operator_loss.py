"""The operator lost while it scales: ``tidal local`` with ``tidal-operator`` killed (SIGKILL)
``--kills`` times in one run, each at a random moment within 0.3 s of a scale-up or scale-down
target written and not yet applied (a non-elastic pod for two of the four GPUs makes one every
few seconds). The loop and what must hold are tests/e2e/operator_loss.py's; its 2-kill version
runs in ``make test``.

Its last line is JSON: ``ok``, ``kills`` and how many struck with a scale in flight, the
generations seen, ``duplicate_targets`` (a generation with two targets: a decision taken
twice), ``stray_pods`` (a worker pod its generation's target does not join),
``pods_created_twice`` (two pods of one name for one generation), ``worker_pods`` (by uid),
``bitwise_equal`` (every step once, each loss and the final parameters those of a static
2-worker run) and the wall time. Exits 1 unless ``ok``. Progress goes to stderr.

    python bench/operator_loss.py [--kills 20] [--seed 0] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import checkout  # noqa: E402, F401 - first: this checkout's code, here and in forks

from tests.e2e.operator_loss import check, lose_the_operator  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="default: a temporary directory")
    args = parser.parse_args()
    if args.kills < 1:
        parser.error(f"--kills {args.kills}: at least 1")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tidal-operator-loss-"))
    print(f"workdir: {workdir}", file=sys.stderr)
    seen = lose_the_operator(workdir, kills=args.kills, seed=args.seed,
                             progress=lambda line: print(line, file=sys.stderr, flush=True))
    summary = check(seen, args.kills)
    print(json.dumps(summary))
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
