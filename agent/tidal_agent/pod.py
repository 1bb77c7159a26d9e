"""``tidal agent``: one pod's worker of an ElasticTrainingJob, its identity from the environment.

``run_agent`` reads the job through its ``ControlLink`` (tidal_agent.link), joins the job's
rendezvous (its store in the job's rendezvous pod, tidal_agent.host), and trains through the
generations the operator's targets give (``ControlledGenerations``, tidal_agent.generations),
reporting on the leader through an ``AgentReport`` (tidal_agent.report). ``<job>-worker-0``
leads first; a survivor takes the lead from a lost leader, and with it the link to the API
server and the report's history. SIGTERM stops it at the next step boundary; the leader, asked
to stop, halts the job there. Its GPU is what the pod was given (``pod_transport``), never a
number in its name.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tidal_agent.devices import bind_gpu, prepare_worker, visible_gpus
from tidal_agent.devices import plan_device as default_plan_device  # _run has a plan_device
from tidal_agent.events import Profiled
from tidal_agent.generations import ControlledGenerations
from tidal_agent.link import ControlError, ControlLink
from tidal_agent.metrics import AgentMetrics
from tidal_agent.host import CLOSED_KEY
from tidal_agent.presence import Presence
from tidal_agent.report import AgentReport
from tidal_agent.runner import profile_accuracy
from tidal_agent.trainer import params_sha256
from tidal_agent.worker import train
from tidal_agent.worker_options import WorkerOptions
from tidal_agent.world import Rendezvous
from tidal_api import ElasticTrainingJob, keys
from tidal_api.layout import Layout, LayoutError
from tidal_plan.devices import Device, load_device
from tidal_plan.elastic import data_parallel_degree
from tidal_plan.gpus import CPU_TRANSPORTS, DeviceChoiceError, choose_devices
from tidal_plan.planner import LayoutPlanner, plan_job
from tidal_plan.predictors import ProfiledPredictor
from tidal_plan.profiled import ProfileError, load_profile

log = logging.getLogger("tidal.agent")


@dataclass(frozen=True, kw_only=True, slots=True)
class PodIdentity:
    """Who this agent is: its job, its pod, and where the job's rendezvous is."""

    job: str
    namespace: str
    pod: str
    rendezvous_host: str
    rendezvous_port: int = keys.RENDEZVOUS_PORT

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> PodIdentity:
        names = (keys.ENV_JOB, keys.ENV_NAMESPACE, keys.ENV_POD, keys.ENV_RENDEZVOUS_HOST)
        if missing := [n for n in names if not env.get(n)]:
            raise ControlError(
                f"set {', '.join(missing)}: the operator puts them in every worker pod"
            )
        port = env.get(keys.ENV_RENDEZVOUS_PORT) or str(keys.RENDEZVOUS_PORT)
        if not port.isdigit():
            raise ControlError(f"{keys.ENV_RENDEZVOUS_PORT}={port!r} is not a port number")
        return cls(job=env[keys.ENV_JOB], namespace=env[keys.ENV_NAMESPACE],
                   pod=env[keys.ENV_POD], rendezvous_host=env[keys.ENV_RENDEZVOUS_HOST],
                   rendezvous_port=int(port))

    @property
    def leader(self) -> str:
        return f"{self.job}-worker-0"


def pod_transport(backend: str, env: MutableMapping[str, str] = os.environ) -> str:
    """This pod's transport for ``--backend`` (auto, gloo, nccl, host or nccl-model; auto: nccl
    where the pod has a GPU, else gloo), its GPU bound first, before CUDA starts in this
    process: the ``LOCAL_RANK``-th (default the first) of those the pod was given."""
    if backend in CPU_TRANSPORTS:
        return backend
    rank = env.get("LOCAL_RANK") or "0"
    if not rank.isdigit():
        raise DeviceChoiceError(f"LOCAL_RANK={rank!r} is not a GPU index")
    gpus = 0
    try:
        bind_gpu(int(rank), env)
        gpus = visible_gpus()
    except DeviceChoiceError as err:  # not among the pod's GPUs: auto goes on without one
        if backend != "auto":
            raise DeviceChoiceError(f"transport {backend} needs a GPU: {err}") from None
    return choose_devices("auto", backend, gpus=gpus, workers=1).transport


