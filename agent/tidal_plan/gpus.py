"""Where a run's workers compute and how their ranks talk, chosen from what was asked and the
GPUs there are; and which GPU each worker gets.

The transport decides the device: ``nccl`` (one rank per GPU) and ``host`` (CUDA compute, gloo
through pinned host buffers, so ranks may share a GPU) compute on CUDA; ``gloo`` and
``nccl-model`` (gloo under NCCL's rules, a test transport) on the CPU. The choice is pure: the
commands count the GPUs (tidal_agent.devices) and a test chooses for any count without one.
"""

from __future__ import annotations

from dataclasses import dataclass

CUDA_TRANSPORTS = ("nccl", "host")
CPU_TRANSPORTS = ("gloo", "nccl-model")
TRANSPORTS = (*CPU_TRANSPORTS, *CUDA_TRANSPORTS)


class DeviceChoiceError(ValueError):
    """A device and transport that cannot go together here; the message says what to use."""


def compute_device(transport: str) -> str:
    """Where the ranks of ``transport`` compute: ``cuda`` or ``cpu``."""
    if transport not in TRANSPORTS:
        raise DeviceChoiceError(f"unknown transport {transport!r}: use one of {list(TRANSPORTS)}")
    return "cuda" if transport in CUDA_TRANSPORTS else "cpu"


@dataclass(frozen=True, kw_only=True, slots=True)
class Devices:
    """A run's transport and the GPUs its workers are spread over (0 on the CPU): worker
    ``i`` (in the order the workers start) computes on GPU ``i`` modulo ``gpus``."""

    transport: str = "gloo"
    gpus: int = 0

    def __post_init__(self) -> None:
        cuda = compute_device(self.transport) == "cuda"
        if cuda and self.gpus < 1:
            raise DeviceChoiceError(f"transport {self.transport} computes on CUDA and no GPU is "
                                    "visible: use device cpu (transport gloo)")
        if not cuda and self.gpus:
            raise DeviceChoiceError(f"transport {self.transport} computes on the CPU: it takes "
                                    f"no GPUs ({self.gpus} given)")

    @property
    def device(self) -> str:
        return compute_device(self.transport)

    def gpu(self, worker: int) -> int | None:
        """The GPU worker ``worker`` computes on (None on the CPU)."""
        return worker % self.gpus if self.gpus else None

    def check(self, workers: int) -> None:
        """Refuse ``workers`` processes that NCCL cannot run: two ranks on one GPU."""
        if self.transport == "nccl" and workers > self.gpus:
            raise DeviceChoiceError(
                f"{workers} workers need {workers} GPUs over nccl (one rank per GPU; a "
                f"schedule's joiners start with the others) and {self.gpus} "
                f"{'is' if self.gpus == 1 else 'are'} visible: use --transport host to share "
                "them, or fewer workers"
            )


def choose_devices(device: str = "auto", transport: str = "auto", *, gpus: int,
                   workers: int) -> Devices:
    """The devices of ``workers`` processes (every one a schedule ever starts) on a machine
    with ``gpus`` visible GPUs. ``device``: auto, cpu or cuda (auto: what an explicit transport
    computes on, else cuda where there is a GPU); ``transport``: auto or one of ``TRANSPORTS``
    (auto: nccl on cuda, gloo on cpu)."""
    if device not in ("auto", "cpu", "cuda"):
        raise DeviceChoiceError(f"unknown device {device!r}: use auto, cpu or cuda")
    if transport != "auto" and device != "auto" and compute_device(transport) != device:
        other = "nccl or host" if device == "cuda" else "gloo or nccl-model"
        raise DeviceChoiceError(f"transport {transport} computes on "
                                f"{compute_device(transport)}, not {device}: on {device} use "
                                f"transport {other}")
    if device == "auto":
        device = compute_device(transport) if transport != "auto" else (
            "cuda" if gpus else "cpu")
    if transport == "auto":
        transport = "nccl" if device == "cuda" else "gloo"
    chosen = Devices(transport=transport, gpus=gpus if device == "cuda" else 0)
    chosen.check(workers)
    return chosen
