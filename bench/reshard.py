"""The hot switch against checkpoint-restart, side by side, on a model of about 50M parameters.

For a 2 -> 3 worker change of a model with AdamW state, in alternating rounds:

- hot: a run switches live after its first step; the time is the switch's ``pause_s``, from the
  end of the last 2-worker step to the start of the first 3-worker step (world, rebuild and
  state transfer included);
- restart: a 2-worker run saves a torch.distributed.checkpoint after its first step; then fresh
  processes start and load it into the 3-worker layout. The time is the save plus the new run's
  start-up to every worker ready (interpreters, worlds, trainers, checkpoint load); the old
  processes' exit is not counted, in the restart's favour;
- raw: one gloo send of ``bytes_min`` bytes between two processes, the transport's floor.

And how soon a shrink frees a leaver's GPUs: 3 -> 2 workers after the first step, worker-2
let go. ``release_s`` is the time from the end of its last step to the moment it is free to
exit. Without peer snapshots (``leavers_send``, the baseline) it sends its state first. With
them (``at_once``) its keeper, worker-0, holds its state, so it goes at the boundary and
worker-0 sends its state; but every boundary first swaps the snapshots (``snapshot_s``, part
of ``release_s``). Alternating rounds as above.

Prints JSON with the medians, ``ratio`` (restart / hot), ``transfer_bound_ratio``
(hot / raw) and ``release_ratio`` (leavers_send / at_once release: below 1 where the swap
costs more than the leaver's transfer).

With ``--job FILE`` the model and training section are that manifest's (the 0.5B example:
``--job examples/qwen2-0.5b.yaml --rounds 1 --no-release``), its workers 2 -> 3.

    python bench/reshard.py [--rounds 2] [--job FILE] [--no-release]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / root) for root in ("api", "agent", "operator", "doubles")]

import torch  # noqa: E402
import yaml  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tidal_agent.model import global_parameters  # noqa: E402
from tidal_agent.runner import run_elastic, run_local, worker_processes  # noqa: E402
from tidal_api import parse_job  # noqa: E402
from tidal_plan.elastic import elastic_plan  # noqa: E402
from tidal_plan.layout import resolve_layout  # noqa: E402


MODEL = {"layers": 13, "dModel": 512, "heads": 8, "vocab": 8192, "seqLen": 64}
TRAINING = {"steps": 100, "globalBatchSize": 4, "microBatchSize": 1, "seed": 0}


def _job(checkpoint_root: str | None = None):
    spec = {"workers": {"min": 2, "max": 8}, "model": MODEL, "training": TRAINING}
    if checkpoint_root:
        spec["checkpoint"] = {"path": checkpoint_root, "everySteps": 1}
    return parse_job({"apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob",
                      "metadata": {"name": "reshard"}, "spec": spec})


def hot_switch() -> dict:
    job = _job()
    gens, layouts = elastic_plan(job, [(0, 2), (1, 3)])
    report = run_elastic(job, gens, layouts, steps=2, timeout_s=600)
    return report["reconfigurations"][0]


def checkpoint_restart() -> dict:
    with tempfile.TemporaryDirectory() as root:
        first = run_local(_job(root), resolve_layout(_job(), workers=2), steps=1, timeout_s=600)
        saved = first["checkpoints"][0]
        second = run_local(_job(), resolve_layout(_job(), workers=3), steps=2,
                           resume_from=saved["path"], timeout_s=600,
                           fresh_interpreters=True)  # as restarted pods start
    return {"save_s": saved["seconds"], "startup_s": second["startup_s"],
            "total_s": saved["seconds"] + second["startup_s"]}


def snapshot_every(job, every: int):
    """``job`` with peer snapshots every ``every`` steps (0: the interval their cost sets)."""
    checkpoint = job.spec.checkpoint.model_copy(update={"snapshot_every_steps": every})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"checkpoint": checkpoint})})


def shrink(snapshots: bool) -> dict:
    """3 -> 2 workers after the first step: the switch's timings and worker-2's release_s
    (with a snapshot at every boundary, so at the shrink's)."""
    job = snapshot_every(_job(), 1)
    gens, layouts = elastic_plan(job, [(0, 3), (1, 2)])
    report = run_elastic(job, gens, layouts, steps=2, timeout_s=600, peer_snapshots=snapshots)
    (change,), (release,) = report["reconfigurations"], report["releases"]
    if change["released_at_once"] != snapshots:
        raise RuntimeError(f"expected released_at_once={snapshots}: {change}")
    return {**change, "release_s": release["release_s"], "snapshot_s": release["snapshot_s"]}


def _alternate(rounds: int, runs: dict[str, tuple], figure: str) -> dict[str, list[dict]]:
    """Each run of ``runs`` (name -> (function, args)) once a round, the order reversed every
    other round; prints ``figure`` of each."""
    out: dict[str, list[dict]] = {name: [] for name in runs}
    for round_ in range(rounds):
        order = list(runs.items())
        for name, (fn, args) in order if round_ % 2 == 0 else reversed(order):
            out[name].append(fn(*args))
            result = out[name][-1]
            print(f"round {round_}: {name} {result.get(figure, result.get('total_s')):.3f} s",
                  file=sys.stderr, flush=True)
    return out


def _raw_peer(rank: int, port: int, nbytes: int, repeats: int, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), rank, 2, timedelta(seconds=300))
    buf = torch.ones(nbytes // 4) if rank == 0 else torch.empty(nbytes // 4)
    times = []
    for i in range(repeats + 1):
        pg.allreduce([torch.zeros(1)]).wait()  # line both up
        started = time.perf_counter()
        (pg.send if rank == 0 else pg.recv)([buf], 1 - rank, i).wait()
        pg.allreduce([torch.zeros(1)]).wait()  # the receiver has it all
        if i:
            times.append(time.perf_counter() - started)
    if rank == 0:
        out.put(statistics.median(times))


def raw_send(nbytes: int, repeats: int = 3) -> float:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = worker_processes()  # forks of this launcher's warm server, as the runs' workers
    out = ctx.Queue()
    procs = [ctx.Process(target=_raw_peer, args=(r, store.port, nbytes, repeats, out))
             for r in range(2)]
    for p in procs:
        p.start()
    seconds = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a toy model: checks the bench runs")
    parser.add_argument("--job", help="take the model and training section of this manifest")
    parser.add_argument("--no-release", action="store_true", help="skip the 3 -> 2 shrinks")
    args = parser.parse_args()
    if args.tiny:
        MODEL.update(layers=4, dModel=32, vocab=64, seqLen=16)
    if args.job:
        spec = yaml.safe_load(Path(args.job).read_text())["spec"]
        MODEL.clear()
        MODEL.update(spec["model"])
        TRAINING.clear()
        TRAINING.update(spec["training"])
    params = sum(shape.numel() for _, shape, _ in global_parameters(_job().spec.model))
    print(f"model: {params / 1e6:.1f}M parameters (+ AdamW moments)", file=sys.stderr)
    switches = _alternate(args.rounds, {"hot": (hot_switch, ()),
                                        "restart": (checkpoint_restart, ())}, "pause_s")
    hot, restart = switches["hot"], switches["restart"]
    release = None
    if not args.no_release:
        shrinks = _alternate(args.rounds, {"at_once": (shrink, (True,)),
                                           "leavers_send": (shrink, (False,))}, "release_s")
        release = {name: {k: statistics.median(r[k] for r in runs)
                          for k in ("release_s", "snapshot_s", "pause_s", "transfer_s")}
                   for name, runs in shrinks.items()}
    bytes_min = hot[0]["bytes_min"]
    raw = raw_send(bytes_min)
    hot_s = statistics.median(h["pause_s"] for h in hot)
    restart_s = statistics.median(r["total_s"] for r in restart)
    report = {
        "benchmark": "reshard",
        "parameters": params,
        "change": "2 -> 3 workers",
        "bytes_min": bytes_min,
        "bytes_moved": hot[0]["bytes_moved"],
        "hot_switch_s": hot_s,
        "hot_switch_parts": {k: statistics.median(h[k] for h in hot)
                             for k in ("world_s", "rebuild_s", "transfer_s")},
        "checkpoint_restart_s": restart_s,
        "checkpoint_restart_parts": {k: statistics.median(r[k] for r in restart)
                                     for k in ("save_s", "startup_s")},
        "raw_send_s": raw,
        "ratio": restart_s / hot_s,
        "transfer_bound_ratio": hot_s / raw,
    }
    if release is not None:
        report["release"] = {"change": "3 -> 2 workers", **release}
        report["release_ratio"] = (release["leavers_send"]["release_s"]
                                   / release["at_once"]["release_s"])
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
