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

Prints JSON with the medians, ``ratio`` (restart / hot) and ``transfer_bound_ratio``
(hot / raw).

    python bench/reshard.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "agent"), str(ROOT / "operator")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tidal_agent.model import global_parameters  # noqa: E402
from tidal_agent.runner import elastic_plan, resolve_layout, run_elastic, run_local  # noqa: E402
from tidal_agent.trainer import model_config  # noqa: E402
from tidal_api import parse_job  # noqa: E402


MODEL = {"layers": 13, "dModel": 512, "heads": 8, "vocab": 8192, "seqLen": 64}


def _job(checkpoint_root: str | None = None):
    spec = {
        "model": MODEL,
        "training": {"steps": 100, "globalBatchSize": 4, "microBatchSize": 1, "seed": 0},
    }
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
                           resume_from=saved["path"], timeout_s=600)
    return {"save_s": saved["seconds"], "startup_s": second["startup_s"],
            "total_s": saved["seconds"] + second["startup_s"]}


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
    ctx = mp.get_context("spawn")
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
    args = parser.parse_args()
    if args.tiny:
        MODEL.update(layers=4, dModel=32, vocab=64, seqLen=16)
    params = sum(shape.numel() for _, shape, _ in global_parameters(model_config(_job().spec)))
    print(f"model: {params / 1e6:.1f}M parameters (+ AdamW moments)", file=sys.stderr)
    hot, restart = [], []
    for round_ in range(args.rounds):
        order = (("hot", hot_switch, hot), ("restart", checkpoint_restart, restart))
        for name, fn, sink in order if round_ % 2 == 0 else reversed(order):
            sink.append(fn())
            figure = sink[-1].get("pause_s", sink[-1].get("total_s"))
            print(f"round {round_}: {name} {figure:.3f} s", file=sys.stderr, flush=True)
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
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
