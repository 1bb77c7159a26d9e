"""Where workers compute and how they talk: the choice (for any GPU count, without a GPU), a
GPU bound by the environment, and strict mode's determinism settings."""

import os
import subprocess
import sys

import pytest
import torch
import torch._inductor.config as inductor
import torch.utils.deterministic

from tests.commands import TINY
from tidal_agent.cli import load_job
from tidal_agent import devices
from tidal_agent.devices import bind_gpu, plan_device, set_determinism, strict_settings
from tidal_agent.pod import pod_transport
from tidal_plan.gpus import DeviceChoiceError, Devices, choose_devices


# ---- the choice ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "transport", "gpus", "workers", "chosen"), [
    ("auto", "auto", 0, 3, Devices(transport="gloo")),
    ("auto", "auto", 2, 2, Devices(transport="nccl", gpus=2)),
    ("auto", "host", 1, 4, Devices(transport="host", gpus=1)),
    ("auto", "nccl-model", 8, 3, Devices(transport="nccl-model")),  # a CPU transport
    ("auto", "gloo", 8, 3, Devices(transport="gloo")),
    ("cpu", "auto", 8, 3, Devices(transport="gloo")),
    ("cuda", "auto", 4, 4, Devices(transport="nccl", gpus=4)),
    ("cuda", "host", 2, 5, Devices(transport="host", gpus=2)),
])
def test_device_and_transport_follow_what_is_asked_and_the_gpus(device, transport, gpus,
                                                                workers, chosen):
    assert choose_devices(device, transport, gpus=gpus, workers=workers) == chosen


@pytest.mark.parametrize(("device", "transport", "gpus", "workers", "message"), [
    ("cuda", "auto", 1, 3, "3 workers need 3 GPUs over nccl (one rank per GPU; a schedule's "
                           "joiners start with the others) and 1 is visible: use --transport "
                           "host to share them, or fewer workers"),
    ("auto", "auto", 2, 3, "and 2 are visible: use --transport host"),
    ("cpu", "nccl", 1, 1, "transport nccl computes on cuda, not cpu: on cpu use transport gloo "
                          "or nccl-model"),
    ("cpu", "host", 1, 1, "transport host computes on cuda, not cpu"),
    ("cuda", "gloo", 1, 1, "transport gloo computes on cpu, not cuda: on cuda use transport "
                           "nccl or host"),
    ("cuda", "nccl-model", 1, 1, "transport nccl-model computes on cpu, not cuda"),
    ("cuda", "auto", 0, 1, "transport nccl computes on CUDA and no GPU is visible: use device "
                           "cpu (transport gloo)"),
    ("auto", "host", 0, 1, "transport host computes on CUDA and no GPU is visible"),
    ("tpu", "auto", 0, 1, "unknown device 'tpu': use auto, cpu or cuda"),
    ("auto", "mpi", 0, 1, "unknown transport 'mpi'"),
])
def test_what_cannot_run_is_one_line_that_says_what_to_use(device, transport, gpus, workers,
                                                            message):
    with pytest.raises(DeviceChoiceError) as caught:
        choose_devices(device, transport, gpus=gpus, workers=workers)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_gpus_go_round_robin_and_none_on_the_cpu():
    assert [Devices(transport="host", gpus=2).gpu(i) for i in range(5)] == [0, 1, 0, 1, 0]
    assert [Devices(transport="nccl", gpus=4).gpu(i) for i in range(3)] == [0, 1, 2]
    assert Devices(transport="nccl-model").gpu(3) is None


def test_the_launcher_refuses_more_nccl_workers_than_gpus_before_starting_any():
    from tidal_agent.runner import run_elastic
    from tidal_plan.elastic import generations

    # A shrink then a grow: the joiner is a third process, started with the other two.
    gens = generations([(0, 2), (2, 1), (4, 2)])
    with pytest.raises(DeviceChoiceError, match="3 workers need 3 GPUs"):
        run_elastic(load_job(TINY), gens, [], steps=6,
                    devices=Devices(transport="nccl", gpus=2))


# ---- a GPU bound: tidal run's workers and tidal agent's pods ------------------------------------


@pytest.mark.parametrize(("visible", "index", "bound"), [
    (None, 2, "2"), ("3,5", 1, "5"), ("GPU-aa, GPU-bb", 1, "GPU-bb"),
])
def test_a_gpu_is_bound_by_narrowing_what_the_process_sees(visible, index, bound):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert bind_gpu(index, env) == bound
    assert env == {"CUDA_VISIBLE_DEVICES": bound}


