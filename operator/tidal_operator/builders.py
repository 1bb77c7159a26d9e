"""The Kubernetes objects the operator creates for a job: worker pods, its rendezvous pod and
a headless Service.

Pure functions from (job, worker index, generation) to manifests, so that the names are
deterministic: a restarted operator that re-creates a pod it already made gets a conflict,
never a duplicate. The job's rendezvous (its store and presence server, ``tidal rendezvous``)
runs in a pod of its own, ``<job>-rendezvous``, apart from every worker so that it outlives any
one of them; the workers reach it on ``<job>-rendezvous.<job>.<namespace>.svc`` through the
headless Service.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tidal_api import API_VERSION, KIND, ElasticTrainingJob, Target, keys
from tidal_operator.policy import BELOW_MINIMUM, STARTED
from tidal_operator.queues import (
    KUEUE_ADMISSION_GATE,
    KUEUE_POD_GROUP_COUNT,
    KUEUE_POD_GROUP_LABEL,
    KUEUE_QUEUE_LABEL,
)

WORKER_SERVICE_ACCOUNT = "tidal-worker"
AGENT_CONTAINER = "agent"


def worker_name(job: str, index: int) -> str:
    return f"{job}-worker-{index}"


def worker_index(pod_name: str) -> int:
    """``tiny-worker-3`` -> 3."""
    return int(pod_name.rsplit("-", 1)[1])


def owner_reference(job: ElasticTrainingJob, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.metadata.name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def job_labels(name: str, role: str = "worker") -> dict[str, str]:
    return {keys.JOB_LABEL: name, keys.ROLE_LABEL: role, keys.MANAGED_BY: "tidal"}


def rendezvous_name(job: str) -> str:
    return f"{job}-rendezvous"


def rendezvous_host(name: str, namespace: str) -> str:
    return f"{rendezvous_name(name)}.{name}.{namespace}.svc"


def pod_group(name: str, uid: str, restarts: int) -> str:
    """The Kueue pod group of a job's queued workers (a label value: 63 characters at most).
    One per start of the job object: a restart's pods form a new group (and Workload), never
    joining the Workload of the pods before, which Kueue may not have let go yet."""
    suffix = f"-r{restarts}-{uid[:5]}"
    return name[: 63 - len(suffix)] + suffix


def queued_joiner(job: ElasticTrainingJob, target: Target, name: str) -> bool:
    """Whether joiner ``name`` of ``target`` is one of the job's minimum, which its Kueue queue
    admits (``spec.queueName``): the first ``workers.min`` of a start, and every worker that
    restores a job below its minimum. The workers of a scale-up into idle GPUs never are."""
    if job.spec.queue_name is None or name not in target.join:
        return False
    if target.reason == STARTED:
        return target.join.index(name) < job.spec.workers.min
    return target.reason == BELOW_MINIMUM


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerSettings:
    """What the operator's own flags put in every worker pod."""

    gpu_resource: str = "nvidia.com/gpu"  # the extended resource a worker's GPUs are asked as
    lost_after_s: float = 5.0  # the agents' --lost-after (TIDAL_LOST_AFTER)


