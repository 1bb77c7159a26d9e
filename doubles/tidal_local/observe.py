"""What the one-machine cluster looks like now: one :class:`ClusterView` per look, read from
the API as any client would (plain HTTP GETs), for the live view, the timeline and the plot.

The numbers are the operator's: a node's GPUs, idle GPUs (less those of unfinished pods bound
to it), pending non-elastic GPU pods, and per ElasticTrainingJob what its status says (the
operator's target and phase, the agent leader's generation, members, layout, step and loss)
next to the job's worker pods as the API lists them.
"""

from __future__ import annotations

import datetime
import json
import urllib.request
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tidal_api import GROUP, VERSION, keys
from tidal_kube.clusterapi import FINISHED, GPU, gpu_request, node_gpus

Obj = dict[str, Any]
DECISIONS = ("ScaleUp", "ScaleDown", "DrainDeadline")


@dataclass(frozen=True, slots=True)
class JobView:
    """One ElasticTrainingJob: its status, and its worker pods by phase."""

    name: str
    namespace: str
    phase: str | None
    workers: int  # len(status.members): what the agent applied
    target_workers: int | None
    generation: int | None  # applied (the agent leader's)
    target_generation: int | None
    members: tuple[str, ...]
    dp: int | None
    pp: int | None
    step: int | None
    steps: int
    loss: float | None
    tokens_per_second: float | None
    last_decision: str | None
    pods: dict[str, str]  # worker pod -> phase ("Terminating" while deleted)

    @property
    def running_pods(self) -> list[str]:
        return sorted(p for p, phase in self.pods.items() if phase == "Running")


@dataclass(frozen=True, slots=True)
class EventView:
    at: str  # lastTimestamp
    job: str
    type: str
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class ClusterView:
    t: float  # seconds since the cluster started
    gpus: int
    idle_gpus: int
    pending_pods: int  # non-elastic GPU pods without a node
    pending_gpus: int
    batch_running: int  # non-elastic GPU pods holding GPUs
    nodes: dict[str, list[str]]  # node -> one mark per GPU: "E" elastic, "B" other, "." free
    jobs: tuple[JobView, ...]
    events: tuple[EventView, ...] = field(default=())

    def sample(self) -> dict[str, Any]:
        """A compact record for the timeline: the cluster and each job's numbers."""
        return {"t": round(self.t, 2), "gpus": self.gpus, "idle_gpus": self.idle_gpus,
                "pending_pods": self.pending_pods, "pending_gpus": self.pending_gpus,
                "jobs": {j.name: {k: v for k, v in asdict(j).items()
                                  if k not in ("name", "namespace", "last_decision")}
                         for j in self.jobs}}


def _get(url: str, path: str) -> Obj:
    with urllib.request.urlopen(url.rstrip("/") + path, timeout=10) as rsp:
        return json.load(rsp)


def observe(url: str, started_at: float, resource: str = GPU) -> ClusterView:
    """One look at the cluster behind the API at ``url``."""
    now = datetime.datetime.now(datetime.UTC).timestamp()
    nodes = sorted(_get(url, "/api/v1/nodes")["items"], key=lambda n: n["metadata"]["name"])
    pods = _get(url, "/api/v1/pods")["items"]
    jobs = _get(url, f"/apis/{GROUP}/{VERSION}/elastictrainingjobs")["items"]
    events = _get(url, "/api/v1/events")["items"]
    marks = {n["metadata"]["name"]: [] for n in nodes}
    pending = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        gpus = gpu_request(pod, resource)
        if not gpus or (pod.get("status") or {}).get("phase") in FINISHED:
            continue
        node = pod["spec"].get("nodeName")
        elastic = keys.JOB_LABEL in (pod["metadata"].get("labels") or {})
        if node in marks:
            marks[node] += ["E" if elastic else "B"] * gpus
        elif node is None and not elastic:
            pending.append(gpus)
    total = sum(node_gpus(n, resource) for n in nodes)
    for node in nodes:
        name = node["metadata"]["name"]
        marks[name] += ["."] * max(0, node_gpus(node, resource) - len(marks[name]))
    held = sum(len([m for m in v if m != "."]) for v in marks.values())
    return ClusterView(
        t=now - started_at, gpus=total, idle_gpus=max(total - held, 0),
        pending_pods=len(pending), pending_gpus=sum(pending),
        batch_running=sum(1 for p in pods if _batch_running(p, resource)),
        nodes=marks, jobs=tuple(_job_view(j, pods) for j in jobs),
        events=tuple(_event_views(events)),
    )


