"""Regional compilation: each placement unit's computation compiled on its own, the way
torchtitan compiles each transformer block rather than the whole model.

One compiled function per unit class: ``Unit.compute``, taking the unit as its first argument.
Dynamo keeps its compiled code with that function, and inlines the unit's modules with their
parameters as inputs of the graph, so every unit of one shape runs the same compiled code: all
the decoder layers of a stage, and the layers a live switch brings to a rank, which compile
nothing that any unit of their shape compiled before. ``graphs`` counts what this process has
compiled, the report's measure of recompilation.

What a unit reads besides its hidden state and parameters (tokens, dropout masks, the position
embeddings) comes from ``Unit.inputs``, outside the compiled region, so a compiled unit draws
the same randomness as an eager one. Strict mode sets inductor's deterministic mode
(tidal_agent.devices.set_determinism), applied here as inductor is first imported.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Literal

import torch

log = logging.getLogger(__name__)

BACKEND = "inductor"
# Past this many graphs of one unit class dynamo would run it eagerly, with other bits: a job
# compiles one graph per shape, precision and unit kind it meets (loss heads of different
# weights are kinds).
RECOMPILE_LIMIT = 64
_COMPILED: dict[type, Callable] = {}


def enabled(setting: Literal["auto", "on", "off"], device: torch.device) -> bool:
    """Whether units compile: ``training.compile`` (auto: where the job trains on CUDA, and
    its torch can split a compiled unit's backward, :func:`splits_backward`)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda"
                               and splits_backward())


@functools.cache
def splits_backward() -> bool:
    """Whether this torch can take W from an edge into a compiled unit's backward node, as a
    split backward does (zero-bubble schedules, and every profile's calibration): a compiled
    unit's backward node is an ``autograd.Function``'s, whose input metadata torch 2.11's
    ``autograd.grad`` cannot read (seen on an H200: the profiled run failed); the pinned
    torch 2.13 reads it. Probed once a process on a one-operation Function, with no compile."""
    from torch.autograd.graph import GradientEdge

    weight = torch.ones(2, requires_grad=True)
    with torch.enable_grad():
        out = _Twice.apply(weight)
    try:
        (grad,) = torch.autograd.grad([GradientEdge(out.grad_fn, 0)], [weight],
                                      grad_outputs=[torch.ones(2)])
    except RuntimeError as err:
        log.warning("training.compile auto: units run eagerly: torch %s cannot split a "
                    "compiled unit's backward (%s)", torch.__version__, str(err)[:120])
        return False
    return bool(torch.equal(grad, torch.full((2,), 2.0)))


class _Twice(torch.autograd.Function):
    """``2 x``, as an ``autograd.Function`` (:func:`splits_backward`'s probe)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ARG004 - torch's signature
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return grad * 2


def compute(unit_type: type) -> Callable:
    """The compiled ``compute`` of ``unit_type``, called as ``compute(unit, h, *inputs)``."""
    found = _COMPILED.get(unit_type)
    if found is None:
        import torch._dynamo.config  # seconds to import: only where units compile
        import torch._functorch.config

        from tidal_agent.devices import inductor_config

        inductor_config()  # strict mode's settings (set_determinism), before any compiles

        # The split backward (I, then W from what I kept) runs a unit's backward graph with
        # retain_graph, which buffers donated to the backward would forbid.
        torch._functorch.config.donated_buffer = False
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
        # Static shapes: a graph's kernels, and so its bits, depend on its shapes alone, not
        # on which shapes the process met before (dynamic ones would be compiled for a shape
        # met second).
        found = _COMPILED[unit_type] = torch.compile(unit_type.compute, backend=BACKEND,
                                                     dynamic=False)
    return found


def graphs() -> int:
    """Graphs compiled in this process so far (each recompilation is one more)."""
    import torch._dynamo.utils

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