def worker_pod(
    job: ElasticTrainingJob, *, uid: str, index: int, generation: int,
    settings: WorkerSettings = WorkerSettings(), group: str | None = None,
) -> dict[str, Any]:
    """The pod of worker ``index``, created for ``generation``; with ``group``, one of the
    job's minimum that its Kueue queue admits as that pod group (:func:`queued`), else a
    worker on idle GPUs at the elastic workers' low priority."""
    name, namespace = job.metadata.name, job.metadata.namespace or "default"
    spec = job.spec
    template = spec.template
    pod_name = worker_name(name, index)
    resources = template.resources.model_dump(by_alias=True, exclude_none=True)
    limits = dict(resources.get("limits") or {})
    limits[settings.gpu_resource] = spec.gpus_per_worker
    resources["limits"] = limits
    env = [
        {"name": keys.ENV_JOB, "value": name},
        {"name": keys.ENV_NAMESPACE, "value": namespace},
        {"name": keys.ENV_POD, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": keys.ENV_RENDEZVOUS_HOST, "value": rendezvous_host(name, namespace)},
        {"name": keys.ENV_RENDEZVOUS_PORT, "value": str(keys.RENDEZVOUS_PORT)},
        {"name": keys.ENV_METRICS_PORT, "value": str(keys.METRICS_PORT)},
        {"name": keys.ENV_LOST_AFTER, "value": f"{settings.lost_after_s:g}"},
        *template.env,
    ]
    container: dict[str, Any] = {
        "name": AGENT_CONTAINER,
        "image": template.image,
        "imagePullPolicy": template.image_pull_policy,
        "command": ["tidal", "agent"],
        "env": env,
        "ports": [{"name": "metrics", "containerPort": keys.METRICS_PORT}],
        "resources": resources,
        # A failed agent's last log lines stay in its status: the Event of the restart that
        # deletes the pod quotes them.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if template.volume_mounts:
        container["volumeMounts"] = list(template.volume_mounts)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # a worker that exits has left the job; the agent decides
        "priorityClassName": keys.ELASTIC_PRIORITY_CLASS,
        "serviceAccountName": WORKER_SERVICE_ACCOUNT,
        "hostname": pod_name,
        "subdomain": name,  # with the headless Service: <pod>.<job>.<ns>.svc
        "containers": [container],
    }
    if template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        pod_spec["tolerations"] = list(template.tolerations)
    if template.volumes:
        pod_spec["volumes"] = list(template.volumes)
    if template.termination_grace_period_seconds is not None:
        pod_spec["terminationGracePeriodSeconds"] = template.termination_grace_period_seconds
    labels = {
        **template.labels,
        **job_labels(name),
        keys.WORKER_LABEL: str(index),
        keys.GENERATION_LABEL: str(generation),
        keys.ELASTIC_LABEL: "true",
    }
    annotations = dict(template.annotations)
    if group is not None:
        queued(job, group, labels, annotations, pod_spec)
    return _pod(job, uid, pod_name, labels, pod_spec, annotations=annotations)


def queued(job: ElasticTrainingJob, group: str, labels: dict[str, str],
           annotations: dict[str, str], pod_spec: dict[str, Any]) -> None:
    """Make a worker pod one of the Kueue pod group ``group`` of the job's minimum, as Kueue's
    plain-pod integration expects of a group: the queue and group labels and the group's size
    on every member, and the admission gate (Kueue's webhook adds it too, where it manages the
    namespace; the operator adds it so that no member can start before Kueue admits the group
    wherever it runs). Kueue orders the group by the pods' PriorityClass:
    ``spec.priorityClassName``, else the cluster's default."""
    labels[KUEUE_QUEUE_LABEL] = str(job.spec.queue_name)
    labels[KUEUE_POD_GROUP_LABEL] = group
    annotations[KUEUE_POD_GROUP_COUNT] = str(job.spec.workers.min)
    pod_spec["schedulingGates"] = [{"name": KUEUE_ADMISSION_GATE}]
    if job.spec.priority_class_name is None:
        del pod_spec["priorityClassName"]
    else:
        pod_spec["priorityClassName"] = job.spec.priority_class_name


def rendezvous_pod(job: ElasticTrainingJob, *, uid: str) -> dict[str, Any]:
    """The job's rendezvous: ``tidal rendezvous`` in the agent's image, on a CPU (it asks for
    no GPU), where the template lets the workers run."""
    name, namespace = job.metadata.name, job.metadata.namespace or "default"
    template = job.spec.template
    pod_name = rendezvous_name(name)
    container: dict[str, Any] = {
        "name": "rendezvous",
        "image": template.image,
        "imagePullPolicy": template.image_pull_policy,
        "command": ["tidal", "rendezvous"],
        "env": [
            {"name": keys.ENV_JOB, "value": name},
            {"name": keys.ENV_NAMESPACE, "value": namespace},
            {"name": keys.ENV_POD, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": keys.ENV_RENDEZVOUS_PORT, "value": str(keys.RENDEZVOUS_PORT)},
        ],
        "ports": [{"name": "rendezvous", "containerPort": keys.RENDEZVOUS_PORT}],
        "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # lost, the job restarts (with a new one)
        "serviceAccountName": WORKER_SERVICE_ACCOUNT,
        "automountServiceAccountToken": False,  # it never talks to the API server
        "hostname": pod_name,
        "subdomain": name,  # with the headless Service: <pod>.<job>.<ns>.svc
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
    }
    if template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        pod_spec["tolerations"] = list(template.tolerations)
    return _pod(job, uid, pod_name, {**template.labels, **job_labels(name, "rendezvous")},
                pod_spec)


def _pod(job: ElasticTrainingJob, uid: str, name: str, labels: dict[str, str],
         spec: dict[str, Any], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod of the job's, owned by it."""
    meta: dict[str, Any] = {"name": name, "namespace": job.metadata.namespace or "default",
                            "labels": labels}
    if annotations is not None:
        meta["annotations"] = annotations
    meta["ownerReferences"] = [owner_reference(job, uid)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def headless_service(job: ElasticTrainingJob, *, uid: str) -> dict[str, Any]:
    """DNS names for the job's pods; only the rendezvous pod's port is used."""
    name, namespace = job.metadata.name, job.metadata.namespace or "default"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": job_labels(name),
            "ownerReferences": [owner_reference(job, uid)],
        },
        "spec": {
            "clusterIP": "None",
            # every pod resolves the rendezvous before it is ready
            "publishNotReadyAddresses": True,
            "selector": {keys.JOB_LABEL: name},
            "ports": [{"name": "rendezvous", "port": keys.RENDEZVOUS_PORT}],
        },
    }
