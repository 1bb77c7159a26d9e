"""The pipeline runtime: a plain interpreter of one rank's lowered action list.

It knows nothing about schedules. Every stage is its own autograd island: a stage's input is a
leaf tensor (received, or handed over locally when the previous stage sits on the same rank),
and its backward yields the gradient of that leaf. Parameter gradients accumulate into ``.grad``
in the order the backward actions run, which every schedule keeps in micro-batch order. The
split backward (I then W) is torch.distributed.pipelining's (``stage_backward_input`` and
``stage_backward_weight``, private helpers of the pinned torch): W starts from the gradients
I captured rather than running the backward again, and computes the same numbers as a fused B
(the zero-bubble cases of the bitwise tests check it).

Communication is point-to-point and keeps NCCL's rules whatever the transport: the rank's
plan (tidal_plan.exchanges) groups each run of consecutive SENDs and RECVs into one exchange,
posted at once without waiting; a receive is waited for when the consuming compute action
runs, the sends at the step's end. Messages carry no tag: the transport matches them in
posting order, and the plan orders both ends of every pair alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal_agent.data import BatchSource
from tidal_agent.model import StageModule, UnitContext
from tidal_agent.profiler import UnitProfiler
from tidal_agent.world import World
from tidal_api.layout import Layout
from tidal_agent.transport import P2P, Posted
from tidal_plan.exchanges import Step, peer_stage
from tidal_plan.ir import Action, Kind


def split_backward() -> Any:
    """torch.distributed.pipelining's ``_backward`` module, imported at its first use: the
    package imports dynamo and DTensor, three to seven seconds of every agent process's start,
    and only zero-bubble schedules split a backward."""
    from torch.distributed.pipelining import _backward

    return _backward

@dataclass(slots=True)
class _StepState:
    """Tensors in flight during one step, keyed by (stage, micro-batch)."""

    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    losses: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    grad_outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    roots: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=dict
    )
    # Per (stage, mb): the gradients I captured at the weight-consuming nodes, for W.
    weight_groups: dict[tuple[int, int], list[dict]] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    pending: dict[tuple[Kind, int, int], tuple[Posted, torch.Tensor]] = field(
        default_factory=dict
    )
    sends: list[tuple[Posted, list[torch.Tensor]]] = field(default_factory=list)
    loss_values: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)


class PipelineRuntime:
    """Runs the actions of one pipeline rank for one training step at a time."""

    def __init__(
        self,
        *,
        layout: Layout,
        pp_rank: int,
        stages: dict[int, StageModule],
        batches: BatchSource,
        seed: int,
        world: World,
        group_ranks: list[int],
        device: torch.device,
        activation_shape: tuple[int, ...],
        replica: int = 0,
    ) -> None:
        # The pipeline of this data-parallel replica: its own micro-batch count.
        self.layout, self.pp_rank, self.stages = layout.replica_pipeline(replica), pp_rank, stages
        self.batches, self.seed, self.device = batches, seed, device
        self.world = world
        self.group_ranks = group_ranks  # world rank of each pipeline rank of this replica
        self.activation_shape = activation_shape
        # This replica's micro-batch m is micro-batch mb_offset + m of the global batch.
        self.mb_offset = layout.replica_offset(replica)
        self.loss_scale = 1.0 / layout.global_micro_batches
        self.profiler: UnitProfiler | None = None  # set for the steps that are profiled
        # Called as (stage, micro-batch) once a micro-batch's parameter gradients are in .grad.
        self.on_gradients: Callable[[int, int], None] | None = None
        # Parameter objects never change (a reshard swaps their data), so list them once.
        self.stage_params = {s: list(m.parameters()) for s, m in stages.items()}
        self._handlers = {
            Kind.F: self._forward,
            Kind.B: self._backward_full,
            Kind.I: self._backward_input,
            Kind.W: self._backward_weight,
        }

    # -- step -----------------------------------------------------------------------------

    def run_step(self, step: int, plan: list[Step]) -> dict[tuple[int, int], list[torch.Tensor]]:
        """Run one step's plan (compute actions and groups of communication actions); return
        the loss values of this rank's loss units.

        Keys are (stage, global micro-batch), in the order the forwards ran; values are the
        scaled losses of the stage's loss units in unit order, detached 0-d tensors on the device
        (reading them is the caller's one host sync). Parameter gradients are left accumulated
        in ``.grad``.
        """
        self._step, self._state = step, _StepState()
        profiler = self.profiler
        for item in plan:
            started = profiler.mark() if profiler is not None else None
            if isinstance(item, Action):
                self._handlers[item.kind](item)
                if profiler is not None:
                    profiler.action_done(item, started, profiler.mark())
                continue
            self._post(item)
            if profiler is not None:  # the group's posting, shared among its actions
                ended = profiler.mark()
                for action in item:
                    profiler.action_done(action, started, ended, share=1 / len(item))
        for posted, _ in self._state.sends:
            posted.wait()
        values = {(s, self.mb_offset + m): vs for (s, m), vs in self._state.loss_values.items()}
        self._state = _StepState()
        return values

    # -- compute --------------------------------------------------------------------------

    def _context(self, mb: int) -> UnitContext:
        step, device, mb = self._step, self.device, self.mb_offset + mb

        def load() -> torch.Tensor:
            return self.batches.micro_batch(step, mb).to(device, non_blocking=True)

        return UnitContext(seed=self.seed, step=step, mb=mb, device=device, load=load)

    def _forward(self, action: Action) -> None:
        s, m = action.stage, action.mb
        st = self._state
        x = None
        if s > 0:
            x = self._take_received(Kind.RECV_F, s, m, st.inputs)
            x.requires_grad_(True)
            st.inputs[(s, m)] = x
        if self._hooked() is not None:
            out, losses = self.profiler.forward(s, m, self.stages[s], x, self._context(m))
        else:
            out, losses = self.stages[s](x, self._context(m))
        st.losses[(s, m)] = losses
        st.loss_values[(s, m)] = [loss.detach() for loss in losses]
        if s + 1 < self.layout.num_stages:
            st.outputs[(s, m)] = out
            if self.layout.stage_rank(s + 1) == self.pp_rank:
                st.inputs[(s + 1, m)] = out.detach()

    def _roots(self, s: int, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Backward roots of (s, m) and their gradients: the scaled losses and the output."""
        st = self._state
        if (s, m) not in st.roots:
            losses = st.losses[(s, m)]
            roots = list(losses)
            grads = [torch.full((), self.loss_scale, device=self.device) for _ in losses]
            if (s, m) in st.outputs:
                roots.append(st.outputs[(s, m)])
                grads.append(self._take_received(Kind.RECV_B, s, m, st.grad_outputs))
            st.roots[(s, m)] = (roots, grads)
        return st.roots[(s, m)]

    def _hooked(self) -> UnitProfiler | None:
        """The profiler while its unit hooks are on (the first profiled step), else None."""
        return self.profiler if self.profiler is not None and self.profiler.hooks else None

    def _backward_full(self, action: Action) -> None:
        s, m = action.stage, action.mb
        hooked = self._hooked()
        if hooked is not None and (s, m) in self._state.inputs:
            # Profiling measures I and W apart; the split computes the same bits as B.
            self._backward_input(Action(s, Kind.I, m))
            self._backward_weight(Action(s, Kind.W, m))
            return
        roots, grads = self._roots(s, m)
        x = self._state.inputs.get((s, m))
        started = hooked.mark() if hooked is not None else None
        # The engine accumulates parameter gradients into .grad (mb order = call order) and
        # leaves the input gradient in x.grad.
        torch.autograd.backward(roots, grads)
        if hooked is not None:  # the first stage: I and W together
            hooked.input_grad_done(s, m, started, hooked.mark())
        if x is not None:
            self._input_grad_done(s, m, x.grad)
        self._release(s, m)

    def _backward_input(self, action: Action) -> None:
        s, m = action.stage, action.mb
        x = self._state.inputs.get((s, m))
        if x is None:  # the first stage has no input gradient; W does all its work
            return
        roots, grads = self._roots(s, m)
        hooked = self._hooked()
        started = hooked.mark() if hooked is not None else None
        # torch's split backward: the input gradient now, with the gradients reaching the
        # weight-consuming nodes kept so W need not run the backward again.
        (gx,), groups = split_backward().stage_backward_input(roots, grads, [x],
                                                              iter(self._params(s)))
        if hooked is not None:
            hooked.input_grad_done(s, m, started, hooked.mark())
        self._state.weight_groups[(s, m)] = groups
        self._input_grad_done(s, m, gx)

    def _backward_weight(self, action: Action) -> None:
        s, m = action.stage, action.mb
        groups = self._state.weight_groups.pop((s, m), None)
        hooked = self._hooked()
        started = hooked.mark() if hooked is not None else None
        if groups is None:
            roots, grads = self._roots(s, m)
            torch.autograd.backward(roots, grads, inputs=self._params(s))
            if hooked is not None:  # the first stage: I and W
                hooked.input_grad_done(s, m, started, hooked.mark())
        else:
            split_backward().stage_backward_weight(iter(self._params(s)), groups)
            if hooked is not None:
                hooked.weight_grad_done(s, started, hooked.mark())
        self._release(s, m)

    def _input_grad_done(self, s: int, m: int, gx: torch.Tensor) -> None:
        if self.layout.stage_rank(s - 1) == self.pp_rank:
            self._state.grad_outputs[(s - 1, m)] = gx
        else:
            self._state.input_grads[(s, m)] = gx

    def _params(self, s: int) -> list[torch.nn.Parameter]:
        return self.stage_params[s]

    def _release(self, s: int, m: int) -> None:
        st = self._state
        for store in (st.inputs, st.outputs, st.losses, st.grad_outputs, st.roots):
            store.pop((s, m), None)
        if self.on_gradients is not None:
            self.on_gradients(s, m)

    # -- communication --------------------------------------------------------------------

    def _post(self, group: tuple[Action, ...]) -> None:
        """Post a group of SENDs and RECVs as one exchange."""
        st, ops, sent, received = self._state, [], [], []
        for action in group:
            s, m = action.stage, action.mb
            peer = self.group_ranks[self.layout.stage_rank(peer_stage(action))]
            if action.kind is Kind.SEND_F:
                tensor = st.outputs[(s, m)].detach().contiguous()
            elif action.kind is Kind.SEND_B:
                tensor = st.input_grads.pop((s, m)).contiguous()
            else:
                tensor = torch.empty(self.activation_shape, device=self.device)
                received.append((action, tensor))
                ops.append(P2P(False, tensor, peer))
                continue
            sent.append(tensor)
            ops.append(P2P(True, tensor, peer))
        posted = self.world.exchange(ops)
        for action, tensor in received:
            st.pending[(action.kind, action.stage, action.mb)] = (posted, tensor)
        if sent:
            st.sends.append((posted, sent))  # the tensors live until the sends are done

    def _take_received(self, kind: Kind, s: int, m: int, local: dict) -> torch.Tensor:
        """The tensor for (s, m): from a posted receive, else handed over on this rank."""
        posted = self._state.pending.pop((kind, s, m), None)
        if posted is not None:
            exchange, buf = posted
            if self.profiler is None:
                exchange.wait()
            else:  # on a GPU: how long the device's work stood waiting for the data
                started = self.profiler.mark()
                exchange.wait()
                self.profiler.waited(started, self.profiler.mark())
            return buf
        try:
            return local.pop((s, m))
        except KeyError:
            raise RuntimeError(
                f"stage {s} micro-batch {m}: no {kind.value} posted and no local hand-over; "
                "the action list is not a valid lowering"
            ) from None
