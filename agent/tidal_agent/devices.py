"""A worker's device in the process that trains: its GPU bound before CUDA starts there, the
determinism contract's settings, and the GPU's name for the report and the planner.

Which device and transport a run uses, and which GPU each worker gets, is chosen without torch
(tidal_plan.gpus); this module applies the choice.

A GPU is bound by narrowing ``CUDA_VISIBLE_DEVICES`` to it, not by ``torch.cuda.set_device``:
the driver reads the variable once, when CUDA starts in the process, so nothing in the worker
(NCCL, a library's ``cuda:0``, a stray context) can reach another worker's GPU, and a worker of
``tidal run`` sees what a pod given one GPU sees: ``cuda:0``. The price is that it must come
before anything in the process starts CUDA (even ``torch.cuda.is_available()``): ``tidal run``'s
workers bind at their start (their fork server never touches CUDA), ``tidal agent`` before it
looks for a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import sys

import torch
import torch.utils.deterministic

from tidal_plan.devices import gpu_description
from tidal_plan.gpus import DeviceChoiceError, compute_device

log = logging.getLogger("tidal.agent")

# What strict mode asks of inductor: no on-device benchmarking that picks kernels, and compiled
# randomness drawn as eager draws it.
STRICT_INDUCTOR = {"deterministic": True, "fallback_random": True}
# The inductor settings set_determinism asked for, applied as inductor is imported
# (inductor_config): importing it imports dynamo, seconds of every process's start, and a
# process that compiles nothing never needs it.
_inductor_asked: dict[str, Any] = {}


def inductor_config() -> Any:
    """``torch._inductor.config`` with the settings set_determinism asked for applied: what
    tidal_agent.compiled calls before it compiles, and whatever reads those settings."""
    import torch._inductor.config as inductor

    for name, value in _inductor_asked.items():
        setattr(inductor, name, value)
    return inductor


def visible_gpus() -> int:
    """The GPUs this process may use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def bind_gpu(index: int, env: MutableMapping[str, str] = os.environ) -> str:
    """Make GPU ``index`` of those this process sees (in ``CUDA_VISIBLE_DEVICES``'s order where
    it is set) the only one it sees; returns its ``CUDA_VISIBLE_DEVICES`` entry."""
    if torch.cuda.is_initialized():
        raise RuntimeError(f"cannot bind GPU {index}: CUDA has started in this process already")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        entry = str(index)
    else:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if index >= len(entries):
            raise DeviceChoiceError(f"GPU {index} is not among the {len(entries)} this process "
                                    f"may use (CUDA_VISIBLE_DEVICES={visible!r})")
        entry = entries[index]
    env["CUDA_VISIBLE_DEVICES"] = entry
    return entry


def set_determinism(device: str, *, strict: bool, threads: int) -> dict[str, Any]:
    """Apply the determinism contract's settings for a worker computing on ``device`` (cpu or
    cuda); returns what it set, setting -> value (the report's ``determinism``).

    Every mode fixes the threads, the same in every process. Strict mode puts inductor in its
    deterministic mode on any device (a compiled unit's kernels are then chosen without timing
    them: tidal_agent.compiled), as inductor is imported (:func:`inductor_config`). On CUDA it also sets what torchtitan's ``set_determinism``
    does, before CUDA starts in the process: deterministic algorithms, cuBLAS's fixed
    workspace, cuDNN deterministic without benchmarking and TF32 off. The CPU's kernels give the
    same bits for the same threads without more (tests/integration/test_bitwise.py). Relaxed
    mode leaves the rest as they are.
    """
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # a fork has its server's
    record: dict[str, Any] = {"threads": threads}
    if not strict:
        return record
    _inductor_asked.update(STRICT_INDUCTOR)
    if "torch._inductor.config" in sys.modules:
        inductor_config()  # imported already: set now, as for a process that compiled before
    if device != "cuda":
        return record | {f"torch._inductor.config.{name}": value
                         for name, value in STRICT_INDUCTOR.items()}
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # read as cuBLAS starts
    torch.use_deterministic_algorithms(True)
    # Not filling every new tensor, as torchtitan: the trainer writes each buffer before it
    # reads it, and the fill is one more kernel per allocation (receive buffers included).
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return record | strict_settings()


def strict_settings() -> dict[str, Any]:
    """The settings strict mode sets on CUDA, as they are now in this process."""
    return {
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "torch.use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch.utils.deterministic.fill_uninitialized_memory":
            torch.utils.deterministic.fill_uninitialized_memory,
        "torch.backends.cudnn.deterministic": torch.backends.cudnn.deterministic,
        "torch.backends.cudnn.benchmark": torch.backends.cudnn.benchmark,
        "torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "torch.float32_matmul_precision": torch.get_float32_matmul_precision(),
    } | {f"torch._inductor.config.{name}": getattr(inductor_config(), name)
         for name in STRICT_INDUCTOR}


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerDevice:
    """Where a worker computes (``device``), as the report names it (``name``: "cpu" or
    "cuda: <the GPU's name>"), and what ``set_determinism`` set there."""

    device: torch.device
    name: str
    determinism: dict[str, Any]


def prepare_worker(transport: str, gpu: int | None, *, strict: bool,
                   threads: int) -> WorkerDevice:
    """Put this process on its device: bind ``gpu`` (given by ``tidal run``'s launcher; None
    where it is bound already, as ``tidal agent`` does, or on the CPU), then set determinism,
    both before CUDA starts here."""
    if gpu is not None:
        bind_gpu(gpu)
    device = compute_device(transport)
    determinism = set_determinism(device, strict=strict, threads=threads)
    if device == "cpu":
        return WorkerDevice(device=torch.device("cpu"), name="cpu", determinism=determinism)
    cuda = torch.device("cuda", 0)  # the one GPU bound
    torch.cuda.set_device(cuda)
    return WorkerDevice(device=cuda, name=f"cuda: {torch.cuda.get_device_name(cuda)}",
                        determinism=determinism)


def plan_device(device: str) -> str:
    """The built-in description of what workers compute on, for the modeling-based predictor
    (``--plan-device``'s default): cpu, or this process's first GPU by its name (h100, h200;
    h100, with a warning, for a GPU none describes)."""
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(0)
    found = gpu_description(name)
    if found is None:
        log.warning("no device description for GPU %r: planning with h100's (--plan-device "
                    "names another, or a JSON file)", name)
        return "h100"
    return found