def run_agent(
    identity: PodIdentity,
    *,
    kubeconfig: str | None = None,
    threads: int = 1,
    steps: int | None = None,
    plan_device: str | None = None,
    publish_interval_s: float = 2.0,
    timeout_s: float = 120.0,
    lost_after_s: float = 5.0,
    transport: str = "gloo",
    report_path: str | Path | None = None,
    metrics_port: int | None = None,
    profiled_table: bool = True,
    slowdown: tuple[int, int, float] | None = None,
) -> dict[str, Any]:
    """Train as ``identity.pod`` until the job's last step or until released; the leader
    returns (and writes to ``report_path``) the run's report, other pods what they saw.
    With ``metrics_port``, Prometheus metrics (tidal_agent.metrics) are served on it; with
    ``profiled_table`` every generation profiles its first steps and the leader publishes
    the scale table planned from each profile (else nothing is profiled and the
    modeling-based table stays);
    ``slowdown`` (first step, end step, factor) makes this pod a straggler, for tests;
    ``lost_after_s``: the heartbeat silence after which the fault path counts a member lost;
    ``transport``: ``pod_transport``'s, its GPU bound; ``plan_device``: the planner's device
    description (default: what the pod trains on, cpu or its GPU's)."""
    link = ControlLink(identity.job, identity.namespace, kubeconfig=kubeconfig,
                       publish_interval_s=publish_interval_s)
    metrics = AgentMetrics(namespace=identity.namespace, job=identity.job, pod=identity.pod,
                           leader=identity.pod == identity.leader)
    try:
        if metrics_port:
            try:
                metrics.serve(metrics_port)
            except OSError as err:
                raise ControlError(f"cannot serve metrics on port {metrics_port}: {err}") from err
        return _run(identity, link, threads=threads, steps=steps, plan_device=plan_device,
                    timeout_s=timeout_s, lost_after_s=lost_after_s, transport=transport,
                    report_path=report_path, metrics=metrics,
                    profiled_table=profiled_table, slowdown=slowdown)
    finally:
        link.close()
        metrics.close()


