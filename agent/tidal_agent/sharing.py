"""What a core shared by two ranks costs beyond halving their speed: the host's sharing probe.

The dry run shares a host's cores among the ranks that compute at once (processor sharing):
``n`` ranks on ``c`` cores each run at ``c / n`` of their speed. That is the whole cost only
if a time-shared core does the same work per CPU second as a core of one's own. It does not:
every switch between two ranks' processes leaves the next one a cache full of the other's
tensors, so the same pass of a stage costs more CPU seconds. Traced here (stage forward and
backward, 6-block model of width 128): a block's CPU seconds per step grew by about 30% from
2 ranks on 2 cores to 4, and the prediction of the 4-rank layouts fell short by as much.

``measure_sharing`` times it with the job's own work: ``2 c`` processes (``c`` = the ranks the
host's cores run at full speed at once), each with fresh copies of one stage of the profiled
layout, run passes of that stage (``profiler.time_group``: F, B, F, I, W and the
post-pipeline work) in alternating phases: ``c`` of them alone (every core busy, one process
each, as the profile's calibration ran), then all ``2 c`` (two per core). The CPU seconds
per pass of the first ``c`` processes in the shared phases over those in the alone phases is
``work_factor``: what a pass costs on a core shared by two, per CPU second of it. The
profile carries it; the predictor slows every rank by it where the ranks outnumber the cores.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import torch

from tidal_agent.model import build_unit
from tidal_agent.optim import build_adamw
from tidal_agent.profiler import time_group
from tidal_agent.trainer import model_config
from tidal_api import JobSpec
from tidal_plan.layout import Layout


def measure_sharing(
    spec: JobSpec, layout: Layout, *, threads: int = 1, phase_s: float = 1.0, rounds: int = 3,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """The host's ``work_factor`` at two processes per core, for ``layout``'s stages.

    Returns ``{"ranks_per_core": 2, "work_factor", "processes", "alone_cpu_s",
    "shared_cpu_s"}``: the last two are the median CPU seconds of a pass. Raises
    ``RuntimeError`` if a probe process fails or does not report within ``timeout_s``.
    """
    procs_n = probe_processes(threads)
    full = procs_n // 2  # processes the cores run at full speed at once
    # Phases: the first ``full`` processes alone, then all of them; ``rounds`` times.
    phases = [tuple(range(full)), tuple(range(procs_n))] * rounds
    ctx = mp.get_context("spawn")
    ready, results = ctx.Barrier(procs_n), ctx.Queue()
    spec_json = spec.model_dump_json()
    procs = [
        ctx.Process(target=_probe, daemon=True, name=f"tidal-sharing-{i}",
                    args=(i, spec_json, layout.to_dict(), i % layout.num_stages, threads,
                          phases, phase_s, ready, results))
        for i in range(procs_n)
    ]
    for proc in procs:
        proc.start()
    try:
        reports = [results.get(timeout=timeout_s) for _ in procs]
    except Exception as err:  # queue.Empty, or a probe that died before reporting
        raise RuntimeError(f"the sharing probe did not report: {err!r}") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    failed = [r for r in reports if "error" in r]
    if failed:
        raise RuntimeError(f"sharing probe {failed[0]['index']} failed: {failed[0]['error']}")
    alone, shared, ratios = [], [], []
    for report in reports:
        if report["index"] >= full:
            continue  # the helpers that make the sharing; they never ran alone
        a = [s for k, s in report["per_pass"] if len(phases[k]) == full]
        b = [s for k, s in report["per_pass"] if len(phases[k]) == procs_n]
        if a and b:
            alone += a
            shared += b
            ratios.append(statistics.median(b) / statistics.median(a))
    if not ratios:
        raise RuntimeError(f"the sharing probe timed no pass in {phase_s} s phases: lengthen them")
    return {
        "ranks_per_core": 2,
        "work_factor": statistics.fmean(ratios),
        "processes": procs_n,
        "alone_cpu_s": statistics.median(alone),
        "shared_cpu_s": statistics.median(shared),
    }


def probe_processes(threads: int = 1) -> int:
    """How many processes the probe starts: two per ``threads``-thread rank the cores hold."""
    return 2 * max(1, (os.cpu_count() or 1) // threads)


def _probe(index: int, spec_json: str, layout_dict: dict, stage: int, threads: int,
           phases: list[tuple[int, ...]], phase_s: float, ready, results) -> None:
    try:
        torch.set_num_threads(threads)
        spec = JobSpec.model_validate_json(spec_json)
        config = model_config(spec)
        layout = Layout(**layout_dict)
        m = layout.micro_batch_size
        units = [build_unit(config, u, spec.training.seed) for u in layout.stage_units(stage)]
        opt = build_adamw([(f"{u.index}.{n}", p) for u in units for n, p in u.named_parameters()],
                          spec.training)
        gen = torch.Generator().manual_seed(index)
        batch = torch.randint(config.vocab, (m, config.sample_len), generator=gen)
        tokens = lambda size: batch[:size]  # noqa: E731
        for _ in range(2):  # warm-up: allocations, the optimizer's state
            time_group(units, m, tokens, opt)
    except Exception as err:  # report it rather than leave the others at the barrier
        ready.abort()
        results.put({"index": index, "error": repr(err)})
        return
    ready.wait()
    start = time.monotonic()
    per_pass = []
    for k, active in enumerate(phases):
        begin, end = start + k * phase_s, start + (k + 1) * phase_s
        if index not in active:
            time.sleep(max(0.0, end - time.monotonic()))
            continue
        time.sleep(max(0.0, begin - time.monotonic()))
        last = 0.0
        while time.monotonic() + last < end:
            cpu, wall = time.process_time(), time.monotonic()
            time_group(units, m, tokens, opt)
            per_pass.append((k, time.process_time() - cpu))
            last = time.monotonic() - wall
        time.sleep(max(0.0, end - time.monotonic()))
    results.put({"index": index, "per_pass": per_pass})
