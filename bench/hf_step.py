"""Tidal's training step at pp=1 against a plain transformers training loop, side by side.

Both train the same Hugging Face Llama from the same initial values on the same micro-batches:

- tidal: a ``Trainer`` over a one-worker world (a gloo group of one, as a pp=1 worker has; an
  NCCL one with ``--device cuda``),
  running its real step: the runtime's action list over the placement units (each under the
  precision's autocast), the global-order gradient clip, the fused AdamW and the step loss;
- plain: ``AutoModelForCausalLM.from_config`` (sdpa attention) holding Tidal's initial values
  (loaded by :func:`tidal_agent.hf.hf_name`): the whole forward under the same autocast, with
  ``use_cache=False`` (training keeps no key-value cache), cross-entropy on the fp32 logits,
  ``(loss / num_micro_batches).backward()`` per micro-batch in micro-batch order,
  ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW`` with the same groups (weight
  decay on matrices only), hyperparameters and per-step learning rate (``lr_at``), fused as
  Tidal's is (``fused=True``), so the optimizer's kernel is the same on both sides. It reads
  the step loss once per step, as Tidal does (a host sync per micro-batch would slow a GPU);
- tidal_compiled: the same trainer with ``training.compile: on`` (each unit compiled on its own
  by inductor, tidal_agent.compiled);
- plain_compiled: the plain loop with its whole model under ``torch.compile`` (inductor), what a
  user who compiles their model runs: the second baseline. ``--compile-backend`` compiles both
  with another backend (``eager``: dynamo's capture alone, for a quick check), or drops the two
  compiled sides (``none``).

All run in one process on one thread (``torch.set_num_threads(1)``), taking turns step by step
(the order rotating each step): whatever else runs on the host slows every side alike, and each
side's step starts from the caches another side's step left. Processes taking turns would do
the same with a handshake per step and more interpreters' memory, and gain nothing on one
thread. The warm-up steps include the compiled sides' compilation.

Prints JSON: per precision (fp32, bf16) the median step seconds of each side, ``ratio`` (the
median of the paired step ratios tidal/plain), ``compiled_ratio`` (tidal_compiled /
plain_compiled), ``compiled_speedup`` (plain / plain_compiled) and each side's first step loss
(the same eager: the units compute the library's numbers); ``ratio`` and ``compiled_ratio`` at
the top are the worst precision's.

    python bench/hf_step.py [--precision fp32,bf16] [--steps 10] [--warmup 2] [--device cuda]
                            [--compile-backend inductor|eager|none]

bench/gpu.py uses the two sides one after the other at a GPU's sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / root) for root in ("api", "agent", "operator", "doubles")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tidal_agent.hf import hf_name  # noqa: E402
from tidal_agent.optim import lr_at  # noqa: E402
from tidal_agent.trainer import Trainer, batch_source  # noqa: E402
from tidal_agent.world import Rendezvous, build_world  # noqa: E402
from tidal_api import ElasticTrainingJob, JobSpec, parse_job  # noqa: E402
from tidal_plan.layout import build_layout  # noqa: E402

CONFIG = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 512,
          "intermediate_size": 1376, "num_attention_heads": 8, "num_key_value_heads": 4,
          "vocab_size": 8192, "max_position_embeddings": 256}
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 172,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 32}
SEQ_LEN = {"full": 128, "tiny": 32}
TRAINING = {"steps": 1000, "globalBatchSize": 8, "microBatchSize": 2, "lr": 1e-3,
            "warmupSteps": 0, "gradClip": 1.0, "seed": 0}


def hf_job(config: dict, seq_len: int, precision: str, *, name: str = "hf-step",
           training: dict | None = None, max_workers: int = 1,
           consistency: str = "strict") -> ElasticTrainingJob:
    """A job training the Hugging Face ``config`` on the synthetic corpus (``TRAINING``'s
    hyperparameters, overridden by ``training``), on 1 to ``max_workers`` workers."""
    sizes = {"layers": config["num_hidden_layers"], "dModel": config["hidden_size"],
             "heads": config["num_attention_heads"], "vocab": config["vocab_size"],
             "seqLen": seq_len}
    return parse_job({
        "apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob",
        "metadata": {"name": name},
        "spec": {"workers": {"min": 1, "max": max_workers},
                 "model": {**sizes, "huggingface": {"config": config}},
                 "training": {**TRAINING, **(training or {}), "precision": precision},
                 "parallelism": {"consistency": consistency}},
    })


def tidal_trainer(spec: JobSpec, store: dist.Store, name: str, device: torch.device, *,
                  checkpointing: bool = False) -> Trainer:
    """A pp=1 worker's trainer on ``device``: one stage holding every unit, in a world of one
    (NCCL's on CUDA, as ``tidal agent`` builds it there; gloo's on the CPU), activation
    ``checkpointing`` on or off."""
    t = spec.training
    members = ("worker-0",)
    transport = "nccl" if device.type == "cuda" else "gloo"
    world = build_world(Rendezvous(host="127.0.0.1", port=0, prefix="", transport=transport),
                        0, members, members[0], name=name, store=store)
    layout = build_layout(num_units=spec.model.num_units, workers=1,
                          micro_batch_size=t.micro_batch_size,
                          num_micro_batches=t.num_micro_batches, schedule="1f1b",
                          activation_checkpointing=checkpointing)
    return Trainer(spec=spec, layout=layout, world=world, device=device)


class PlainLoop:
    """The transformers model trained the usual way on ``device``, from the given initial
    values (the trainer's ``named_params``). ``compile_backend``: the model under
    ``torch.compile`` with that backend (inductor is what a user would pick)."""

    def __init__(self, spec: JobSpec, config: dict,
                 initial: Iterable[tuple[str, torch.Tensor]], device: torch.device,
                 compile_backend: str | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = dict(config)
        hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with device:  # drawn where it trains (the values are replaced next): no host copy
            self.model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
        loaded = self.model.load_state_dict(
            {hf_name(spec.model, name): p.detach() for name, p in initial}, strict=False)
        if loaded.unexpected_keys or set(loaded.missing_keys) - {"model.rotary_emb.inv_freq"}:
            raise SystemExit(f"the trainer's parameters do not fit the model: {loaded}")
        self.forward = (torch.compile(self.model, backend=compile_backend) if compile_backend
                        else self.model)
        self.spec, self.t, self.device = spec, spec.training, device
        params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": self.t.weight_decay},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=self.t.lr, betas=self.t.betas, eps=1e-8, fused=True)
        self.batches = batch_source(spec)

    def step(self, step: int) -> float:
        t, seq = self.t, self.spec.model.seq_len
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, t)
        losses = []
        for m in range(t.num_micro_batches):
            tokens = self.batches.micro_batch(step, m).to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16,
                                enabled=t.precision == "bf16"):
                logits = self.forward(input_ids=tokens[:, :seq], use_cache=False).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                   tokens[:, 1 : 1 + seq].reshape(-1))
            (loss / t.num_micro_batches).backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0  # read once per step (one host sync), summed as Tidal's step loss is
        for value in torch.stack(losses).tolist():  # in float64 and micro-batch order
            total += value
        return total / t.num_micro_batches


SIDES = ("tidal", "plain", "tidal_compiled", "plain_compiled")


def bench_precision(config: dict, seq_len: int, precision: str, steps: int, warmup: int,
                    store: dist.Store, device: torch.device,
                    compile_backend: str | None = "inductor") -> dict:
    """Each side's step times at ``precision``, the sides taking turns step by step (the
    order rotating every step); with a ``compile_backend``, the two compiled sides too."""
    compiled = compile_backend is not None
    spec = hf_job(config, seq_len, precision, training={"compile": "off"}).spec
    tidal = tidal_trainer(spec, store, f"hf-step-{precision}", device)
    plain = PlainLoop(spec, config, tidal.named_params, device)
    sides = {"tidal": lambda step: tidal.step(step).loss, "plain": plain.step}
    if compiled:
        spec_c = hf_job(config, seq_len, precision, training={"compile": "on"}).spec
        tidal_c = tidal_trainer(spec_c, store, f"hf-step-{precision}-compiled", device)
        plain_c = PlainLoop(spec_c, config, tidal_c.named_params, device,
                            compile_backend=compile_backend)
        sides |= {"tidal_compiled": lambda step: tidal_c.step(step).loss,
                  "plain_compiled": plain_c.step}
    names = [name for name in SIDES if name in sides]
    times: dict[str, list[float]] = {name: [] for name in names}
    first_loss: dict[str, float] = {}
    for step in range(warmup + steps):
        shift = step % len(names)
        took = {}
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            loss = sides[name](step)
            took[name] = elapsed = time.perf_counter() - started
            first_loss.setdefault(name, loss)
            if step >= warmup:
                times[name].append(elapsed)
        print(f"{precision} step {step}: " + ", ".join(f"{name} {took[name]:.2f} s"
                                                       for name in names),
              file=sys.stderr, flush=True)

    def ratio(side: str, baseline: str) -> float:  # the median of the paired step ratios
        return statistics.median(a / b for a, b in zip(times[side], times[baseline],
                                                       strict=True))

    out = {"precision": precision, "ratio": ratio("tidal", "plain")}
    if compiled:
        out |= {"compiled_ratio": ratio("tidal_compiled", "plain_compiled"),
                "compiled_speedup": ratio("plain", "plain_compiled")}
    return out | {f"{name}_median_s": statistics.median(times[name]) for name in names} | {
        "first_step_loss": first_loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="fp32,bf16", help="fp32, bf16 or both")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    parser.add_argument("--tiny", action="store_true", help="a toy model: checks the bench runs")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both sides train (cuda: the current GPU)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend for both compiled sides, or none: the "
                             "eager sides only (inductor compiles for tens of seconds)")
    args = parser.parse_args()
    backend = None if args.compile_backend == "none" else args.compile_backend
    if backend is not None:
        from tidal_agent import compiled

        compiled.BACKEND = backend  # Tidal's units compile as the plain loop does
    device = torch.device(args.device)
    config = {**CONFIG, **(TINY if args.tiny else {})}
    seq_len = SEQ_LEN["tiny" if args.tiny else "full"]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    runs = []
    for precision in args.precision.split(","):
        print(f"{precision}: {args.warmup} warm-up + {args.steps} timed steps per side...",
              file=sys.stderr, flush=True)
        runs.append(bench_precision(config, seq_len, precision, args.steps, args.warmup, store,
                                    device, backend))
        print(f"{precision}: ratio {runs[-1]['ratio']:.3f}, compiled_ratio "
              f"{runs[-1].get('compiled_ratio', float('nan')):.3f}", file=sys.stderr, flush=True)
    report = {
        "benchmark": "hf_step",
        "baseline": "a plain transformers training loop, one process (compiled_ratio: both "
                    "compiled, Tidal unit by unit, the plain loop's whole model)",
        "config": config,
        "seq_len": seq_len,
        "training": {k: TRAINING[k] for k in ("globalBatchSize", "microBatchSize")},
        "device": str(device),
        "threads": torch.get_num_threads(),
        "runs": runs,
        "ratio": max(r["ratio"] for r in runs),
        "compile_backend": backend,
        "compiled_ratio": max(r["compiled_ratio"] for r in runs) if backend else None,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
