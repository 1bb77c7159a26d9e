"""GPU work measured as such, checked on the CPU through the same code: device marks read
later, a step that reads the device once, calibration on the run's own modules, a switch that
allocates only what arrives, and peer snapshots whose host memory does not grow."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from tests.commands import TINY
from tidal_agent.measure import Clock, HostEvent, MemoryPeaks, TensorMemory
from tidal_agent.transport import Transport
from tidal_agent.world import Rendezvous, World
from tidal_api import parse_job
from tidal_api.layout import Layout


class _Recorded(HostEvent):
    """A host event that says when it was waited for and read, as a CUDA event would need."""

    log: list[str] = []

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def elapsed_time(self, end: HostEvent) -> float:
        assert self.log and self.log[-1] == "synchronize", "read before the device got there"
        self.log.append("read")
        return super().elapsed_time(end)


@pytest.fixture
def recorded():
    _Recorded.log = []
    return Clock(torch.device("cpu"), event=_Recorded)


def test_the_cpu_clock_times_the_host_and_a_cpu_has_no_gpu_memory_to_report():
    clock = Clock(torch.device("cpu"))
    start = clock.mark()
    torch.ones(64, 64) @ torch.ones(64, 64)
    assert 0.0 <= Clock.seconds(start, clock.mark()) < 60
    peaks = MemoryPeaks(torch.device("cpu"))
    peaks.start()
    assert peaks.window() is None and peaks.run() is None


def test_a_mark_is_read_only_after_waiting_for_it(recorded):
    start = recorded.mark()
    end = recorded.mark()
    assert _Recorded.log == []  # marking never waits
    assert Clock.seconds(start, end) >= 0.0
    assert _Recorded.log == ["synchronize", "synchronize", "read"]


def _spec():
    """The tiny job with two micro-batches a step."""
    doc = yaml.safe_load(TINY.read_text())
    doc["spec"]["training"]["globalBatchSize"] = 4
    return parse_job(doc).spec


def _cpu(pg) -> Transport:
    return Transport(pg, torch.device("cpu"), 10.0)


def _world(members: tuple[str, ...] = ("w0",), rank: int = 0) -> World:
    """A world whose group is this process alone: enough to build a trainer (and to step one
    of a single member)."""
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    return World(generation=0, members=members, rank=rank, transport=_cpu(pg),
                 store=dist.HashStore(),
                 rendezvous=Rendezvous(host="127.0.0.1", port=0, prefix="t/"), cpu=pg)


def _layout(spec, partition: tuple[int, ...]) -> Layout:
    return Layout(pp=len(partition), partition=partition, micro_batch_size=2,
                  num_micro_batches=spec.training.global_batch_size // 2)


def _trainer(spec, partition=(8,), **kwargs):
    from tidal_agent.trainer import Trainer

    return Trainer(spec=spec, layout=_layout(spec, partition),
                   world=kwargs.pop("world", None) or _world(), device=torch.device("cpu"),
                   **kwargs)


def test_a_profiled_step_marks_the_device_and_reads_the_marks_only_when_gathered(recorded):
    from tidal_agent.profiler import UnitProfiler

    trainer = _trainer(_spec())
    trainer.step(0)
    for hooks in (True, False):
        trainer.runtime.profiler = profiler = UnitProfiler(recorded)
        profiler.hooks = hooks
        trainer.step(1)
        assert _Recorded.log == []  # nothing waited for the device during the step
        if hooks:
            units = profiler.units()
            assert sorted(units) == list(range(8))
            assert all(u["forward_s"] > 0 and u["input_grad_s"] >= 0 for u in units.values())
        else:
            assert {"F", "B"} <= profiler.actions().keys()
            assert profiler.step_parts[0]["pipeline_s"] > 0 and profiler.optimizer_s[0] > 0
        assert 2 * _Recorded.log.count("read") == _Recorded.log.count("synchronize") > 0
        _Recorded.log.clear()


class _ScalarReads(TorchDispatchMode):
    """Counts the reads of one value back to the host (``float(t)``, ``t.item()``): on a GPU,
    each waits for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ == "_local_scalar_dense"
        return func(*args, **(kwargs or {}))


def test_a_step_reads_its_loss_and_norm_back_once_not_value_by_value():
    trainer = _trainer(_spec())
    trainer.step(0)
    with _ScalarReads() as reads:
        result = trainer.step(1)  # its one read (a table's tolist) goes round the dispatcher
    assert reads.count == 0
    assert result.loss > 0 and result.grad_norm > 0


