"""The optimizer's pieces hold the determinism contract whatever a layout groups: fused AdamW
updates each tensor alone, its step lives where torch's fused kernel keeps it, and the clip
reduces the per-tensor norms in global order without reading the device."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from tidal_agent.optim import ClipMode, GradientClip, adamw_step, build_adamw
from tidal_agent.transport import Transport
from tidal_agent.world import Rendezvous, World
from tidal_api import TrainingSpec

TRAINING = TrainingSpec()  # weight decay on the matrices


def _tensors() -> dict[str, torch.Tensor]:
    """Sizes that end in a partial vector (the kernels' scalar tails) and one that does not."""
    gen = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(37, 5, generator=gen),
            "b.bias": torch.randn(13, generator=gen),
            "c.weight": torch.randn(64, 16, generator=gen)}


def _train(groupings: list[list[str]], steps: int = 4) -> dict[str, torch.Tensor]:
    """The same parameters and gradients, stepped by one ``build_adamw`` per grouping."""
    params = {name: torch.nn.Parameter(t.clone()) for name, t in _tensors().items()}
    optimizers = [build_adamw([(n, params[n]) for n in names], TRAINING) for names in groupings]
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for name, p in params.items():
            p.grad = torch.randn(p.shape, generator=gen)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = TRAINING.lr / (step + 1)
            opt.step()
    out = {}
    for opt in optimizers:
        for name in (n for names in groupings for n in names):
            p = params[name]
            if p in opt.state:
                out[name] = p.detach().clone()
                out |= {f"{name}/{key}": t.clone() for key, t in opt.state[p].items()}
    return out


def test_a_tensors_adamw_update_does_not_depend_on_how_the_tensors_are_grouped():
    together = _train([["a.weight", "b.bias", "c.weight"]])
    apart = _train([["a.weight"], ["c.weight", "b.bias"]])
    assert together.keys() == apart.keys() and len(together) == 3 * 4
    for name, t in together.items():  # the bits, not the values: -0.0 and NaNs count
        assert torch.equal(t.view(torch.int32), apart[name].view(torch.int32)), name
    assert not torch.equal(together["a.weight"], _tensors()["a.weight"])  # it did train


def test_the_adamw_step_is_made_where_fused_adamw_keeps_it():
    param = torch.nn.Parameter(torch.ones(3, 2))
    param.grad = torch.ones(3, 2)
    opt = build_adamw([("w", param)], TRAINING)
    opt.step()
    torch_made, ours = opt.state[param]["step"], adamw_step(param)
    assert (ours.dtype, ours.device, ours.shape) == (torch_made.dtype, torch_made.device,
                                                     torch_made.shape)
    assert opt.param_groups[0]["fused"] and not opt.param_groups[0]["foreach"]


def _world() -> World:
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    return World(generation=0, members=("w0",), rank=0,
                 transport=Transport(pg, torch.device("cpu"), 10.0), store=dist.HashStore(),
                 rendezvous=Rendezvous(host="127.0.0.1", port=0, prefix="t/"), cpu=pg)


def _clipped(mode: ClipMode, max_norm: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = [torch.nn.Parameter(t) for t in _tensors().values()]
    for p in params:
        p.grad = p.detach() * 3
    # Global indices out of local order, one of them a tied copy left out of the norm.
    clip = GradientClip(list(zip((4, 0, 2), params, strict=True)), 6, world=_world(), mode=mode,
                        uncounted=frozenset({2}))
    return clip(max_norm), [p.grad for p in params]


def test_the_clip_reduces_per_tensor_norms_in_global_order_and_leaves_the_norm_on_device():
    norm, grads = _clipped(ClipMode.GLOBAL_ORDER, 1.0)
    tensors = list(_tensors().values())
    vector = torch.zeros(6)
    vector[4], vector[0] = (torch.linalg.vector_norm(t * 3) for t in tensors[:2])
    expected = torch.linalg.vector_norm(vector)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0  # nothing read to the host
    assert torch.equal(norm.view(torch.int32), expected.view(torch.int32))
    coef = torch.clamp(1.0 / (expected + 1e-6), max=1.0)
    for grad, t in zip(grads, tensors, strict=True):  # every tensor scaled, the tied copy too
        assert torch.equal(grad, (t * 3).mul_(coef))
    naive, _ = _clipped(ClipMode.NAIVE, 0.0)  # per-stage squares: the same sum of two squares
    assert torch.allclose(naive, expected)
