"""One worker's share of a training job under a fixed layout.

The trainer owns the stage modules of its pipeline rank, the optimizer over their parameters and
the runtime that interprets the rank's action list; ``step`` runs one optimizer step and returns
the step loss, which every rank computes the same way in the same order.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from tidal_agent import compiled
from tidal_agent.data import BatchSource, PackedShards, SyntheticCorpus, TokenFile
from tidal_agent.measure import Clock
from tidal_agent.model import StageModule, UnitContext, global_parameter_names
from tidal_agent.optim import (
    ClipMode,
    GradientClip,
    GradientReducer,
    LogicalReplicaGradients,
    adamw_step,
    build_adamw,
    lr_at,
    tree_pairs,
)
from tidal_agent.runtime import PipelineRuntime
from tidal_agent.transport import recv, send
from tidal_agent.world import World
from tidal_api import JobSpec
from tidal_api.layout import Layout
from tidal_plan.dryrun import plan_step
from tidal_plan.elastic import logical_replicas, replica_subtrees
from tidal_plan.exchanges import exchange_plan, nccl_deadlock, nccl_order


def batch_source(spec: JobSpec) -> BatchSource:
    t, model = spec.training, spec.model
    if t.data.kind == "tokens":
        corpus = TokenFile(t.data.path, model.sample_len, t.seed, model.vocab)
    elif t.data.kind == "prepared":
        corpus = PackedShards(t.data.path, model.sample_len, t.seed, model.vocab,
                              t.global_batch_size)
    else:
        corpus = SyntheticCorpus(model.vocab, model.sample_len, t.seed)
    return BatchSource(corpus, t.micro_batch_size)


STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


class TiedGradients:
    """The gradient of a tied parameter held as two copies, ``first`` on the first stage and
    ``last`` on the last: both get ``first``'s gradient plus ``last``'s, added in that order
    wherever the stages are (one rank, or two that swap their halves), so the copies take the
    same steps and the bits do not depend on the layout."""

    def __init__(self, layout: Layout, replica: int, world: World,
                 params: dict[str, torch.nn.Parameter], *, first: str, last: str) -> None:
        self.world, self.first, self.last = world, params.get(first), params.get(last)
        ranks = [replica * layout.pp + layout.stage_rank(s) for s in (0, layout.num_stages - 1)]
        self.peer = ranks[1] if world.rank == ranks[0] else ranks[0]

    def sum(self) -> None:
        if self.first is not None and self.last is not None:
            total = self.first.grad + self.last.grad
        elif self.first is None and self.last is None:
            return
        else:
            mine = (self.first if self.first is not None else self.last).grad
            theirs = torch.empty_like(mine)
            # One group at both ends: posted one by one, both sends would wait for a receive
            # queued behind the other's send (NCCL).
            self.world.exchange([send(mine, self.peer), recv(theirs, self.peer)]).wait()
            total = mine + theirs if self.first is not None else theirs + mine
        for param in (self.first, self.last):
            if param is not None:
                param.grad.copy_(total)


def exchange_plans(pipeline: Layout) -> dict[int, list]:
    """Each pipeline rank's plan for one step of ``pipeline`` (one replica's): its lowered
    actions, the receives ordered as NCCL needs and each run of communication one group
    (tidal_plan.exchanges); refused where NCCL's rules would stop it, whatever the transport,
    so a layout that runs here runs on NCCL."""
    lowered = nccl_order(pipeline, plan_step(pipeline))
    plans = {rank: exchange_plan(actions) for rank, actions in lowered.items()}
    stuck = nccl_deadlock(pipeline, plans)
    if stuck is not None:
        raise ValueError(f"{pipeline.describe()}: {stuck}")
    return plans


def dp_world(world: World, layout: Layout) -> World | None:
    """The data-parallel group of this rank's pipeline rank under ``layout`` (None at dp 1),
    and the pairs its strict reduction needs: built once per world, by the world's builder
    ahead of a switch (``prepare_subgroups``)."""
    if layout.dp == 1:
        return None
    pp_rank = world.rank % layout.pp
    peers = tuple(world.members[r * layout.pp + pp_rank] for r in range(layout.dp))
    return world.subgroup(f"dp{pp_rank}", peers)


def prepare_subgroups(world: World, layout: Layout, strict: bool) -> None:
    """Build the subgroups a trainer of ``layout`` will use in ``world``, now."""
    group = dp_world(world, layout)
    if group is not None and strict and not layout.shares:
        tree_pairs(group)


def warm_up_compiled(spec: JobSpec, layout: Layout, pp_rank: int, device: torch.device) -> int:
    """Compile, now, what pipeline rank ``pp_rank`` of ``layout`` will run: a joiner does it in
    standby, so that the switch's first step compiles nothing. Returns the graphs compiled.

    One forward and backward of a micro-batch of zeros through throwaway copies of one unit
    of each kind the rank's stages hold (the first unit with a decoder layer after it where the
    stage starts at the embedding, and its loss units), uninitialised and dropped after:
    units of one shape share compiled code (tidal_agent.compiled), so the trainer's own units
    find theirs compiled. A model whose decoder layers differ (sliding and full attention)
    compiles the kinds not copied at its first step.
    """
    model, t = spec.model, spec.training
    before = compiled.graphs()
    tokens = torch.zeros((t.micro_batch_size, model.sample_len), dtype=torch.long, device=device)
    ctx = UnitContext(seed=t.seed, step=0, mb=0, device=device, load=lambda: tokens)
    first_loss = model.layers + 1
    for s in layout.rank_stages(pp_rank):
        units = layout.stage_units(s)
        pieces = [range(units.start, min(units.stop, max(units.start, 1) + 1))]
        if units.start >= first_loss:
            pieces = []
        if units.stop > first_loss:
            pieces.append(range(max(units.start, first_loss), units.stop))
        for piece in pieces:
            stage = StageModule(model, piece, t.seed, initialise=False, precision=t.precision,
                                checkpointing=layout.activation_checkpointing, compile=True,
                                empty_on=device)
            h = None if piece.start == 0 else torch.zeros(
                (t.micro_batch_size, model.seq_len, model.d_model), device=device,
                requires_grad=True)
            out, losses = stage(h, ctx)
            roots = [*losses, *([out] if piece.stop <= model.num_units - 1 else [])]
            torch.autograd.backward(roots, [torch.ones_like(r) if r.dim() == 0
                                            else torch.zeros_like(r) for r in roots])
    return compiled.graphs() - before


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float


class Trainer:
    def __init__(
        self,
        *,
        spec: JobSpec,
        layout: Layout,
        world: World,
        device: torch.device,
        clip_mode: ClipMode = ClipMode.GLOBAL_ORDER,
        initialise: bool = True,
        kept: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """This world rank's share of ``layout``: world rank = replica * pp + pipeline rank.

        With ``initialise=False`` the state (parameters, AdamW moments and step) is left
        uninitialised, for a trainer whose state is about to arrive from elsewhere (a
        checkpoint or a live reshard): it is allocated on ``device``, except the tensors of
        ``kept`` (a live switch's, named as in ``state_tensors``: what the old trainer holds
        and this one keeps), which it takes as they are and never allocates again.
        """
        if world.size != layout.world_size:
            raise ValueError(
                f"{layout.describe()} needs {layout.world_size} workers; the world has {world.size}"
            )
        self.spec, self.layout, self.world = spec, layout, world
        self.replica, self.pp_rank = divmod(world.rank, layout.pp)
        pp_rank = self.pp_rank
        model = spec.model
        if layout.num_units != model.num_units:
            raise ValueError(
                f"layout covers {layout.num_units} units; the model has {model.num_units}"
            )
        seed = spec.training.seed
        kept = kept or {}
        self.stages = {}
        self.compiled = compiled.enabled(spec.training.compile, device)
        for s in layout.rank_stages(pp_rank):
            stage = StageModule(
                model, layout.stage_units(s), seed, initialise=initialise,
                precision=spec.training.precision,
                checkpointing=layout.activation_checkpointing, compile=self.compiled,
                empty_on="meta",
            )
            if initialise:
                stage.to(device)
            else:
                _materialise(stage, device, kept)
            stage.layer_clock.clock = Clock(device)
            self.stages[s] = stage
        index = {name: i for i, name in enumerate(global_parameter_names(model))}
        self.num_params = len(index)
        named = [(n, p) for st in self.stages.values() for n, p in st.named_parameters()]
        self.indexed_params = [(index[n], p) for n, p in named]
        self.named_params = named
        self.optimizer = build_adamw(named, spec.training)
        if not initialise:  # state arrives from elsewhere: allocate it now, do not fill it
            for name, param in named:
                state = self.optimizer.state[param]
                for key in STATE_KEYS:
                    if f"{name}/{key}" in kept:
                        state[key] = kept[f"{name}/{key}"]
                    elif key == "step":
                        state[key] = adamw_step(param, fill=False)
                    else:
                        state[key] = torch.empty_like(param)
        self.plan = exchange_plans(layout.replica_pipeline(self.replica))[pp_rank]
        mbs, t = spec.training.micro_batch_size, model.seq_len
        self.runtime = PipelineRuntime(
            layout=layout,
            pp_rank=pp_rank,
            stages=self.stages,
            batches=batch_source(spec),
            seed=seed,
            world=world,
            group_ranks=[self.replica * layout.pp + r for r in range(layout.pp)],
            device=device,
            activation_shape=(mbs, t, model.d_model),
            replica=self.replica,
        )
        self.dp_world = dp_world(world, layout)
        # Strict consistency sums gradients over logical replicas in a fixed tree; relaxed
        # takes the backend's all-reduce over the physical ones.
        self.strict = spec.parallelism.consistency == "strict"
        self._logical: LogicalReplicaGradients | None = None
        self._reduce: GradientReducer | None = None  # built at the first step, state in place
        replicas = logical_replicas(spec) if self.strict else 1
        if self.strict and replicas == 1:  # a dp that never changes: its replicas are logical
            replicas = layout.dp
        if self.strict and replicas % layout.dp:
            raise ValueError(f"{layout.describe()}: dp {layout.dp} must divide the job's "
                             f"{replicas} logical replicas in strict mode")
        # Uneven shares end with several subtrees of the logical replicas' tree per replica.
        self._subtrees = (replica_subtrees(layout, replicas)
                          if self.strict and layout.shares else [])
        if replicas > layout.dp:  # one logical replica per physical one: nothing to take apart
            self._logical = LogicalReplicaGradients(
                self.runtime.stage_params,
                per_replica=spec.training.num_micro_batches // replicas,
                mb_offset=layout.replica_offset(self.replica),
            )
            self.runtime.on_gradients = self._logical.micro_batch_done
        self.device = device
        self._tied: TiedGradients | None = None
        uncounted: frozenset[int] = frozenset()
        if model.huggingface is not None:
            from tidal_agent import hf

            if hf.tied(model):
                self._tied = TiedGradients(layout, self.replica, world, dict(named),
                                           first=hf.embedding_name(model), last=hf.LM_HEAD)
                uncounted = frozenset({index[hf.LM_HEAD]})
        self._clip = GradientClip(self.indexed_params, self.num_params, world=world,
                                  contributes=self.replica == 0, mode=clip_mode,
                                  uncounted=uncounted)
        self._first_loss_unit = model.layers + 1
        self._num_loss_units = model.num_units - self._first_loss_unit
        self._loss_index: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}  # _loss_slots

    def step(self, step: int) -> StepResult:
        lr = lr_at(step, self.spec.training)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        profiler = self.runtime.profiler
        started = profiler.mark() if profiler is not None else None
        loss_values = self.runtime.run_step(step, self.plan)
        pipelined = profiler.mark() if profiler is not None else None
        if self._logical is not None and not self._subtrees:
            self._logical.finish()
        if self.dp_world is not None:
            if self._reduce is None:
                self._reduce = GradientReducer([p for _, p in self.named_params], self.dp_world,
                                               strict=self.strict, subtrees=self._subtrees)
            if self._subtrees:
                self._reduce.reduce_subtrees(self._logical.take())
            else:
                self._reduce()
        if self._tied is not None:
            self._tied.sum()
        grad_norm = self._clip(self.spec.training.grad_clip)
        optimizing = profiler.mark() if profiler is not None else None
        self.optimizer.step()
        if profiler is not None:
            profiler.optimizer_done(optimizing, profiler.mark())
        self.optimizer.zero_grad(set_to_none=True)
        loss, grad_norm = self._read_step(loss_values, grad_norm)
        if profiler is not None:
            profiler.step_done(started, pipelined, profiler.mark())
        return StepResult(step=step, loss=loss, grad_norm=grad_norm, lr=lr)

    def _read_step(self, loss_values: dict[tuple[int, int], list[torch.Tensor]],
                   grad_norm: torch.Tensor) -> tuple[float, float]:
        """The step loss and the gradient norm, read from the device together: the step's one
        host sync. The step loss is the sum of every loss unit's scaled loss, micro-batch-major,
        then over micro-batches, in float64: every rank fills its entries of one table on the
        device, and an all-reduce assembles it (each entry has one contributor)."""
        m_count = self.layout.num_micro_batches * self.layout.dp
        table = torch.zeros(m_count * self._num_loss_units, dtype=torch.float64,
                            device=self.device)
        values = [v for vs in loss_values.values() for v in vs]
        if values:  # a rank without loss units has none
            table.index_copy_(0, self._loss_slots(loss_values), torch.stack(values).double())
        self.world.all_reduce(table)
        *entries, norm = torch.cat([table, grad_norm.double().view(1)]).tolist()
        total = 0.0
        for value in entries:  # micro-batch-major, as the table is laid out
            total += value
        return total / m_count, norm

    def _loss_slots(self, loss_values: Mapping[tuple[int, int], list[torch.Tensor]]
                    ) -> torch.Tensor:
        """Where the loss values land in the flat table, in their order: made on the device
        once per order of (stage, micro-batch) the runtime ran (one a plan), as one made each
        step would be a copy from the host that waits for the device."""
        order = tuple(loss_values)
        if order not in self._loss_index:
            slots = []
            for stage, mb in order:
                units = [u for u in self.layout.stage_units(stage) if u >= self._first_loss_unit]
                slots += [mb * self._num_loss_units + u - self._first_loss_unit for u in units]
            self._loss_index[order] = torch.tensor(slots, device=self.device)
        return self._loss_index[order]

    def layer_seconds(self) -> float | None:
        """The median seconds of this rank's decoder-layer forwards since the last call (None:
        it ran none), for straggler detection; the clocks start again. The median, as a forward
        now and then pays for something else (a layer right after a wait runs on cold caches).
        On a GPU it waits for the layers timed: call it after the step's synchronisation."""
        seconds = []
        for stage in self.stages.values():
            seconds += stage.layer_clock.take()
        return statistics.median(seconds) if seconds else None

    def slow_down(self, factor: float) -> None:
        """A test's deterministic straggler: every layer forward of this rank lasts ``factor``
        times as long from now on (1: as it is)."""
        for stage in self.stages.values():
            stage.layer_clock.slowdown = factor

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's training state under global names: parameters and AdamW moments.

        Keys are ``name``, ``name/exp_avg``, ``name/exp_avg_sq`` and ``name/step``; values are the
        live tensors, so loading into them (a checkpoint, a reshard) sets the state in place.
        AdamW state that does not exist yet (before the first step) is created as zeros, which
        is what AdamW starts from anyway.
        """
        state: dict[str, torch.Tensor] = {}
        for name, param in self.named_params:
            state[name] = param.data
            opt = self.optimizer.state[param]
            if not opt:
                opt.update(
                    step=adamw_step(param),
                    exp_avg=torch.zeros_like(param, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(param, memory_format=torch.preserve_format),
                )
            for key in STATE_KEYS:
                state[f"{name}/{key}"] = opt[key]
        return state

    def profile_p2p(self, repeats: int = 5) -> dict[str, float] | None:
        """Ping-pong an activation between pipeline neighbours; one-way seconds (median).

        Every rank of the world calls it; pairs (r, r + 1) of each replica's pipeline take turns.
        """
        shape = self.runtime.activation_shape
        buf = torch.zeros(shape, device=self.device)
        result = None
        for first in range(self.layout.pp - 1):
            if self.pp_rank not in (first, first + 1):
                continue
            peer = self.runtime.group_ranks[first + 1 if self.pp_rank == first else first]
            times = []
            for i in range(repeats + 1):
                started = time.perf_counter()
                if self.pp_rank == first:
                    self.world.complete([send(buf, peer)])
                    self.world.complete([recv(buf, peer)])
                else:
                    self.world.complete([recv(buf, peer)])
                    self.world.complete([send(buf, peer)])
                if i:  # the first exchange sets the connection up
                    times.append((time.perf_counter() - started) / 2)
            if self.pp_rank == first:
                result = {"bytes": buf.numel() * buf.element_size(),
                          "seconds": statistics.median(times)}
        self.world.barrier()
        return result

    def offload(self, names: Iterable[str]) -> None:
        """Move the state tensors ``names`` (named as in ``state_tensors``) to host memory,
        freeing their device memory: an old trainer's state that leaves in a live switch waits
        there to be sent (a no-op on a CPU)."""
        params = dict(self.named_params)
        for key in names:
            name, _, entry = key.partition("/")
            if entry:
                state = self.optimizer.state[params[name]]
                state[entry] = state[entry].cpu()
            else:
                params[name].data = params[name].data.cpu()
        self._reduce = None  # its gradient buffer: no step follows

    def parameter_digests(self) -> dict[int, tuple[str, str]]:
        """sha256 of each local parameter's bytes, keyed by global index."""
        out = {}
        for (index, p), (name, _) in zip(self.indexed_params, self.named_params, strict=True):
            data = p.detach().cpu().contiguous().numpy().view(np.uint8)
            out[index] = (name, hashlib.sha256(data.tobytes()).hexdigest())
        return out


def _materialise(module: torch.nn.Module, device: torch.device,
                 kept: Mapping[str, torch.Tensor]) -> None:
    """Give ``module``'s parameters and buffers (on the meta device) memory on ``device``: a
    parameter the tensor ``kept`` holds under its name, as it is; the others uninitialised."""
    for name, param in list(module.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        data = kept[name] if name in kept else torch.empty_like(param, device=device)
        module.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(
            data, requires_grad=param.requires_grad)
    for name, buffer in list(module.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = torch.empty_like(buffer, device=device)


def params_sha256(digests: dict[int, tuple[str, str]], num_params: int) -> str:
    """One hash over every parameter's digest, in global order; all must be present, and none
    past ``num_params``."""
    missing = [i for i in range(num_params) if i not in digests]
    if missing:
        raise ValueError(f"parameters missing from the digests: global indices {missing[:5]}")
    if extra := sorted(i for i in digests if not 0 <= i < num_params):
        raise ValueError(f"digests of {len(extra)} parameters past the model's {num_params}: "
                         f"global indices {extra[:5]}")
    h = hashlib.sha256()
    for index in range(num_params):
        name, digest = digests[index]
        h.update(f"{name} {digest}\n".encode())
    return h.hexdigest()
