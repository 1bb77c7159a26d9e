"""The cluster as the policy sees it: plain frozen records, nothing that talks to Kubernetes.

The operator's adapter builds a :class:`Snapshot` from its indexes of nodes, pods and
ElasticTrainingJobs; :func:`tidal_operator.policy.decide` reads it. The records are slotted
frozen dataclasses with no validation beyond what the policy relies on, so that building one
for a thousand nodes and thousands of pods costs little next to the decision itself.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tidal_api import ScaleTable, keys

# A pod in one of these phases has given its GPUs back, wherever it is bound.
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})
# Taint effects that keep a pod without a matching toleration off a node (PreferNoSchedule
# only steers the scheduler, so it does not).
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


def _pairs(labels: Mapping[str, Any] | None) -> frozenset[tuple[str, str]]:
    """A label map (node labels, a node selector) as a set of (key, value) pairs."""
    return frozenset((str(k), str(v)) for k, v in (labels or {}).items())


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True, slots=True)
class Toleration:
    """A pod's toleration, matched as the scheduler matches it: an empty effect tolerates
    every effect, ``Exists`` any value (and with an empty key, every taint), ``Equal`` (the
    default) the same key and value."""

    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        if self.operator == "Exists":
            return True
        return bool(self.key) and self.value == taint.value


@dataclass(frozen=True, slots=True)
class Node:
    """A node: its allocatable GPUs, labels and the taints that keep pods off it."""

    name: str
    gpus: int
    labels: frozenset[tuple[str, str]] = frozenset()
    taints: tuple[Taint, ...] = ()

    @property
    def open_to_all(self) -> bool:
        """Whether a pod without a node selector or tolerations may run here."""
        return not any(t.effect in BLOCKING_EFFECTS for t in self.taints)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a pod may run, as its spec says: ``nodeSelector`` labels and tolerations.

    Node affinity is not read: a pod that needs it may be placed by the policy on a node the
    scheduler then refuses, and it waits there as any unschedulable pod does.
    """

    node_selector: frozenset[tuple[str, str]] = frozenset()
    tolerations: tuple[Toleration, ...] = ()

    @classmethod
    def of(cls, node_selector: Mapping[str, str] | None,
           tolerations: Iterable[Mapping[str, Any]] | None) -> Placement:
        """From a pod spec's ``nodeSelector`` and ``tolerations`` (Kubernetes' field names);
        the shared ``ANYWHERE`` where there are neither, as for most pods."""
        if not node_selector and not tolerations:
            return ANYWHERE
        return cls(
            _pairs(node_selector),
            tuple(Toleration(key=t.get("key") or "", operator=t.get("operator") or "Equal",
                             value=str(t.get("value") or ""), effect=t.get("effect") or "")
                  for t in tolerations or ()),
        )

    def allows(self, node: Node) -> bool:
        """Whether the scheduler may put the pod on ``node``: every selector label there, and
        every NoSchedule or NoExecute taint tolerated."""
        return self.node_selector <= node.labels and all(
            any(t.tolerates(taint) for t in self.tolerations)
            for taint in node.taints if taint.effect in BLOCKING_EFFECTS)


ANYWHERE = Placement()


def node_of(name: str, gpus: int, labels: Mapping[str, str] | None,
            taints: Iterable[Mapping[str, Any]] | None) -> Node:
    """A Node from a Kubernetes node's name, GPUs, ``metadata.labels`` and ``spec.taints``."""
    return Node(name, gpus, _pairs(labels),
                tuple(Taint(t.get("key") or "", str(t.get("value") or ""),
                            t.get("effect") or "NoSchedule") for t in taints or ()))