def test_a_gpu_the_process_may_not_use_is_refused():
    with pytest.raises(DeviceChoiceError, match=r"GPU 2 is not among the 2 this process may use "
                                                 r"\(CUDA_VISIBLE_DEVICES='0,1'\)"):
        bind_gpu(2, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_a_pod_takes_its_gpu_from_what_it_was_given():
    # This machine has no GPU: auto trains on the CPU, an explicit GPU transport is refused.
    env = {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,6"}
    assert pod_transport("auto", env) == "gloo"
    assert env["CUDA_VISIBLE_DEVICES"] == "6"  # bound all the same, before CUDA starts
    assert pod_transport("gloo", {}) == "gloo"
    assert pod_transport("auto", {"CUDA_VISIBLE_DEVICES": ""}) == "gloo"
    with pytest.raises(DeviceChoiceError, match="transport nccl computes on CUDA and no GPU"):
        pod_transport("nccl", {})
    with pytest.raises(DeviceChoiceError, match=r"transport host needs a GPU: GPU 0 is not among the 0"):
        pod_transport("host", {"CUDA_VISIBLE_DEVICES": ""})
    with pytest.raises(DeviceChoiceError, match="LOCAL_RANK='one' is not a GPU index"):
        pod_transport("nccl", {"LOCAL_RANK": "one"})


# ---- determinism --------------------------------------------------------------------------------


@pytest.fixture
def process_settings(monkeypatch):
    """The process-wide settings set_determinism changes, put back after the test."""
    for name in ("CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    flags = [(module, name, getattr(module, name)) for module, name in (
        (torch.utils.deterministic, "fill_uninitialized_memory"),
        (torch.backends.cudnn, "deterministic"), (torch.backends.cudnn, "benchmark"),
        (torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"),
        (inductor, "deterministic"), (inductor, "fallback_random"))]
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    algorithms = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    monkeypatch.setattr(devices, "_inductor_asked", dict(devices._inductor_asked))
    yield
    for module, name, value in flags:
        setattr(module, name, value)
    torch.set_num_threads(threads)
    torch.set_float32_matmul_precision(precision)
    torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)


def test_strict_mode_on_cuda_sets_and_reports_the_settings(process_settings):
    # The CUDA path sets flags only, so it runs on a CPU build without starting CUDA.
    record = set_determinism("cuda", strict=True, threads=2)
    assert record == {
        "threads": 2,
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "torch.use_deterministic_algorithms": True,
        "torch.utils.deterministic.fill_uninitialized_memory": False,
        "torch.backends.cudnn.deterministic": True,
        "torch.backends.cudnn.benchmark": False,
        "torch.backends.cuda.matmul.allow_tf32": False,
        "torch.backends.cudnn.allow_tf32": False,
        "torch.float32_matmul_precision": "highest",
        "torch._inductor.config.deterministic": True,
        "torch._inductor.config.fallback_random": True,
    }
    assert record == {"threads": 2, **strict_settings()}  # what the process now has
    assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_relaxed_mode_fixes_the_threads_only(process_settings, device):
    before = strict_settings()
    assert set_determinism(device, strict=False, threads=1) == {"threads": 1}
    assert strict_settings() == before


def test_strict_mode_on_the_cpu_adds_inductors_deterministic_mode_only(process_settings):
    before = strict_settings()
    inductor = {"torch._inductor.config.deterministic": True,
                "torch._inductor.config.fallback_random": True}
    assert set_determinism("cpu", strict=True, threads=1) == {"threads": 1} | inductor
    assert strict_settings() == before | inductor


def test_strict_mode_sets_inductor_as_a_process_that_compiles_imports_it():
    """A process that compiles nothing never imports inductor (and dynamo with it, seconds of
    its start); one that compiles has strict mode's settings before its first graph."""
    script = """if True:
        import sys
        import torch
        import tidal_agent.worker
        from tidal_agent import compiled
        from tidal_agent.devices import set_determinism
        set_determinism("cpu", strict=True, threads=1)
        print("torch._dynamo" in sys.modules, "torch._inductor.config" in sys.modules)
        compiled.compute(type("Unit", (), {"compute": lambda self, h: h}))
        import torch._inductor.config as inductor
        print(inductor.deterministic, inductor.fallback_random)
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TORCHINDUCTOR_DETERMINISTIC": "0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "True", "True"]


def test_an_unknown_gpu_is_planned_as_an_h100_with_a_warning(monkeypatch, caplog):
    # get_device_name needs a GPU: the one thing here that stands in for one.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H200")
    assert plan_device("cuda") == "h200"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Tesla T4")
    assert plan_device("cuda") == "h100"
    assert "no device description for GPU 'Tesla T4': planning with h100's" in caplog.text


def test_auto_compiles_on_cuda_only_where_torch_splits_a_compiled_backward(monkeypatch):
    from tidal_agent import compiled

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compiled.splits_backward()  # the pinned torch reads an autograd.Function's edge
    assert compiled.enabled("auto", cuda) and not compiled.enabled("auto", cpu)
    monkeypatch.setattr(compiled, "splits_backward", lambda: False)  # as torch 2.11 on an H200
    assert not compiled.enabled("auto", cuda)
    assert compiled.enabled("on", cuda) and not compiled.enabled("off", cuda)


def test_the_split_probe_says_no_where_autograd_refuses_the_edge(monkeypatch, caplog):
    from tidal_agent import compiled

    def refuse(*args, **kwargs):  # torch 2.11's words, from autograd.grad's _make_grads
        raise RuntimeError("Attribute '_input_metadata' is invalid for this instance of "
                           "_C._FunctionBase.")

    monkeypatch.setattr(torch.autograd, "grad", refuse)
    compiled.splits_backward.cache_clear()
    try:
        assert compiled.splits_backward() is False
    finally:
        compiled.splits_backward.cache_clear()
    assert "units run eagerly" in caplog.text