def _run(identity: PodIdentity, link: ControlLink, *, threads: int, steps: int | None,
         plan_device: str | None, timeout_s: float, lost_after_s: float, transport: str,
         report_path: str | Path | None, metrics: AgentMetrics,
         profiled_table: bool = True,
         slowdown: tuple[int, int, float] | None = None) -> dict[str, Any]:
    job = link.job()
    spec = job.spec
    if spec.gpus_per_worker != 1:
        raise ControlError(
            f"spec.gpusPerWorker is {spec.gpus_per_worker}: tidal agent runs one rank per pod "
            "for now; set gpusPerWorker: 1"
        )
    steps = steps or spec.training.steps
    if steps > spec.training.steps:
        raise ControlError(f"--steps {steps} exceeds spec.training.steps ({spec.training.steps})")
    leading = identity.pod == identity.leader
    # First, before anything here starts CUDA (reading the GPU's name for the planner does).
    where = prepare_worker(transport, None, threads=threads,
                           strict=spec.parallelism.consistency == "strict")
    # The job's long-lived store: in its rendezvous pod (tidal_agent.host), apart from every
    # worker, so that it outlives any one of them.
    rendezvous = Rendezvous(host=identity.rendezvous_host, port=identity.rendezvous_port,
                            prefix=f"{identity.job}/", timeout_s=timeout_s, transport=transport)
    report = AgentReport(None, metrics=metrics.job, final_step=steps,
                         tokens_per_step=spec.training.global_batch_size * spec.model.seq_len)
    device = load_device(plan_device or default_plan_device(where.device.type))
    planner = LayoutPlanner(job, device)

    def choose(workers: int) -> tuple[Layout, float | None]:
        """The layout ``tidal run`` would pick for this count (dp by the same rule)."""
        layout, prediction = planner.layout(workers, data_parallel_degree(spec))
        return layout, prediction.step_seconds

    stop = _stop_on_sigterm(identity.pod)
    store = rendezvous.connect()
    source = ControlledGenerations(
        me=identity.pod, leader=identity.leader, store=store, min_workers=spec.workers.min,
        steps=steps, choose=choose, target=link.target, report=report,
        checkpoint_root=spec.checkpoint.path, heartbeat=rendezvous.connect(),
        fault_wait_s=2 * timeout_s + 30,  # past any member's own timeout on a dead peer
        lost_after_s=lost_after_s, stop=stop,
        presence=Presence(store, identity.rendezvous_host),
    )

    led = threading.Event()

    def lead(refresh: bool) -> None:
        """This pod leads (first, or in place of a lost leader): it follows the target and
        publishes the job's progress, after the history the leaders before it kept."""
        if refresh:  # the target now, not as it was when this pod started
            try:
                link.job(retry_for_s=5.0)
            except ControlError as err:
                log.warning("leading with the target last seen: %s", err)
        if not led.is_set():  # (a pod counted lost, that lives on, may lead again)
            led.set()
            link.start()
            threading.Thread(target=_publish_scale_table, args=(link, job, device),
                             name="tidal-plan", daemon=True).start()
        report.on_profile = partial(_replan_from_profile, link, job, device)
        report.metrics = metrics.lead()
        report.lead(link, journal=rendezvous.connect())

    source.on_lead = partial(lead, True)
    if leading:
        lead(False)
    scratch = tempfile.mkdtemp(prefix="tidal-profile-")  # this pod's profiles
    opts = WorkerOptions(
        rendezvous=rendezvous, steps=steps, threads=threads,
        checkpoint_root=spec.checkpoint.path, checkpoint_every=spec.checkpoint.every_steps,
        peer_snapshots=spec.checkpoint.peer_snapshots,
        snapshot_every=spec.checkpoint.snapshot_every_steps, stop=stop,
        unit_seconds=planner.unit_seconds() if spec.stragglers.replan else (),
        profile_out=str(Path(scratch) / "profile.json") if profiled_table else None,
        slowdown=((identity.pod, *slowdown),) if slowdown else (),
    )
    try:
        train(identity.pod, spec, opts, report, source, where)
        report.settle()  # the last profiles kept and published before their files go
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    leading = source.leader == identity.pod  # (the first leader, or one that took the lead)
    if leading and report.halted is not None:
        _halt(identity, source, report, store, report_path, timeout_s)
    if report.digests is not None:  # a final member: the leader hashes all parameters
        store.set(f"digest/{identity.pod}", json.dumps(report.digests))
    if not leading:
        source.leave()
        if source.departed:  # the leader counts it lost, not among the pods that exit
            return {"pod": identity.pod, "left_at": report.left_at, "done": False}
        store.add("exited", 1)
        return {"pod": identity.pod, "left_at": report.left_at, "done": report.digests is not None}
    result = _leader_report(identity.job, source, report, store)
    _end(source, store, steps, result, report_path, timeout_s,
         finished=partial(link.publish, step=steps))
    return result


def _halt(identity: PodIdentity, source: ControlledGenerations, report: AgentReport,
          store: dist.Store, report_path: str | Path | None, timeout_s: float) -> None:
    """The leader, asked to stop, has halted the job at a step boundary that every member
    saved: standby pods leave, the others exit, and so does the leader, with SIGTERM's exit
    status (its pod fails), for the operator to restart the job from that checkpoint."""
    halted = report.halted
    _end(source, store, halted.step, {**_run_record(identity.job, source, report),
                                      "halted": halted.record()}, report_path, timeout_s)
    log.warning("%s: halted at step %d; the operator restarts the job from %s", identity.pod,
                halted.step, halted.checkpoint or "step 0 (spec.checkpoint.path is unset)")
    raise SystemExit(keys.STOPPED_EXIT_CODE)


