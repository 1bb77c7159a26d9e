"""Admission as in a default cluster: the defaults and checks the API server applies to an object
about to be stored, per kind. A pod needs its ServiceAccount and PriorityClass (and gets
``spec.priority`` from it), its requests default to limits, its spec is immutable (but its
scheduling gates may be removed) and one created with scheduling gates is PodScheduled=False,
SchedulingGated; a Service gets a cluster IP; a custom resource is pruned, defaulted and
validated with its CRD's structural schema (:mod:`tidal_kube.structural`); a CRD gets its
status."""

from __future__ import annotations

import copy
import ipaddress
import itertools

from tidal_kube import structural
from tidal_kube.resources import CRD_KEY, Catalog, Obj, Resource, api_error, now_rfc3339
from tidal_kube.storage import Storage
from tidal_kube.validation import crd_errors, pod_errors, pod_update_errors

SERVICE_CIDR = ipaddress.ip_network("10.96.0.0/12")


class Admission:
    """Defaults and validates writes against what is stored (service accounts, priority
    classes, schemas); hands out cluster IPs."""

    def __init__(self, storage: Storage, catalog: Catalog) -> None:
        self.storage = storage
        self.catalog = catalog
        self._ips = itertools.islice(SERVICE_CIDR.hosts(), 10, None)

    def admit(self, resource: Resource, obj: Obj, old: Obj | None) -> None:
        """Default and validate an object about to be stored (``old``: its current state)."""
        errors: list[str] = []
        if resource.custom:
            errors = structural.prepare(self.catalog.schema(resource), obj)
        elif resource.is_("", "pods"):
            errors = self._admit_pod(obj, old)
        elif resource.is_("", "services"):
            errors = self._admit_service(obj, old)
        elif resource.is_("", "secrets"):
            obj["type"] = obj.get("type") or "Opaque"
        elif resource.is_("", "namespaces"):
            phase = (old or {}).get("status", {}).get("phase", "Active")
            obj.setdefault("status", {})["phase"] = phase
        elif resource.is_(*CRD_KEY):
            errors = crd_errors(obj)
            obj["status"] = _crd_status(obj)
        if errors:
            raise resource.invalid(obj["metadata"]["name"], errors)

    def _admit_pod(self, pod: Obj, old: Obj | None) -> list[str]:
        spec = pod.setdefault("spec", {})
        _default_pod(spec)
        if old is not None:
            for field in ("priority", "priorityClassName"):  # set by admission at creation
                if field in old["spec"]:
                    spec.setdefault(field, old["spec"][field])
            return pod_update_errors(old, pod)
        pod["status"] = {"phase": "Pending", "qosClass": _qos_class(spec)}
        if spec.get("schedulingGates"):
            pod["status"]["conditions"] = [_scheduling_gated()]
        self._check_service_account(pod)
        self._set_priority(pod)
        return pod_errors(spec)

    def _check_service_account(self, pod: Obj) -> None:
        name, ns = pod["metadata"]["name"], pod["metadata"]["namespace"]
        account = pod["spec"]["serviceAccountName"]
        if ("", "serviceaccounts", ns, account) not in self.storage.objects:
            raise api_error(403, "Forbidden", f'pods "{name}" is forbidden: error looking up '
                            f'service account {ns}/{account}: serviceaccount "{account}" not found')

    def _set_priority(self, pod: Obj) -> None:
        """The Priority admission plugin: ``spec.priority`` from the named PriorityClass (or the
        global default); an unknown class refuses the pod."""
        spec = pod["spec"]
        classes = {key[3]: obj for key, obj in self.storage.objects.items()
                   if key[:2] == ("scheduling.k8s.io", "priorityclasses")}
        wanted = spec.get("priorityClassName")
        if wanted is None:
            wanted = next((name for name, c in classes.items() if c.get("globalDefault")), None)
        if wanted is None:
            spec["priority"] = 0
        elif wanted in classes:
            spec["priorityClassName"], spec["priority"] = wanted, classes[wanted]["value"]
        else:
            raise api_error(403, "Forbidden", f'pods "{pod["metadata"]["name"]}" is forbidden: '
                            f"no PriorityClass with name {wanted} was found")

    def _admit_service(self, service: Obj, old: Obj | None) -> list[str]:
        spec = service.setdefault("spec", {})
        errors = []
        old_ip = (old or {}).get("spec", {}).get("clusterIP")
        spec.setdefault("type", "ClusterIP")
        if old_ip is not None:
            if spec.setdefault("clusterIP", old_ip) != old_ip:
                errors.append("spec.clusterIP: Invalid value: field is immutable")
        elif spec.get("clusterIP") != "None":
            spec["clusterIP"] = str(next(self._ips))
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        ports = spec.get("ports") or []
        if not ports and spec["clusterIP"] != "None":
            errors.append("spec.ports: Required value")
        for index, port in enumerate(ports):
            if not isinstance(port.get("port"), int) or not 0 < port["port"] < 65536:
                errors.append(f"spec.ports[{index}].port: Invalid value: must be in 1-65535")
            if len(ports) > 1 and not port.get("name"):
                errors.append(f"spec.ports[{index}].name: Required value")
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
        return errors


def _default_pod(spec: Obj) -> None:
    """The defaults a real server fills into every pod it stores."""
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("serviceAccountName", spec.get("serviceAccount") or "default")
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        if not isinstance(container, dict):
            continue
        resources = container.setdefault("resources", {})
        limits = resources.get("limits") or {}
        if limits:  # requests default to limits
            resources["requests"] = {**limits, **(resources.get("requests") or {})}


def _qos_class(spec: Obj) -> str:
    containers = [c for c in spec.get("containers") or [] if isinstance(c, dict)]
    resources = [(c["resources"].get("limits") or {}, c["resources"].get("requests") or {})
                 for c in containers]
    if not any(limits or requests for limits, requests in resources):
        return "BestEffort"
    guaranteed = all(limits.get(kind) is not None and limits.get(kind) == requests.get(kind)
                     for limits, requests in resources for kind in ("cpu", "memory"))
    return "Guaranteed" if guaranteed else "Burstable"


def _scheduling_gated() -> Obj:
    """The condition the API server gives a pod created with scheduling gates: the scheduler
    leaves it alone until the last gate is removed."""
    return {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
            "message": "Scheduling is blocked due to non-empty scheduling gates",
            "lastProbeTime": None, "lastTransitionTime": now_rfc3339()}


def _crd_status(crd: Obj) -> Obj:
    now = now_rfc3339()
    spec = crd["spec"]
    return {
        "acceptedNames": copy.deepcopy(spec["names"]),
        "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
             "message": "no conflicts found", "lastTransitionTime": now},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
             "message": "the initial names have been accepted", "lastTransitionTime": now},
        ],
    }
