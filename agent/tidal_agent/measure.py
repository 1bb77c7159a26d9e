"""GPU work measured as such: the seconds a device spends on it, and the memory it peaks at.

CUDA runs asynchronously: the host's clock around a launch times the launch, not the kernels.
A ``Clock`` marks points in the device's stream of work (CUDA events with timing; on the CPU
the host's clock behind the same calls, so CPU runs and tests take the code path a GPU takes)
and reads the seconds between two marks later: reading waits until the device has reached the
later mark, which costs nothing where the reader comes after a synchronisation (the profiler
and the layer clock read theirs after the step's end). ``MemoryPeaks`` reads the device's peak
allocated memory over measurement windows; a CPU has none to report (None, not a number).
Where a CPU run's memory is asked for (a benchmark of the memory model), ``TensorMemory``
counts the bytes of the tensors it allocates instead.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class Mark(Protocol):
    """A point in a device's work: what ``torch.cuda.Event`` offers for timing."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Mark) -> float: ...  # milliseconds, as CUDA's


class HostEvent:
    """A CUDA event's timing calls over the host's clock: the CPU's work is done when issued."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = float("nan")

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.at - self.at) * 1e3


class Clock:
    """Marks in ``device``'s work (the current stream on CUDA), read later as seconds.

    ``event`` makes the marks (a test's own; by default CUDA events on CUDA, else
    ``HostEvent``)."""

    __slots__ = ("_event",)

    def __init__(self, device: torch.device, *, event: Callable[[], Mark] | None = None) -> None:
        if event is None:
            event = (partial(torch.cuda.Event, enable_timing=True) if device.type == "cuda"
                     else HostEvent)
        self._event = event

    def mark(self) -> Mark:
        """Now, in the device's work: reached once what was issued before it has run."""
        event = self._event()
        event.record()
        return event

    @staticmethod
    def seconds(start: Mark, end: Mark) -> float:
        """The device's seconds from ``start`` to ``end`` (negative where ``end`` came first),
        once it has reached both (waited for here)."""
        start.synchronize()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


Span = tuple[Mark, Mark]


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has done what was issued to it (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MemoryPeaks:
    """A device's peak allocated memory, per measurement window and over the whole run.

    ``start`` opens a window (the device's peak statistic is reset; the run's peak keeps what
    came before); ``window`` reads the peak since then and ``run`` the peak since the first.
    On a CPU every reading is None."""

    __slots__ = ("device", "_before")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._before = 0  # the run's peak up to the open window

    def start(self) -> None:
        if self.device.type == "cuda":
            self._before = max(self._before, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)

    def window(self) -> int | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device)

    def run(self) -> int | None:
        window = self.window()
        return None if window is None else max(self._before, window)


class TensorMemory(TorchDispatchMode):
    """The bytes of CPU tensor storages alive, and their peak, counted as operators make them.

    A CPU has no allocator statistics such as CUDA's ``max_memory_allocated``. Under this mode
    (in the thread that enters it, and the autograd engine's work for it) every CPU tensor an
    operator returns is counted once per storage, from the operator that made it until the
    storage is freed; views share their base's count. Tensors made before ``__enter__``
    count once given to ``track``. What libraries allocate outside torch's operators
    (gloo's buffers, kernels' scratch space) is not counted. ``reset_peak`` starts a window:
    ``peak`` is the most alive at once since.

    Every operator goes through Python: worth it for a run that measures memory, not for one
    that measures time.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> its bytes, while it lives
        self._refs: dict[int, weakref.ref] = {}

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors`` (made before the mode was entered) from now on."""
        for t in tensors:
            self._count(t)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _count(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_sparse:
            return
        storage = t.untyped_storage()
        key, size = id(storage), storage.nbytes()
        known = self._sizes.get(key)
        if known is None:
            self._refs[key] = weakref.ref(storage, partial(self._freed, key))
        elif known == size:
            return
        self._sizes[key] = size
        self.live += size - (known or 0)
        self.peak = max(self.peak, self.live)

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._count(t)
        return out