def _end(source: ControlledGenerations, store: dist.Store, step: int, result: Mapping[str, Any],
         report_path: str | Path | None, timeout_s: float,
         finished: Callable[[], None] = lambda: None) -> None:
    """The leader's part at the job's end, at its last step or halted: the report is
    written before ``finished`` says the job is done (whoever then sees it Succeeded finds
    the report), standby pods leave, and once every other registered pod is done with the
    store, the rendezvous may close."""
    if report_path is not None:
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        Path(report_path).write_text(json.dumps(result, indent=2) + "\n")
    finished()
    source.end(step)
    _wait_for_exits(store, len(set(source.registered()) - source.lost) - 1, timeout_s)
    store.set(CLOSED_KEY, str(step))


def _stop_on_sigterm(pod: str) -> threading.Event:
    """An event SIGTERM sets (a pod is deleted, preempted or its node drained): the worker
    leaves at its next step boundary rather than die mid-step, or, in a container where the
    agent is PID 1, ignore the signal until the kubelet's SIGKILL."""
    stop = threading.Event()

    def on_sigterm(signum: int, frame: Any) -> None:
        if not stop.is_set():
            log.warning("%s: SIGTERM; stopping at the next step boundary", pod)
            stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    return stop


def _leader_report(job: str, source: ControlledGenerations, report: AgentReport,
                   store: dist.Store) -> dict[str, Any]:
    """The run as the leader saw it, with one hash over every final parameter."""
    digests: dict[int, tuple[str, str]] = {}
    for pod in source.current.members:
        received = json.loads(store.get(f"digest/{pod}"))
        digests.update({int(k): (name, digest) for k, (name, digest) in received.items()})
    return {
        **_run_record(job, source, report),
        "params_sha256": params_sha256(digests, report.num_params),
    }


def _run_record(job: str, source: ControlledGenerations, report: AgentReport) -> dict[str, Any]:
    """The run as the leader saw it: where it trains and started, its generations, steps,
    switches and recoveries, and where it is now."""
    return {
        "job": job, **report.setup, "members": list(source.current.members),
        "resumed_from": source.resume_from,
        "layout": source.layout(source.current).to_dict(), "generations": report.generations,
        "steps": report.steps, "reconfigurations": report.reconfigurations,
        "recoveries": report.recoveries, "stragglers": report.stragglers,
        "replans": report.replans, "profiles": report.profiled,
        "accuracy": profile_accuracy(report.profiled, report.steps),
    }


def _replan_from_profile(link: ControlLink, job: ElasticTrainingJob, device: Device,
                         event: Profiled) -> float | None:
    """A generation's online profile is in: the scale table again, from both predictors (the
    profiling-based one choosing, the modeling-based one checking, rows where they disagree
    dropped), published; the profiled prediction of the running layout returned."""
    try:
        profile = load_profile(event.path)
        table, _ = plan_job(job, device, profile=profile)
        link.publish(scale_table=table)
    except (ProfileError, LayoutError, ValueError) as err:
        log.error("no scale table from the profile of steps %s: %s", event.steps, err)
        return None
    return ProfiledPredictor(profile, job.spec.model.seq_len).predict(event.layout).step_seconds


def _publish_scale_table(link: ControlLink, job: ElasticTrainingJob, device: Device) -> None:
    """Plan the job's scale table (as ``tidal plan`` does) off the training thread."""
    try:
        table, _ = plan_job(job, device)
    except (LayoutError, ValueError) as err:
        log.error("no scale table: %s", err)
        return
    link.publish(scale_table=table)


def _wait_for_exits(store: dist.Store, others: int, timeout_s: float) -> None:
    """Wait until every other registered pod is done with the store."""
    deadline = time.monotonic() + timeout_s
    while store.add("exited", 0) < others and time.monotonic() < deadline:
        time.sleep(0.05)