def test_the_layer_clock_keeps_spans_until_taken(recorded):
    trainer = _trainer(_spec())
    for stage in trainer.stages.values():
        stage.layer_clock.clock = recorded
    trainer.step(0)
    assert _Recorded.log == []
    seconds = trainer.layer_seconds()
    assert seconds is not None and seconds > 0
    assert _Recorded.log.count("read") == 6 * 2  # 6 layers, 2 micro-batches
    assert trainer.layer_seconds() is None  # taken: the clock starts again


def _bits(trainer) -> dict[str, str]:
    """Every state tensor's and gradient's bytes, hashed."""
    out = {}
    for name, tensor in trainer.state_tensors().items():
        out[name] = hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()
    for name, param in trainer.named_params:
        if param.grad is not None:
            out[f"{name}/grad"] = hashlib.sha256(param.grad.numpy().tobytes()).hexdigest()
    return out


def test_calibration_runs_on_the_stage_itself_and_leaves_every_bit_of_the_run():
    from tidal_agent.calibrate import calibrate_trainer

    trainer = _trainer(_spec())
    trainer.step(0)
    trainer.step(1)
    # A gradient held across the boundary too (calibration sets it aside, not copies it).
    param = trainer.named_params[0][1]
    param.grad = torch.full_like(param, 0.25)
    grad = param.grad
    before = _bits(trainer)
    objects = {name: t for name, t in trainer.state_tensors().items()}
    out = calibrate_trainer(trainer, repeats=1)
    assert _bits(trainer) == before
    assert param.grad is grad
    assert all(objects[name] is t for name, t in trainer.state_tensors().items()
               if "/" in name)  # the AdamW state: the same tensors
    [stage] = out
    assert sorted(stage["units"]) == list(range(8)) and stage["stage"] is not None
    assert all(t > 0 for t in stage["units"][1]["forward"])


class _Allocations(TorchDispatchMode):
    """Bytes of the tensors that factory ops allocate off the meta device."""

    FACTORIES = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones",
                 "ones_like", "full", "full_like", "randn", "rand"}

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.FACTORIES and isinstance(out, torch.Tensor) \
                and out.device.type != "meta":
            self.bytes += out.numel() * out.element_size()
        return out


def test_a_switch_allocates_only_the_state_that_arrives():
    from tidal_agent.snapshot import state_index
    from tidal_agent.switch import carry_over, state_metadata
    from tidal_plan.reshard import Placement, plan_reshard

    spec = _spec()
    metas = state_metadata(spec.model)
    # w0 ran units 0-3 of a two-stage pipeline; alone now, it keeps those and receives 4-7.
    old = _trainer(spec, partition=(4, 4), world=_world(("w0", "w1")))
    before = {name: t for name, t in old.state_tensors().items()}
    new_layout = _layout(spec, (8,))
    plan = plan_reshard(Placement(layout=old.layout, workers=("w0", "w1")),
                        Placement(layout=new_layout, workers=("w0",)), metas)
    holds = state_index(metas, Placement(layout=new_layout, workers=("w0",)), "w0")
    kept = carry_over(plan, "w0", old, holds)
    assert set(kept) == set(before)  # everything w0 held stays with it
    with _Allocations() as allocations:
        new = _trainer(spec, partition=(8,), initialise=False, kept=kept)
    arriving = sum(t.nbytes for t in plan.transfers if t.dst == "w0")
    assert arriving > 0
    assert allocations.bytes == arriving  # the kept state is not allocated a second time
    state = new.state_tensors()
    assert all(state[name] is t or state[name].data_ptr() == t.data_ptr()
               for name, t in before.items())


def _snapshot_world(generation: int, pgs, rank: int) -> World:
    return World(generation=generation, members=("w0", "w1"), rank=rank,
                 transport=_cpu(pgs[rank]),
                 store=dist.HashStore(),
                 rendezvous=Rendezvous(host="127.0.0.1", port=0, prefix="t/"),
                 name=f"gen{generation}", cpu=pgs[rank])


