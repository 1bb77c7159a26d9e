"""The ``tidal`` command line.

The commands import the trainer (tidal_agent, torch) when they run, not with this module:
``tidal agent`` sets ``OMP_NUM_THREADS`` before torch loads (part of the determinism contract),
and ``tidal plan`` and ``--help`` need no torch.
"""

from __future__ import annotations

import atexit
import json
import sys
import tempfile
from pathlib import Path

import click
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from tidal_api import ElasticTrainingJob, JobSpecError, keys, parse_job
from tidal_api.layout import LayoutError, ScheduleKind
from tidal_api.spec import MAX_MTP_HEADS, MAX_SEQ_LEN
from tidal_plan.devices import DeviceError, load_device
from tidal_plan.elastic import (ScheduleError, all_workers, elastic_plan, generations,
                                parse_worker_schedule)
from tidal_plan.gpus import CUDA_TRANSPORTS, TRANSPORTS, DeviceChoiceError, Devices, choose_devices
from tidal_plan.layout import resolve_layout
from tidal_plan.planner import LayoutPlanner, plan_flextrain, plan_job
from tidal_plan.profiled import ProfileError, load_profile

_console = Console(stderr=True)


def load_job(path: str | Path) -> ElasticTrainingJob:
    """Read and validate an ElasticTrainingJob manifest (YAML or JSON)."""
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as err:
        raise JobSpecError(f"{path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise JobSpecError(f"{path}: not valid YAML: {str(err).splitlines()[0]}") from None
    return parse_job(document, str(path), local_files=True)


def _parse_partition(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        parts = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise LayoutError(f"--partition {text!r}: expected units per stage, e.g. 2,3,1") from None
    return parts


def _resume_dir(job: ElasticTrainingJob, resume: str, flag: str = "--resume") -> Path:
    from tidal_agent import checkpoint

    if resume != "latest":
        path = Path(resume)
        if not (path / checkpoint.MARKER).is_file():
            raise JobSpecError(f"{flag} {resume}: not a complete Tidal checkpoint directory")
        return path
    root = job.spec.checkpoint.path
    found = checkpoint.latest(root) if root else None
    if found is None:
        raise JobSpecError(
            f"{flag} latest: no complete checkpoint under spec.checkpoint.path ({root})"
        )
    return found[1]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Tidal: elastic pipeline-parallel LLM training."""


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--workers", "-n", type=click.IntRange(min=1), help="Worker processes (default: spec.workers.min).")
@click.option("--steps", type=click.IntRange(min=1), help="Steps to run (default: spec.training.steps).")
@click.option("--report", type=click.Path(dir_okay=False), help="Write the JSON report here.")
@click.option("--schedule", type=click.Choice([k.value for k in ScheduleKind]), help="Force a pipeline schedule.")
@click.option("--partition", help="Force units per stage, e.g. 2,3,1.")
@click.option("--workers-schedule", "workers_schedule", help="Change the worker count live: STEP:WORKERS,... e.g. 0:2,4:3,8:4.")
@click.option("--reshard-bucket-mib", "bucket_mib", type=click.IntRange(min=1), default=256, show_default=True, help="Memory cap per worker for state in flight during a live switch.")
@click.option("--profile", "profile_out", type=click.Path(dir_okay=False), help="Write the online profile (per-unit costs, JSON) here, with the host's sharing probe; every run profiles steps 3-7 of each generation (1 to the last in shorter ones) anyway.")
@click.option("--resume", help="Resume from a checkpoint directory, or 'latest' under spec.checkpoint.path.")
@click.option("--plan-profile", "plan_profile", type=click.Path(dir_okay=False), help="Plan layouts from this online profile (default: the modeling-based predictor).")
@click.option("--plan-device", help="Device description for the modeling-based predictor: h100, h200, cpu or a JSON file (default: what the workers train on: cpu, or the GPU's by its name; tidal plan's default is h100).")
@click.option("--write-device", "device_out", type=click.Path(dir_okay=False), help="After the run, write the plan device's description (JSON) with the efficiency this run measured in its first profile: mfu and, on a GPU, the memory beyond the model's count. tidal plan --device FILE reads it.")
@click.option("--timeout", "timeout_s", type=float, default=120.0, show_default=True, help="Seconds before a silent worker is an error.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True, help="Where the workers compute. auto: what --transport computes on, else cuda where CUDA is available, else cpu.")
@click.option("--transport", type=click.Choice(["auto", *TRANSPORTS]), default="auto", show_default=True, help="How the workers talk: nccl (one worker per GPU), host (CUDA compute, gloo through pinned host memory: workers share GPUs), gloo (CPU) or nccl-model (gloo under NCCL's rules, a CPU test transport). auto: nccl on cuda, gloo on cpu.")
def run(job_file, workers, steps, report, schedule, partition, workers_schedule, bucket_mib,
        profile_out, resume, plan_profile, plan_device, device_out, timeout_s, device,
        transport) -> None:
    """Train JOB_FILE with N local worker processes and report per-step losses.

    The planner picks each worker count's layout (schedule where the spec says auto, and the
    partition) unless --schedule or --partition forces it; the report gives its predicted
    step time next to the measured one. With --workers-schedule the worker count changes
    between steps without a restart; in strict mode the losses stay bitwise those of a fixed
    worker count. On CUDA each worker computes on one GPU (round-robin over them with
    --transport host); strict mode makes CUDA deterministic in every worker.
    """
    if workers_schedule and (workers or partition):
        raise click.ClickException("--workers-schedule replaces --workers and --partition")
    try:
        job = load_job(job_file)
        workers = workers or job.spec.workers.min
        steps = steps or job.spec.training.steps
        if steps > job.spec.training.steps:
            raise JobSpecError(
                f"--steps {steps} exceeds spec.training.steps ({job.spec.training.steps}), "
                "which sets the LR schedule: raise it in the manifest"
            )
        entries = parse_worker_schedule(
            workers_schedule, steps=steps, max_workers=job.spec.model.num_units
        ) if workers_schedule else [(0, workers)]
        devices = _run_devices(device, transport, len(all_workers(generations(entries))))
        plan_on = load_device(plan_device or _plan_device(devices))
        planner = LayoutPlanner(
            job, plan_on, load_profile(plan_profile) if plan_profile else None,
        )
        forced = schedule is not None or partition is not None
        choose = None if forced else (lambda n, dp: planner.layout(n, dp)[0])
        if workers_schedule:
            gens, layouts = elastic_plan(job, entries, kind=schedule, choose=choose)
        elif forced:
            layout = resolve_layout(
                job, workers=workers, schedule=schedule, partition=_parse_partition(partition)
            )
            gens, layouts = elastic_plan(job, [(0, workers)], kind=schedule)
            layouts = [layout]
        else:
            gens, layouts = elastic_plan(job, [(0, workers)], choose=choose)
        predicted = [planner.predict(lay).step_seconds for lay in layouts]
        resume_from = _resume_dir(job, resume) if resume else None
    except (JobSpecError, LayoutError, ScheduleError, DeviceError, DeviceChoiceError,
            ProfileError, ValueError) as err:
        raise click.ClickException(str(err)) from None
    if profile_out or device_out:  # both need a profile
        from tidal_agent.worker_options import profile_window

        try:
            profile_window(steps)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="'--steps'") from None
    scratch = tempfile.TemporaryDirectory(prefix="tidal-profile-")  # unasked profiles go here
    click.get_current_context().call_on_close(scratch.cleanup)
    atexit.unregister(_stop_worker_server)  # once, however many runs one process makes
    atexit.register(_stop_worker_server)
    profile_to = profile_out or (str(Path(scratch.name) / "profile.json") if steps >= 3 else None)
    from tidal_plan.predictors import ProfiledPredictor

    profiled: list[dict] = []  # per profile: layout, steps, the profiled prediction
    first_profile: list[dict] = []  # the first profile's JSON, for --write-device
    # The trainer, after the checks: a bad manifest gets its line in a fraction of a second
    # (bad flags too where no GPU is counted: --device cpu, or a CPU transport).
    from tidal_agent.runner import (RunError, layout_report, loss_divergence, profile_accuracy,
                                    run_elastic, run_local)
    from tidal_agent.trainer import batch_source

    try:  # the data's errors in one line, before any worker starts
        batch_source(job.spec)
    except (OSError, ValueError) as err:
        raise click.ClickException(str(err)) from None
    tokens_per_step = job.spec.training.global_batch_size * job.spec.model.seq_len
    _console.print(f"[bold]{job.metadata.name}[/]: {steps} steps")
    how = "forced" if forced else f"planned ({planner.predictor.name})"
    for gen, lay, pred in zip(gens, layouts, predicted, strict=True):
        _console.print(
            f"  from step {gen.at_step:5d}: {len(gen.members)} workers, {lay.describe()} "
            f"({how}, predicted {pred * 1e3:.1f} ms/step on device {plan_on.name})"
        )
    columns = (
        TextColumn("[progress.description]{task.description}"), BarColumn(),
        MofNCompleteColumn(), TimeRemainingColumn(),
    )
    with Progress(*columns, console=_console, transient=True) as progress:
        task = progress.add_task("training", total=steps)

        def on_step(event: dict) -> None:
            rate = tokens_per_step / event["seconds"]
            predicted = next((p["predicted_s"] for p in reversed(profiled)
                              if p["layout"] == event["layout"]), None)
            progress.console.print(
                f"step {event['step']:5d}  pp{event['layout']['pp']}  loss {event['loss']:.4f}  "
                f"{event['seconds'] * 1e3:7.1f} ms  {rate:10,.0f} tok/s"
                + (f"  (profiled {predicted * 1e3:.1f} ms)" if predicted else "")
            )
            # completed, not advance: a resumed run starts past step 0
            progress.update(task, completed=event["step"] + 1, description=f"loss {event['loss']:.4f}")

        def on_profile(event) -> None:
            if device_out and not first_profile:
                first_profile.append(json.loads(Path(event.path).read_text()))
            try:
                profile = load_profile(event.path)
            except ProfileError as err:
                progress.console.print(f"profile of steps {event.steps}: not usable: {err}")
                return
            predicted = ProfiledPredictor(profile, job.spec.model.seq_len).predict(
                event.layout).step_seconds
            profiled.append({"layout": event.layout.to_dict(), "steps": list(event.steps),
                             "predicted_s": predicted})
            progress.console.print(
                f"profiled steps {event.steps[0]}-{event.steps[1] - 1} of "
                f"{event.layout.describe()}: predicted {predicted * 1e3:.1f} ms/step")

        try:
            result = run_elastic(
                job, gens, layouts, steps=steps, on_step=on_step,
                timeout_s=timeout_s, resume_from=resume_from, bucket_bytes=bucket_mib << 20,
                profile_out=profile_to, sharing_probe=bool(profile_out), on_profile=on_profile,
                devices=devices,
            )
            relaxed = job.spec.parallelism.consistency == "relaxed"
            if relaxed and len({lay.dp for lay in layouts}) > 1:
                # relaxed: measure what the layout changes cost in loss (strict costs none)
                progress.update(task, description="static run for comparison")
                static = run_local(job, layouts[0], steps=steps, timeout_s=timeout_s,
                                   resume_from=resume_from, devices=devices)
                result["divergence"] = loss_divergence(result, static)
        except RunError as err:
            first = str(err).splitlines()[0]
            raise click.ClickException(first) from None
    result["layouts"] = layout_report(gens, layouts, result["steps"], predicted,
                                      planner.predictor.name)
    result["accuracy"] = profile_accuracy(profiled, result["steps"])
    if not profile_out:  # the scratch profiles are gone with the run
        result["profile"] = None
        for entry in result["profiles"]:
            entry.pop("path")
    if result.get("profile"):
        _console.print(f"profile: {result['profile']}")
    if device_out:
        _write_measured_device(device_out, first_profile, job, plan_on)
    if report:
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        Path(report).write_text(json.dumps(result, indent=2) + "\n")
    if "divergence" in result:
        d = result["divergence"]
        _console.print(
            f"relaxed: dp changed; loss differs from the static run by at most "
            f"{d['max_abs_loss_diff']:.2e} ({d['max_rel_loss_diff']:.2e} relative)"
        )
    for flag in result["stragglers"]:
        _console.print(
            f"step {flag['step']}: {flag['member']} "
            f"{'is a straggler' if flag['flagged'] else 'is no longer a straggler'} "
            f"({flag['slowdown']:.2f}x the others' layer time)"
        )
    for replan in result["replans"]:
        _console.print(
            f"re-plan at step {replan['step']}: partition {replan['from']['partition']} -> "
            f"{replan['to']['partition']} from step {replan['at_step']} (predicted "
            f"{replan['gain']:+.0%})"
        )
    for change in result["reconfigurations"]:
        old, new = change["workers"]
        _console.print(
            f"switch at step {change['at_step']}: {old} -> {new} workers, pause "
            f"{change['pause_s'] * 1e3:.0f} ms, {change['bytes_moved'] / 2**20:.1f} MiB moved"
        )
    for entry in result["layouts"]:
        if entry["measured_step_s"] is not None:
            _console.print(
                f"from step {entry['at_step']}: predicted {entry['predicted_step_s'] * 1e3:.1f} ms"
                f" ({entry['predictor']}), measured {entry['measured_step_s'] * 1e3:.1f} ms "
                f"({entry['error']:+.0%})"
            )
    accuracy = result["accuracy"]
    if accuracy["layouts"]:
        _console.print(
            f"profiled predictor, after each profile: median error "
            f"{accuracy['median_abs_error']:.1%}, worst {accuracy['worst_abs_error']:.1%} "
            f"over {len(accuracy['layouts'])} layout(s)"
        )
    times = sorted(e["seconds"] for e in result["steps"])
    median = times[len(times) // 2]
    _console.print(
        f"done: loss {result['steps'][-1]['loss']:.4f}, median step {median * 1e3:.1f} ms "
        f"({tokens_per_step / median:,.0f} tok/s), params {result['params_sha256'][:16]}"
    )
    if report:
        _console.print(f"report: {report}")


def _write_measured_device(path: str, profiles: list[dict], job: ElasticTrainingJob,
                           base) -> None:
    """``tidal run --write-device``: ``base`` (the plan device) with the efficiency the run's
    first profile measured (tidal_plan.measured), written to ``path``."""
    from tidal_plan.devices import write_device
    from tidal_plan.measured import measured_device
    from tidal_plan.modelshape import ModelShape
    from tidal_plan.planner import job_device

    if not profiles:
        raise click.ClickException(f"--write-device {path}: the run took no profile to measure "
                                   "its device by")
    try:
        measured = measured_device(profiles[0], ModelShape.of(job.spec.model),
                                   job_device(job.spec, base))
    except ProfileError as err:
        raise click.ClickException(f"--write-device {path}: {err}") from None
    write_device(measured, path)
    overhead = measured.memory_overhead_bytes
    _console.print(
        f"device: {path} ({measured.name}: mfu {measured.mfu:.3g} of {measured.peak_flops:.4g} "
        f"FLOP/s" + (f", {overhead / 2**30:.2f} GiB beyond the memory model" if overhead else "")
        + ")")


def _run_devices(device: str, transport: str, workers: int) -> Devices:
    """``tidal run``'s device and transport for ``workers`` processes; torch is loaded only to
    count GPUs, where the choice may need them."""
    gpus = 0
    if device != "cpu" and transport in ("auto", *CUDA_TRANSPORTS):
        from tidal_agent.devices import visible_gpus

        gpus = visible_gpus()
    return choose_devices(device, transport, gpus=gpus, workers=workers)


def _plan_device(devices: Devices) -> str:
    """What ``--plan-device`` defaults to (torch only where the workers compute on a GPU)."""
    if devices.device == "cpu":
        return "cpu"
    from tidal_agent.devices import plan_device

    return plan_device(devices.device)


def _stop_worker_server() -> None:
    """Stop the server the workers were forked from (tidal_agent.runner.worker_processes)
    before this process exits: on its own it goes about a second later, after whoever
    waited for ``tidal run`` to end has looked for what it left running."""
    from multiprocessing import forkserver

    try:
        forkserver._forkserver._stop()  # private, and the only way to wait for it
    except FileNotFoundError:  # its socket's directory went first: the server is gone anyway
        pass


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False), required=False)
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False), help="An online profile (tidal run --profile): the profiling-based predictor chooses, the modeling-based one checks.")
@click.option("--device", default="h100", show_default=True, help="h100, h200, cpu, or a JSON file of Device fields: peaks for the modeling-based predictor and the memory cap (tidal run plans for what its workers train on).")
@click.option("--flextrain", type=click.Choice(["small", "medium", "large"]), help="Plan a FlexTrain configuration of the slides instead of JOB_FILE.")
@click.option("--elastic", type=click.Choice(["pp", "dp-pp"]), default="pp", show_default=True, help="With --flextrain: scale PP only (DP fixed) or DP and PP.")
@click.option("--max-disagreement", type=click.FloatRange(min=0), default=0.25, show_default=True, help="Drop rows whose speedup the two predictors put further apart (a ratio).")
@click.option("--json", "as_json", is_flag=True, help="Print the scale table as JSON.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON scale table here.")
def plan(job_file, profile_path, device, flextrain, elastic, max_disagreement, as_json, out) -> None:
    """Print the scale table of JOB_FILE: the best layout for every worker count.

    Each row gives the layout (dp, pp, partition, schedule, micro-batching), its predicted step
    seconds, tokens/s and peak memory, and its speedup over the smallest row; worker counts not
    worth running are listed with the reason they were dropped.
    """
    if (job_file is None) == (flextrain is None):
        raise click.ClickException("give either JOB_FILE or --flextrain NAME")
    try:
        dev = load_device(device)
        columns = (TextColumn("planning"), BarColumn(), MofNCompleteColumn())
        with Progress(*columns, console=_console, transient=True) as progress:
            if flextrain:
                task = progress.add_task("plan", total=None)
                table, _ = plan_flextrain(flextrain, dev, elastic=elastic,
                                          on_row=lambda w: progress.advance(task))
            else:
                job = load_job(job_file)
                profile = load_profile(profile_path) if profile_path else None
                rows = job.spec.workers.max - job.spec.workers.min + 1
                task = progress.add_task("plan", total=rows)
                table, _ = plan_job(job, dev, profile=profile, max_disagreement=max_disagreement,
                                    on_row=lambda w: progress.advance(task))
    except (JobSpecError, DeviceError, ProfileError, LayoutError, ValueError) as err:
        raise click.ClickException(str(err)) from None
    text = table.model_dump_json(by_alias=True, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    if as_json:
        click.echo(text)
        return
    _print_table(table)


def _print_table(table) -> None:
    from rich.table import Table

    view = Table(title=f"{table.job}: scale table ({table.source} predictor, device "
                       f"{table.device})")
    for name in ("workers", "GPUs", "dp", "pp", "partition", "schedule", "micro-batches",
                 "step s", "tokens/s", "peak GiB", "speedup"):
        view.add_column(name, justify="left" if name in ("partition", "schedule") else "right")
    for row in table.rows:
        lay = row.layout
        schedule = (lay.schedule.value
                    + (f" v{lay.virtual_stages}" if lay.virtual_stages > 1 else "")
                    + (" ac" if lay.activation_checkpointing else ""))
        view.add_row(
            str(row.workers), str(row.gpus), str(lay.dp), str(lay.pp),
            ",".join(map(str, lay.partition)), schedule,
            f"{lay.micro_batch_size}x{lay.num_micro_batches}", f"{row.step_seconds:.4g}",
            f"{row.tokens_per_second:,.0f}", f"{row.peak_memory_bytes / 2**30:.2f}",
            f"{row.speedup:.2f}x",
        )
    Console().print(view)
    if table.dropped:
        dropped = Table(title="dropped worker counts")
        for name in ("workers", "reason", "why"):
            dropped.add_column(name)
        for entry in table.dropped:
            dropped.add_row(str(entry.workers), entry.reason, entry.detail)
        Console().print(dropped)


def _slowdown(text: str | None) -> tuple[int, int, float] | None:
    """``--slowdown FIRST:END:FACTOR``, checked."""
    if text is None:
        return None
    try:
        first, end, factor = text.split(":")
        return int(first), int(end), float(factor)
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected FIRST:END:FACTOR, e.g. 4:12:3.0",
                                 param_hint="'--slowdown'") from None


@main.command()
@click.option("--kubeconfig", help="A kubeconfig file or an API server URL (default: the pod's service account, then $KUBECONFIG).")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="Torch threads; the same in every pod (determinism).")
@click.option("--steps", type=click.IntRange(min=1), help="Steps to run (default: spec.training.steps).")
@click.option("--report", type=click.Path(dir_okay=False), help="The leader writes the JSON report here.")
@click.option("--plan-device", help="Device description for the planner: h100, h200, cpu or a JSON file (default: what the pod trains on: cpu, or its GPU's by the GPU's name).")
@click.option("--publish-interval", "publish_interval_s", type=click.FloatRange(min=0), default=2.0, show_default=True, help="Seconds between status patches (a new generation goes out at once).")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl", "host", "nccl-model"]), default="auto", show_default=True, help="The transport: gloo (CPU), nccl (the pod's GPU), host (the pod's GPU, gloo through pinned host memory) or nccl-model (CPU, gloo under NCCL's rules: a test transport); auto: nccl where the pod has a GPU, else gloo. The GPU is the LOCAL_RANK-th (default the first) of those the pod was given (CUDA_VISIBLE_DEVICES).")
@click.option("--timeout", "timeout_s", type=float, default=120.0, show_default=True, help="Seconds before a silent peer or rendezvous is an error.")
@click.option("--lost-after", "lost_after_s", type=click.FloatRange(min=1.0), default=5.0, show_default=True, envvar=keys.ENV_LOST_AFTER, help="The backstop: seconds of heartbeat silence (a beat every 0.5 s) after which a hung member counts as lost; one that dies is lost at once, from its ended connection (also $TIDAL_LOST_AFTER).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), envvar="TIDAL_METRICS_PORT", help="Serve Prometheus metrics on this port (also $TIDAL_METRICS_PORT; 0 or unset: off).")
@click.option("--profiled-table/--modeled-table", "profiled_table", default=True, show_default=True, help="Profile each generation's first steps and publish the scale table planned from the profile (both predictors), or profile nothing and keep the modeling-based table (for GPUs that share CPU cores, as tidal local's do: the profile would see the cores).")
@click.option("--slowdown", hidden=True, help="Tests only: FIRST:END:FACTOR makes this pod a straggler, its decoder-layer forwards FACTOR times as long in steps [FIRST, END).")
def agent(kubeconfig, threads, steps, report, plan_device, publish_interval_s, backend,
          timeout_s, lost_after_s, metrics_port, profiled_table, slowdown) -> None:
    """Run this pod's worker of an ElasticTrainingJob, as the operator starts it.

    The pod's identity comes from TIDAL_JOB, TIDAL_NAMESPACE, TIDAL_POD, TIDAL_RENDEZVOUS_HOST
    and TIDAL_RENDEZVOUS_PORT (the job's rendezvous pod, tidal rendezvous). <job>-worker-0
    leads first, and a survivor takes the lead if the leader is lost: the leader applies
    status.target at step boundaries and publishes the job's progress in status. A pod the
    target releases hands its state over and exits 0.
    """
    import logging
    import os

    os.environ["OMP_NUM_THREADS"] = str(threads)  # before torch loads: part of determinism
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one line per request otherwise
    from tidal_agent.link import ControlError
    from tidal_agent.pod import PodIdentity, pod_transport, run_agent
    from tidal_agent.protocol import RendezvousLost

    try:
        transport = pod_transport(backend)
        identity = PodIdentity.from_env()
        result = run_agent(identity, kubeconfig=kubeconfig, threads=threads, steps=steps,
                           plan_device=plan_device, publish_interval_s=publish_interval_s,
                           timeout_s=timeout_s, lost_after_s=lost_after_s, transport=transport,
                           report_path=report, metrics_port=metrics_port, profiled_table=profiled_table,
                           slowdown=_slowdown(slowdown))
    except (ControlError, JobSpecError, LayoutError, DeviceError, DeviceChoiceError,
            RendezvousLost) as err:
        raise click.ClickException(str(err)) from None
    if "params_sha256" in result:
        last = result["steps"][-1] if result["steps"] else None
        loss = f"loss {last['loss']:.4f}, " if last else ""
        _console.print(f"done: {loss}{len(result['members'])} workers, "
                       f"params {result['params_sha256'][:16]}")
    elif result["done"]:
        _console.print(f"{identity.pod}: done")
    else:
        _console.print(f"{identity.pod}: released" + (
            f" at step {result['left_at']}" if result["left_at"] is not None else " from standby"))


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--checkpoint", "which", default="latest", show_default=True, help="A checkpoint directory, or 'latest' under spec.checkpoint.path.")
def export(job_file, out, which) -> None:
    """Write a checkpoint of JOB_FILE's Hugging Face model to OUT as a Hugging Face directory
    (config.json and safetensors) that transformers' from_pretrained loads."""
    try:
        job = load_job(job_file)
        if job.spec.model.huggingface is None:
            raise JobSpecError(f"{job_file}: tidal export writes Hugging Face models "
                               "(spec.model.huggingface); this job trains the built-in GPT")
        directory = _resume_dir(job, which, "--checkpoint")
    except JobSpecError as err:
        raise click.ClickException(str(err)) from None
    from tidal_agent import checkpoint, hf

    try:
        parameters = checkpoint.load_parameters(job.spec.model, directory)
        hf.export(job.spec.model, parameters, out)
    except (ValueError, OSError) as err:
        raise click.ClickException(str(err)) from None
    _console.print(f"wrote {directory} ({len(parameters)} tensors) to {out}")


@main.group()
def data() -> None:
    """Training data tools."""


@data.command("synth")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--tokens", type=click.IntRange(min=2), default=1_000_000, show_default=True)
@click.option("--vocab", type=click.IntRange(2, 65536), default=256, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
def data_synth(out: str, tokens: int, vocab: int, seed: int) -> None:
    """Write OUT, a uint16 token file (nanoGPT format) drawn from the synthetic corpus."""
    import numpy as np

    from tidal_agent.data import SyntheticCorpus, write_token_file

    if not Path(out).parent.is_dir():  # said before the tokens are drawn, not after
        raise click.ClickException(f"{out}: the directory {Path(out).parent} does not exist")
    row = 1024
    corpus = SyntheticCorpus(vocab=vocab, sample_len=row, seed=seed)
    chains = corpus.samples(0, np.arange(-(-tokens // row)))
    try:
        write_token_file(out, chains.reshape(-1)[:tokens])
    except OSError as err:
        raise click.ClickException(f"{out}: {err.strerror}") from None
    _console.print(f"wrote {tokens:,} tokens (vocab {vocab}) to {out}")


@data.command("prepare")
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--tokenizer", "tokenizer_dir", required=True, type=click.Path(path_type=Path), help="A local tokenizer directory (save_pretrained's: tokenizer.json, tokenizer_config.json).")
@click.option("--seq-len", required=True, type=click.IntRange(2, MAX_SEQ_LEN), help="The model's seqLen: samples hold seqLen + 1 (+ mtpHeads) tokens.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The directory to write (shards and meta.json).")
@click.option("--format", "fmt", type=click.Choice(["auto", "saved", "parquet", "jsonl", "text"]), default="auto", show_default=True, help="saved: a save_to_disk directory; auto tells it and the files' format from the path.")
@click.option("--text-field", default="text", show_default=True, help="The column that holds each document's text.")
@click.option("--split", help="The split of a saved DatasetDict (default: train, or its only split).")
@click.option("--eos", help="The end-of-document token, where the tokenizer names none.")
@click.option("--mtp-heads", type=click.IntRange(0, MAX_MTP_HEADS), default=0, show_default=True, help="The model's mtpHeads: one more token per sample each.")
@click.option("--shard-tokens", type=click.IntRange(min=1), default=1 << 27, show_default=True, help="Tokens per shard file (rounded down to whole samples): 256 MiB of uint16.")
@click.option("--force", is_flag=True, help="Replace what an earlier prepare wrote to --out.")
def data_prepare(source: Path, tokenizer_dir: Path, seq_len: int, out: Path, fmt: str,
                 text_field: str, split: str | None, eos: str | None, mtp_heads: int,
                 shard_tokens: int, force: bool) -> None:
    """Tokenize the local dataset SOURCE and pack it into token shards for training.data
    {kind: prepared, path: OUT}.

    SOURCE is a save_to_disk directory, or parquet, jsonl or text files (one, or a directory
    of them; a text file's lines are its documents). Each document is followed by the
    end-of-sequence token; the tokens are concatenated and cut into samples, and the tokens
    after the last whole sample are dropped. Nothing is downloaded. An --out that is not empty
    is refused, unless --force replaces an earlier prepare's output.
    """
    from tidal_agent.prepare import PrepareError, load_tokenizer, prepare, resolve_source

    columns = (TextColumn("[progress.description]{task.description}"), BarColumn(),
               MofNCompleteColumn(), TimeRemainingColumn())
    try:
        found = resolve_source(source, fmt)
        tokenizer = load_tokenizer(tokenizer_dir, eos)
        # A bar where someone watches; elsewhere (logs, pipes) the summary line only.
        with Progress(*columns, console=_console, transient=True,
                      disable=not _console.is_terminal) as progress:
            task = progress.add_task(f"reading {source}", total=None)
            meta = prepare(
                found, tokenizer, out, seq_len=seq_len, mtp_heads=mtp_heads,
                text_field=text_field, split=split, shard_tokens=shard_tokens, force=force,
                progress=lambda done, total: progress.update(
                    task, completed=done, total=total, description="tokenizing documents"),
            )
    except PrepareError as err:
        raise click.ClickException(str(err)) from None
    except OSError as err:
        raise click.ClickException(f"{err.filename or out}: {err.strerror}") from None
    _console.print(
        f"prepared {meta['samples']:,} samples of {meta['sample_len']} tokens "
        f"({meta['source']['documents']:,} documents, {meta['tokens']:,} tokens, "
        f"{meta['dropped_tokens']:,} dropped after the last sample) in "
        f"{len(meta['shards'])} {meta['dtype']} shard{'s' * (len(meta['shards']) != 1)} to "
        f"{out}", soft_wrap=True
    )


if __name__ == "__main__":
    sys.exit(main())
