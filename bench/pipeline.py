"""Tidal's pipeline runtime against torch.distributed.pipelining's Schedule1F1B, side by side.

Both run the same model (Tidal's placement units, same initial values), the same PP degree,
micro-batching and schedule (1F1B), in the same worker processes over the same gloo group,
alternating step by step (Tidal first on even steps, torch first on odd ones). Each side does
a whole training step: the pipeline, a gradient clip, AdamW (fused on both) and a step
loss known on every rank. Torch's side clips as torchtitan does (per-stage squares all-reduced);
Tidal's reduces per-parameter norms in global order, which its determinism contract needs.

With ``--model llama`` the model is a Hugging Face Llama of the same sizes (grouped-query
attention, a SwiGLU MLP), built with transformers and cut into Tidal's HF units; torch's side
runs the same units from the same initial values.

Prints JSON: per PP degree the median step seconds of each side and their ratio, and ``ratio``,
the median over every paired step of tidal/torch.

    python bench/pipeline.py [--pp 2,4] [--steps 12] [--warmup 3] [--model gpt|llama]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / root) for root in ("api", "agent", "operator", "doubles")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: E402

from tidal_agent.model import StageModule, UnitContext, build_unit  # noqa: E402
from tidal_agent.runner import worker_processes  # noqa: E402
from tidal_agent.trainer import Trainer, batch_source  # noqa: E402
from tidal_agent.world import Rendezvous, build_world  # noqa: E402
from tidal_api import parse_job  # noqa: E402
from tidal_plan.layout import build_layout  # noqa: E402

JOB = {
    "apiVersion": "tidal.dev/v1alpha1",
    "kind": "ElasticTrainingJob",
    "metadata": {"name": "bench"},
    "spec": {
        "workers": {"min": 2, "max": 8},
        "model": {"layers": 8, "dModel": 128, "heads": 4, "vocab": 512, "seqLen": 64},
        "training": {"steps": 1000, "globalBatchSize": 32, "microBatchSize": 4, "lr": 1e-3,
                     "warmupSteps": 0, "gradClip": 1.0, "seed": 0},
    },
}

# The same sizes as a Hugging Face Llama: 2 key-value heads, intermediate 8/3 of dModel.
LLAMA = {**JOB["spec"]["model"], "huggingface": {"config": {
    "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 128, "intermediate_size": 344,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 64}}}
TINY = {"layers": 4, "dModel": 32, "vocab": 64, "seqLen": 16}
TINY_LLAMA = {"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 86,
              "vocab_size": 64, "max_position_embeddings": 16}


class _TorchStage(torch.nn.Module):
    """Tidal's units of one stage behind the plain ``forward(x)`` that PipelineStage calls."""

    def __init__(self, units: StageModule, first: bool) -> None:
        super().__init__()
        self.units, self.first = units, first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x if self.first else None
        ctx = UnitContext(seed=0, step=0, mb=0, device=x.device, load=lambda: tokens)
        h, _ = self.units(None if self.first else x, ctx)
        return h


