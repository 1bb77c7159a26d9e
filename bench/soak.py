"""The fault soak: a long run of a small job that loses a worker to SIGKILL again and again (at
random moments, during switches and during snapshot exchanges) and must end with the bits of a
run that lost none.

The job runs as ``tidal agent`` processes against the Kubernetes API emulator, this script
playing the operator: after each fault the survivors recover from the peer snapshots, and a
spare pod waiting in standby is named by a grow target, back to ``--workers``. The loop is
tests/integration/soak.py's (its 20-fault version runs in ``make test``); its module docstring
says how the faults are timed and what a fault costs. A quarter of the faults kill the leader:
the rendezvous runs in a process of its own, and a survivor takes the lead.

Its last line is JSON: ``bitwise_equal`` (every step once, each loss and the final parameters
those of a fault-free 2-worker run), ``faults``, ``recover_s`` (the kill to the survivors'
generation in status: median, p90, p99, max) and the rest of the summary (faults by kind,
steps replayed, the leader's pauses, wall time, spares that never registered). Each fault's
record (kind, victim, the step it failed at and resumed from, the pause) goes to
``faults.json`` in the work directory. Exits 1 where the bits differ. Progress goes to
stderr.

    python bench/soak.py [--faults 1000] [--seed 0] [--workers 3] [--steps-per-fault 12]
                         [--snapshot-every 1] [--lost-after 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import checkout  # noqa: E402, F401 - first: this checkout's code, here and in forks

from tests.integration.agents import crd_client  # noqa: E402
from tests.integration.soak import FaultSoak, SoakConfig  # noqa: E402
from tidal_api import JobSpecError  # noqa: E402
from tidal_kube.serving import EmulatorThread  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=3, help="the job's pods: 3 or 4")
    parser.add_argument("--steps-per-fault", type=int, default=12,
                        help="the job's length, in steps per fault (its pace)")
    parser.add_argument("--snapshot-every", type=int, default=1,
                        help="spec.checkpoint.snapshotEverySteps (0: the agent's default, an "
                             "interval chosen from the snapshots' measured cost)")
    parser.add_argument("--lost-after", type=float, default=5.0,
                        help="the agents' --lost-after: seconds of heartbeat silence, the "
                             "backstop (a killed pod is lost from its ended connection)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="the agents' logs and the leader's report (default: a temporary "
                             "directory, kept)")
    args = parser.parse_args()
    try:
        config = SoakConfig(faults=args.faults, seed=args.seed, workers=args.workers,
                            steps_per_fault=args.steps_per_fault,
                            snapshot_every=args.snapshot_every or None,
                            lost_after_s=args.lost_after)
    except (ValueError, JobSpecError) as err:
        parser.error(str(err))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tidal-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"soak: {config.faults} faults, {config.steps} steps, logs in {workdir}",
          file=sys.stderr, flush=True)

    def progress(line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)

    with EmulatorThread(kubeconfig=workdir / "kubeconfig") as emulator:
        api = crd_client(emulator)
        try:
            run = FaultSoak(config, api=api, kubeconfig=str(emulator.kubeconfig),
                            workdir=workdir, progress=progress).run()
        finally:
            api.close()
    summary = run.summary()
    (workdir / "faults.json").write_text(json.dumps([f.record() for f in run.faults], indent=2))
    print(json.dumps(summary))  # the last line: bitwise_equal, recover_s, faults, ...
    if not summary["bitwise_equal"]:
        progress(f"not a fault-free run's bits: {run.differs}")
        sys.exit(1)


if __name__ == "__main__":
    main()
