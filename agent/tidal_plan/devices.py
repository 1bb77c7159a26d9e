"""Device descriptions: the peaks the modeling-based predictor divides FLOPs and bytes by.

A ``Device`` is a handful of datasheet numbers plus what a run reaches of them: ``mfu``, the
fraction of peak FLOP/s that training matmuls reach, and ``memory_overhead_bytes``, what a GPU
holds beyond what the cost model counts. Built-ins cover an H100, an H200 and one CPU core of
a development machine with a guessed ``mfu``; anything else comes from a JSON file with the
same fields (``write_device``, ``load_device``). ``tidal run --write-device`` writes one whose
efficiency a run measured (``tidal_plan.measured``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

GIB = 1024**3


class DeviceError(ValueError):
    """A device description that cannot be used; the message says how to fix it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """One accelerator (or core) as the cost model sees it.

    ``peak_flops`` is dense matmul FLOP/s in the training dtype; ``p2p_bandwidth`` and
    ``p2p_latency_s`` describe one message between pipeline neighbours (and the links the
    data-parallel all-reduce runs over); ``nvlink_bandwidth`` is one GPU's share of the links
    inside a node of ``gpus_per_node`` GPUs (0: none faster than ``p2p_bandwidth``);
    ``dtype_bytes`` is the size of a parameter, gradient and activation element (2 for bf16,
    4 for fp32). ``memory_overhead_bytes`` adds to every GPU's predicted peak (CUDA's
    workspaces, allocator rounding: what a measured run held beyond the model's count).
    """

    name: str
    peak_flops: float
    memory_bytes: float
    memory_bandwidth: float
    p2p_bandwidth: float
    p2p_latency_s: float
    mfu: float = 0.5
    dtype_bytes: int = 2
    nvlink_bandwidth: float = 0.0
    gpus_per_node: int = 8
    memory_overhead_bytes: float = 0.0

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bytes", "memory_bandwidth", "p2p_bandwidth"):
            if not getattr(self, name) > 0:
                raise DeviceError(f"device {self.name!r}: {name} must be positive")
        if self.nvlink_bandwidth < 0 or self.gpus_per_node < 1:
            raise DeviceError(
                f"device {self.name!r}: nvlink_bandwidth must be non-negative and "
                "gpus_per_node at least 1"
            )
        if self.p2p_latency_s < 0 or self.memory_overhead_bytes < 0:
            raise DeviceError(f"device {self.name!r}: p2p_latency_s and memory_overhead_bytes "
                              "must be non-negative")
        if not 0 < self.mfu <= 1:
            raise DeviceError(
                f"device {self.name!r}: mfu ({self.mfu}) is a fraction of peak, in (0, 1]"
            )
        if self.dtype_bytes not in (2, 4):
            raise DeviceError(
                f"device {self.name!r}: dtype_bytes ({self.dtype_bytes}) must be 2 (bf16/fp16) "
                "or 4 (fp32)"
            )

    def bandwidth(self, group: int) -> float:
        """Per-GPU bandwidth of a collective among ``group`` GPUs packed into nodes."""
        if self.nvlink_bandwidth and group <= self.gpus_per_node:
            return self.nvlink_bandwidth
        return self.p2p_bandwidth

    @property
    def matmul_flops(self) -> float:
        """FLOP/s a training matmul actually reaches."""
        return self.peak_flops * self.mfu


DEVICES: dict[str, Device] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column: bf16 tensor core 1,979 TFLOP/s with
    # sparsity, so 989.4 dense (132 SMs x 4 tensor cores x 1,024 FLOP per clock x 1.83 GHz:
    # the Hopper whitepaper's 989.4); 80 GB of HBM3 (five 16 GiB stacks: 80 GiB, of which the
    # driver exposes 81,559 MiB, 79.65 GiB) at 3.35 TB/s; NVLink 900 GB/s, both directions
    # together. Pipeline neighbours are assumed to sit on different nodes, so p2p is one
    # 200 Gb/s InfiniBand NDR port per GPU (25 GB/s); collectives within a node of 8 use
    # NVLink (450 GB/s one way). 45% MFU is what well-tuned LLM training reports: a guess,
    # which tidal run --write-device replaces with what a run measured.
    "h100": Device(
        name="h100",
        peak_flops=989.4e12,
        memory_bytes=80 * GIB,
        memory_bandwidth=3.35e12,
        p2p_bandwidth=25e9,
        p2p_latency_s=10e-6,
        mfu=0.45,
        dtype_bytes=2,
        nvlink_bandwidth=450e9,  # NVLink 4: 900 GB/s both ways per GPU
        gpus_per_node=8,
    ),
    # One core of this development machine in fp32: a rough order of magnitude (AVX2 FMA at a
    # few GHz, as reached by PyTorch's small matmuls) for the CPU tests; p2p is gloo over
    # loopback. Profile it rather than trust it.
    "cpu": Device(
        name="cpu",
        peak_flops=2e10,
        memory_bytes=24 * GIB,
        memory_bandwidth=1e10,
        p2p_bandwidth=2e9,
        p2p_latency_s=50e-6,
        mfu=0.6,
        dtype_bytes=4,
    ),
}
# NVIDIA H200 Tensor Core GPU datasheet, SXM column: the H100's GH100 at the same clocks
# (bf16 1,979 TFLOP/s with sparsity: 989.4 dense), 141 GB of HBM3e (counted as the H100's 80:
# GiB; the driver exposes 143,771 MiB, 140.4 GiB) at 4.8 TB/s; NVLink 900 GB/s both ways;
# network and MFU as the H100's.
DEVICES["h200"] = replace(DEVICES["h100"], name="h200", memory_bytes=141 * GIB,
                          memory_bandwidth=4.8e12)


def gpu_description(gpu_name: str) -> str | None:
    """The built-in description of a GPU by its name as CUDA gives it ("NVIDIA H100 80GB
    HBM3" -> h100), or None for a GPU none describes."""
    lowered = gpu_name.lower()
    return next((name for name in DEVICES if name != "cpu" and name in lowered), None)


def write_device(device: Device, path: str | Path) -> Path:
    """Write ``device`` as the JSON object of its fields that ``load_device`` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(device), indent=2) + "\n")
    return path


def load_device(name_or_path: str | Path) -> Device:
    """A built-in device by name (``h100``, ``h200``, ``cpu``) or one described by a JSON
    file.

    The JSON object holds ``Device``'s fields; ``mfu``, ``dtype_bytes``, ``nvlink_bandwidth``,
    ``gpus_per_node`` and ``memory_overhead_bytes`` may be left out.
    """
    if isinstance(name_or_path, str) and name_or_path in DEVICES:
        return DEVICES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise DeviceError(
            f"unknown device {str(name_or_path)!r}: use one of {sorted(DEVICES)} or the path "
            "of a JSON file with Device's fields"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DeviceError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise DeviceError(f"{path} must hold a JSON object of Device's fields")
    known = {f.name for f in fields(Device)}
    required = {"name", "peak_flops", "memory_bytes", "memory_bandwidth", "p2p_bandwidth",
                "p2p_latency_s"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise DeviceError(
            f"{path}: unknown field(s) {unknown}: Device's fields are {sorted(known)}"
        )
    missing = sorted(required - set(data))
    if missing:
        raise DeviceError(f"{path}: missing field(s) {missing}: add them to the JSON object")
    try:
        return Device(**data)
    except TypeError as err:  # e.g. a number given as a string
        raise DeviceError(f"{path}: {err}") from err