@dataclass(frozen=True, slots=True)
class Pod:
    """A pod that asks for GPUs (pods that ask for none may be left out).

    ``job`` is the ElasticTrainingJob key ("ns/name", from the ``tidal.dev/job`` label) of a
    Tidal worker pod and None for every other pod: the policy makes room for those and never
    touches them. ``unschedulable`` is the scheduler's PodScheduled=False/Unschedulable verdict;
    the policy does its own GPU accounting and keeps it for reporting only. ``placement`` is
    where the pod may run: the policy makes room for a pending pod only on such a node.
    """

    key: str
    gpus: int
    node: str | None = None
    phase: str = "Pending"
    job: str | None = None
    unschedulable: bool = False
    created: float = 0.0  # epoch seconds
    placement: Placement = ANYWHERE
    deleting: bool = False  # its deletion was asked for (it may still run, and hold its GPUs)
    exit_code: int | None = None  # of its first container, once terminated
    last_words: str = ""  # the last line of that container's termination message

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED_PHASES


@dataclass(frozen=True, slots=True, kw_only=True)
class ElasticJob:
    """One ElasticTrainingJob: its spec's bounds and scaling settings and its applied state.

    ``workers`` is the applied worker count and ``members`` its pods in rank order;
    ``members[0]`` is the leader, which holds the rendezvous and is never released. ``busy``
    means a target is outstanding (``status.target.generation`` differs from the applied
    ``status.generation``); ``releasing`` names that target's released pods, whose GPUs are as
    good as free for a pending pod. ``switch_seconds`` is the measured pause of the last switch
    (``status.lastSwitchSeconds``), else ``spec.scaling.switchOverheadSeconds``.
    ``last_scale_time`` is ``status.lastScaleTime`` in epoch seconds.
    ``arrival_window_seconds`` is ``spec.scaling.arrivalWindowSeconds``. ``placement`` is
    the worker pods' (``spec.template``'s node selector and tolerations): new workers go only
    to nodes it allows. ``slow`` names the stragglers the agent asks to release.
    """

    key: str
    min_workers: int
    max_workers: int
    workers: int
    max_scale_factor: int = 4
    gpus_per_worker: int = 1
    members: tuple[str, ...] = ()
    busy: bool = False
    releasing: tuple[str, ...] = ()
    scale_table: ScaleTable | None = None
    enabled: bool = True
    probability_threshold: float = 0.6
    loaded_threshold: float = 0.9  # where the threshold slides on a loaded cluster
    min_gain: float = 0.05
    arrival_window_seconds: float | None = None  # None: the snapshot's window
    cooldown_seconds: float = 60.0
    last_scale_time: float | None = None
    switch_seconds: float = 30.0
    placement: Placement = ANYWHERE
    # Members the agent asks to release as stragglers (status.stragglers[].release).
    slow: tuple[str, ...] = ()
    # No target yet: the operator is to start it, with up to ``preferred_workers``
    # (spec.workers.preferred; None: the minimum).
    unstarted: bool = False
    preferred_workers: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"{self.key}: need 1 <= min_workers <= max_workers, got "
                f"{self.min_workers}..{self.max_workers}"
            )
        if self.gpus_per_worker < 1 or self.max_scale_factor < 1:
            raise ValueError(f"{self.key}: gpus_per_worker and max_scale_factor must be >= 1")

    @property
    def preferred(self) -> int:
        """The workers it asks to start with."""
        return self.min_workers if self.preferred_workers is None else self.preferred_workers

    @property
    def cap(self) -> int:
        """The most workers the job may have: maxWorkers, and maxScaleFactor x minWorkers."""
        return min(self.max_workers, self.max_scale_factor * self.min_workers)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Nodes, GPU pods and elastic jobs at one moment, and recent non-elastic arrivals.

    ``arrivals`` are the creation times (epoch seconds, any order) of the non-elastic GPU pods
    created within ``window_seconds`` (at least the longest arrival window of any job),
    including pods already gone: the Poisson rule estimates the arrival rate from them.
    """

    nodes: tuple[Node, ...]
    pods: tuple[Pod, ...] = ()
    jobs: tuple[ElasticJob, ...] = ()
    arrivals: tuple[float, ...] = ()
    window_seconds: float = 28800.0
    # The GPUs of each of ``arrivals``, in the same order; empty where unknown (each then
    # counts as one GPU, the least a GPU pod asks for).
    arrival_gpus: tuple[int, ...] = ()
    # The share of the nodes' GPUs owed (owed_share), smoothed over the window by the
    # operator across rounds (tidal_operator.policy.Load): how loaded the cluster is.
    load: float = 0.0

    def owed_share(self) -> float:
        """The share of the nodes' GPUs that the cluster owes now: those the bound unfinished
        non-elastic pods hold, and an elastic job's up to its minimum (the workers above it
        run on lent GPUs). What the cluster would hold with no GPU lent. Pods bound to a node
        the snapshot leaves out (a cordoned one) count no more than its GPUs do."""
        nodes = {node.name for node in self.nodes}
        total = sum(node.gpus for node in self.nodes)
        if total <= 0:
            return 0.0
        elastic: dict[str, int] = {}
        owed = 0
        for pod in self.pods:
            if pod.node not in nodes or pod.phase in FINISHED_PHASES:
                continue
            if pod.job is None:
                owed += pod.gpus
            else:
                elastic[pod.job] = elastic.get(pod.job, 0) + pod.gpus
        minimum = {job.key: job.min_workers * job.gpus_per_worker for job in self.jobs}
        owed += sum(min(gpus, minimum.get(key, gpus)) for key, gpus in elastic.items())
        return min(owed / total, 1.0)

    def used_gpus(self) -> dict[str, int]:
        """GPUs held on each node by the pods bound to it that have not finished."""
        used = dict.fromkeys((n.name for n in self.nodes), 0)
        for pod in self.pods:
            if pod.node in used and pod.phase not in FINISHED_PHASES:
                used[pod.node] += pod.gpus
        return used


def parse_time(text: str | None) -> float | None:
    if not text:
        return None
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def gpus_of(resources: Mapping[str, Any] | None, resource: str) -> int:
    """GPUs in a resource map (``{"nvidia.com/gpu": "8"}``); quantities are whole GPUs."""
    value = (resources or {}).get(resource, 0)
    try:
        return int(str(value))
    except ValueError:
        return 0


def pod_gpus(spec: Mapping[str, Any], resource: str) -> int:
    """The GPUs a pod holds, as the kube-scheduler counts them: the sum over its containers'
    requests (a limit stands for a request not given, as the API server defaults it), or the
    largest init container's, where that is more."""

    def request(container: Mapping[str, Any]) -> int:
        res = container.get("resources") or {}
        requests, limits = res.get("requests") or {}, res.get("limits") or {}
        return gpus_of(requests if resource in requests else limits, resource)

    return max(sum(map(request, spec.get("containers") or ())),
               max(map(request, spec.get("initContainers") or ()), default=0))