def _batch_running(pod: Obj, resource: str) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return (keys.JOB_LABEL not in labels and gpu_request(pod, resource) > 0
            and (pod.get("status") or {}).get("phase") == "Running")


def _job_view(job: Obj, pods: list[Obj]) -> JobView:
    meta, status = job["metadata"], job.get("status") or {}
    target, layout = status.get("target") or {}, status.get("layout") or {}
    mine = {}
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if (pod["metadata"]["namespace"] == meta["namespace"]
                and labels.get(keys.JOB_LABEL) == meta["name"]
                and labels.get(keys.ROLE_LABEL) == "worker"):
            phase = (pod.get("status") or {}).get("phase", "Pending")
            mine[pod["metadata"]["name"]] = ("Terminating" if pod["metadata"].get(
                "deletionTimestamp") else phase)
    return JobView(
        name=meta["name"], namespace=meta["namespace"], phase=status.get("phase"),
        workers=len(status.get("members") or ()), target_workers=target.get("workers"),
        generation=status.get("generation") if status.get("members") else None,
        target_generation=target.get("generation"), members=tuple(status.get("members") or ()),
        dp=layout.get("dp"), pp=layout.get("pp"), step=status.get("step"),
        steps=int(((job.get("spec") or {}).get("training") or {}).get("steps", 0)),
        loss=status.get("loss"), tokens_per_second=status.get("tokensPerSecond"),
        last_decision=status.get("lastDecision"), pods=mine,
    )


def _event_views(events: Iterable[Obj]) -> list[EventView]:
    out = []
    for event in events:
        involved = event.get("involvedObject") or {}
        if involved.get("kind") != "ElasticTrainingJob":
            continue
        out.append(EventView(at=event.get("lastTimestamp") or "", job=involved.get("name", ""),
                             type=event.get("type", ""), reason=event.get("reason", ""),
                             message=event.get("message", "")))
    return sorted(out, key=lambda e: (e.at, e.job))


# ---- the live view --------------------------------------------------------------------------

_MARK_STYLE = {"E": ("█", "cyan"), "B": ("█", "yellow"), ".": ("░", "grey50")}


def render(view: ClusterView, *, title: str = "tidal local", recent: int = 6) -> Group:
    """The live view: GPUs per node, each job's workers, layout, step and loss, the last
    decisions."""
    head = Text.assemble(
        (f"{title}  ", "bold"), f"t={view.t:5.0f}s  GPUs {view.gpus}  ",
        ("idle ", "grey50"), (f"{view.idle_gpus}", "bold green"),
        "  pending pods ", (f"{view.pending_pods}", "bold red" if view.pending_pods else ""),
        f" ({view.pending_gpus} GPUs)  batch jobs running {view.batch_running}")
    nodes = Text()
    for name, marks in view.nodes.items():
        nodes.append(f"{name:>8} ")
        for mark in marks:
            nodes.append(*_MARK_STYLE[mark])
        nodes.append("   ")
    nodes.append("  ")
    nodes.append("█ elastic  ", "cyan")
    nodes.append("█ other  ", "yellow")
    nodes.append("░ idle", "grey50")
    jobs = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("job", "phase", "workers", "target", "layout", "step", "loss", "tokens/s",
                   "worker pods"):
        jobs.add_column(column, justify="left" if column in ("job", "phase", "worker pods")
                        else "right")
    for job in view.jobs:
        layout = f"dp{job.dp} x pp{job.pp}" if job.dp else "-"
        pods = " ".join(f"{p.rsplit('-', 1)[-1]}:{phase[0]}" for p, phase in sorted(
            job.pods.items(), key=lambda item: int(item[0].rsplit("-", 1)[-1])))
        jobs.add_row(
            job.name, job.phase or "-", str(job.workers),
            str(job.target_workers) if job.target_workers is not None else "-", layout,
            f"{job.step or 0}/{job.steps}", f"{job.loss:.4f}" if job.loss is not None else "-",
            f"{job.tokens_per_second:,.0f}" if job.tokens_per_second else "-", pods)
    lines = [head, nodes, jobs if view.jobs else Text(
        "no ElasticTrainingJob yet: kubectl apply -f examples/demo.yaml", "grey50")]
    decisions = [e for e in view.events if e.reason in DECISIONS]
    for event in decisions[-recent:]:
        style = "green" if event.reason == "ScaleUp" else "red"
        lines.append(Text.assemble((f"{event.at[11:19]} {event.job} ", "grey50"),
                                   (f"{event.reason}", style), f" {event.message}",
                                   overflow="ellipsis", no_wrap=True))
    if not decisions:
        lines.append(Text("no scale decision yet", "grey50"))
    return Group(*lines)