def _worker(rank: int, pp: int, port: int, steps: int, warmup: int, job: dict, results) -> None:
    torch.set_num_threads(1)
    timeout = timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    # torch's side uses the default group; Tidal's trainer a world of its own on the same store.
    dist.init_process_group("gloo", store=dist.PrefixStore(f"pp{pp}/torch/", store), rank=rank,
                            world_size=pp, timeout=timeout)
    members = tuple(f"worker-{r}" for r in range(pp))
    world = build_world(Rendezvous(host="127.0.0.1", port=port, prefix=f"pp{pp}/tidal/",
                                   timeout_s=300), 0, members, members[rank])
    spec = parse_job(job).spec
    model = spec.model
    t = spec.training
    layout = build_layout(num_units=model.num_units, workers=pp,
                          micro_batch_size=t.micro_batch_size,
                          num_micro_batches=t.num_micro_batches, schedule="1f1b")
    device = torch.device("cpu")
    tidal = Trainer(spec=spec, layout=layout, world=world, device=device)

    # Torch's side: the same units; the LM head becomes its loss_fn on the last stage.
    head_unit = model.num_units - 1
    units = layout.stage_units(rank)
    last = rank == pp - 1
    body = StageModule(model, range(units.start, head_unit) if last else units, t.seed,
                       precision=t.precision)
    head = build_unit(model, head_unit, t.seed) if last else None
    stage = PipelineStage(_TorchStage(body, first=rank == 0), rank, pp, device)

    def loss_fn(h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ctx = UnitContext(seed=0, step=0, mb=0, device=device, load=lambda: target)
        return head(h, ctx)[1]

    schedule = Schedule1F1B(stage, n_microbatches=t.num_micro_batches, loss_fn=loss_fn)
    params = list(body.parameters()) + (list(head.parameters()) if head else [])
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=t.betas, fused=True)
    batches = batch_source(spec)

    def torch_step(step: int) -> float:
        tokens = torch.cat([batches.micro_batch(step, m) for m in range(t.num_micro_batches)])
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(tokens)
        elif last:
            schedule.step(target=tokens, losses=losses)
        else:
            schedule.step()
        squares = torch.stack([torch.linalg.vector_norm(p.grad) for p in params]).square().sum()
        dist.all_reduce(squares)
        coef = torch.clamp(t.grad_clip / (squares.sqrt() + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.stack(losses).sum() / t.num_micro_batches if losses else torch.zeros(())
        dist.all_reduce(loss)
        return float(loss.detach())

    def tidal_step(step: int) -> float:
        return tidal.step(step).loss

    sides = {"tidal": tidal_step, "torch": torch_step}
    times: dict[str, list[float]] = {"tidal": [], "torch": []}
    first_loss: dict[str, float] = {}
    for step in range(warmup + steps):
        order = ("tidal", "torch") if step % 2 == 0 else ("torch", "tidal")
        for name in order:
            dist.barrier()
            started = time.perf_counter()
            loss = sides[name](step)
            elapsed = time.perf_counter() - started
            first_loss.setdefault(name, loss)
            if step >= warmup:
                times[name].append(elapsed)
    # Step time is the slowest rank's: gather every rank's times on rank 0.
    gathered: list[dict[str, list[float]]] = [None] * pp  # type: ignore[list-item]
    dist.all_gather_object(gathered, times)
    if rank == 0:
        slowest = {k: [max(g[k][i] for g in gathered) for i in range(steps)] for k in times}
        results.put({"pp": pp, "times": slowest, "first_loss": first_loss})
    dist.destroy_process_group()


def bench_pp(pp: int, steps: int, warmup: int, job: dict) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # forks of one warm server (with transformers' modelling base for the Llama)
    ctx = worker_processes(hf="huggingface" in job["spec"]["model"])
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, pp, store.port, steps, warmup, job, results))
             for r in range(pp)]
    for p in procs:
        p.start()
    while True:  # fail fast if a worker dies instead of waiting for a result that never comes
        try:
            out = results.get(timeout=1)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit(f"pp={pp}: a worker failed: {[p.exitcode for p in procs]}")
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"pp={pp}: a worker failed: exit codes {[p.exitcode for p in procs]}")
    tidal, torch_ = out["times"]["tidal"], out["times"]["torch"]
    return {
        "pp": pp,
        "tidal_median_s": statistics.median(tidal),
        "torch_median_s": statistics.median(torch_),
        "ratio": statistics.median(tidal) / statistics.median(torch_),
        "paired_ratios": [a / b for a, b in zip(tidal, torch_, strict=True)],
        "first_step_loss": out["first_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="2,4", help="PP degrees, comma-separated")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side")
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                        help="the built-in GPT or a Hugging Face Llama of its sizes")
    parser.add_argument("--tiny", action="store_true", help="a toy model: checks the bench runs")
    args = parser.parse_args()
    job = json.loads(json.dumps(JOB))
    model = job["spec"]["model"]
    if args.model == "llama":
        model.update(json.loads(json.dumps(LLAMA)))
    if args.tiny:
        model.update(TINY)
        if args.model == "llama":
            model["huggingface"]["config"].update(TINY_LLAMA)
    os.environ["OMP_NUM_THREADS"] = "1"
    runs = []
    for pp in (int(p) for p in args.pp.split(",")):
        print(f"pp={pp}: {args.warmup} warm-up + {args.steps} timed steps per side...",
              file=sys.stderr, flush=True)
        runs.append(bench_pp(pp, args.steps, args.warmup, job))
        print(f"pp={pp}: ratio {runs[-1]['ratio']:.3f}", file=sys.stderr, flush=True)
    paired = [r for run in runs for r in run["paired_ratios"]]
    report = {
        "benchmark": "pipeline",
        "baseline": "torch.distributed.pipelining.Schedule1F1B",
        "model": job["spec"]["model"],
        "training": {k: JOB["spec"]["training"][k] for k in ("globalBatchSize", "microBatchSize")},
        "runs": [{k: v for k, v in r.items() if k != "paired_ratios"} for r in runs],
        "ratio": statistics.median(paired),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