def pod_view(body: Mapping[str, Any], resource: str) -> Pod:
    """The index entry of one pod: what the policy needs and nothing else."""
    meta, spec, status = body["metadata"], body.get("spec") or {}, body.get("status") or {}
    labels = meta.get("labels") or {}
    job = labels.get(keys.JOB_LABEL)
    terminated = next((c["state"]["terminated"] for c in status.get("containerStatuses") or ()
                       if (c.get("state") or {}).get("terminated")), {})
    unschedulable = any(
        c.get("type") == "PodScheduled" and c.get("status") == "False"
        and c.get("reason") == "Unschedulable"
        for c in status.get("conditions") or ()
    )
    return Pod(
        key=f"{meta.get('namespace', 'default')}/{meta['name']}",
        node=spec.get("nodeName"),
        gpus=pod_gpus(spec, resource),
        phase=status.get("phase", "Pending"),
        job=f"{meta.get('namespace', 'default')}/{job}" if job else None,
        unschedulable=unschedulable,
        created=parse_time(meta.get("creationTimestamp")) or 0.0,
        placement=Placement.of(spec.get("nodeSelector"), spec.get("tolerations")),
        deleting=meta.get("deletionTimestamp") is not None,
        exit_code=terminated.get("exitCode"),
        last_words=(terminated.get("message") or "").strip().rsplit("\n", 1)[-1][:200],
    )