def test_snapshot_host_memory_is_reported_and_does_not_grow_across_generations():
    import threading

    from tidal_agent.snapshot import PeerSnapshots
    from tidal_plan.reshard import TensorMeta

    metas = [TensorMeta(name=f"u{u}", numel=100 * (u + 1), unit=u, itemsize=4)
             for u in range(4)]
    # Two layouts of two members, the state shifting between them: w0 holds 1 or 3 units.
    layouts = [Layout(pp=2, partition=p, micro_batch_size=1, num_micro_batches=2)
               for p in ((1, 3), (3, 1))]
    store = dist.HashStore()
    pgs: list = [None, None]

    def connect(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))

    threads = [threading.Thread(target=connect, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held: dict[int, list[dict[str, int]]] = {0: [], 1: []}
    errors = []

    def member(rank: int) -> None:
        try:
            snapshots = PeerSnapshots(metas, torch.device("cpu"), every=1)
            step = 0
            for generation in range(6):  # a switch between the two layouts every 2 steps
                world = _snapshot_world(generation, pgs, rank)
                layout = layouts[generation % 2]
                names = [m.name for m in metas
                         if (m.unit < layout.partition[0]) == (rank == 0)]
                state = {n: torch.full((next(m.numel for m in metas if m.name == n),),
                                       float(step)) for n in names}
                for _ in range(2):
                    snapshots.take(world, generation, layout, step, state)
                    step += 1
                snapshots.settle()
                held[rank].append(snapshots.host_bytes())
            assert snapshots.peak_bytes["pageable"] >= max(h["pageable"] for h in held[rank])
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for rank in range(2):
        assert all(h["pinned"] == 0 for h in held[rank])  # a CPU's state: nothing to pin
        # After the first switch back and forth, no generation adds host memory.
        assert len({h["pageable"] for h in held[rank][1:]}) == 1
        largest = max(sum(m.numel for m in metas[:3]), sum(m.numel for m in metas[1:]))
        assert held[rank][-1]["pageable"] <= 4 * largest * 4


def test_tensor_memory_counts_each_storage_once_until_it_is_freed():
    with TensorMemory() as memory:
        x = torch.zeros(1000)  # 4000 bytes
        view = x[10:]
        x.add_(1)  # in place: the same storage
        assert memory.live == memory.peak == 4000
        y = x * 2
        assert memory.live == 8000
        del x, view, y
        assert memory.live == 0 and memory.peak == 8000
        memory.reset_peak()
        z = torch.ones(10)
        assert memory.peak == 40
        old = torch.nn.Parameter(torch.ones(3))
    memory.track([old])
    assert memory.live == 40 + 12
    del z


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_memory_model_counts_what_the_trainers_units_keep(family, precision):
    """tidal_plan.modelshape's count of what each unit keeps for its backward, against the
    bytes the unit's forward leaves allocated (everything but its input: the unit before
    made that) on the CPU, under the trainer's precision."""
    from tidal_agent.model import StageModule, UnitContext
    from tidal_plan.modelshape import ModelShape, unit_activation_bytes

    model = {"layers": 2, "dModel": 64, "heads": 4, "vocab": 96, "seqLen": 32}
    if family == "llama":
        model["huggingface"] = {"config": {
            "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
            "intermediate_size": 176, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 96, "max_position_embeddings": 32}}
    spec = parse_job({"apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob",
                      "metadata": {"name": "m"},
                      "spec": {"workers": {"min": 1, "max": 1}, "model": model,
                               "training": {"globalBatchSize": 2, "microBatchSize": 2,
                                            "precision": precision}}}).spec
    shape, a = ModelShape.of(spec.model), 2 if precision == "bf16" else 4
    tokens = torch.randint(0, 96, (2, 33))
    ctx = UnitContext(seed=0, step=0, mb=0, device=torch.device("cpu"), load=lambda: tokens)
    with TensorMemory() as memory:
        stage = StageModule(spec.model, range(spec.model.num_units), 0, precision=precision)
        stage(None, ctx)  # a first forward makes what every later one shares (rotary tables)
        # as the runtime: each micro-batch loads its tokens, which its embedding keeps
        ctx = UnitContext(seed=0, step=0, mb=1, device=torch.device("cpu"),
                          load=tokens.clone)
        h = None
        for unit in stage.ordered_units:
            before = memory.live
            h, loss = stage.run_unit(unit, h, ctx)
            if unit.index == spec.model.num_units - 1:
                del h  # the runtime keeps no output of the model's last unit
            kept = memory.live - before
            # rel: the built-in embedding also keeps its position ids, seq_len of them
            assert kept == pytest.approx(unit_activation_bytes(shape, unit.index, 2, a),
                                         rel=0.02), unit.index
