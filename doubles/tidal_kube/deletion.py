"""Deletion as a real API server does it: finalizers hold an object; a pod bound to a node
terminates gracefully (a deletionTimestamp and a grace period, until the kubelet removes it); a
namespace takes its contents along; a deleted CRD takes its objects; background garbage
collection deletes the objects whose ``ownerReferences`` are all gone (or never existed in their
namespace)."""

from __future__ import annotations

import asyncio
import copy
import datetime
from collections.abc import Mapping
from typing import Any

import kmock

from tidal_kube.resources import CRD_KEY, Catalog, Key, Obj, Resource, orphaned_resource
from tidal_kube.selector import matcher
from tidal_kube.storage import Storage, check_preconditions


class Deletion:
    """Deletes objects from ``storage``; ``gc_delay`` is how long the garbage collector waits
    after an owner is deleted."""

    def __init__(self, storage: Storage, catalog: Catalog, gc_delay: float) -> None:
        self.storage = storage
        self.catalog = catalog
        self.gc_delay = gc_delay
        self._gc_handle: asyncio.TimerHandle | asyncio.Handle | None = None

    def delete(self, resource: Resource, ns: str | None, name: str, options: Mapping[str, Any],
               dry: bool) -> Obj:
        """DELETE: at once, or marked with a deletionTimestamp while finalizers, a namespace's
        contents or a running pod's graceful termination (the kubelet's part) hold it."""
        current = self.storage.current(resource, ns, name)
        preconditions = options.get("preconditions")
        if isinstance(preconditions, dict):
            check_preconditions(resource, current, preconditions)
        if dry:
            return resource.output(current)
        key = resource.key(ns, name)
        if options.get("propagationPolicy") == "Orphan" or options.get("orphanDependents"):
            self._orphan(current["metadata"]["uid"])
        meta = current["metadata"]
        grace = _grace_period(resource, current, options)
        if meta.get("deletionTimestamp"):
            if grace or not meta.get("deletionGracePeriodSeconds"):
                return resource.output(current)
            if not meta.get("finalizers"):  # forced, or the kubelet is done with it
                return resource.output(self.remove(resource, key))
            shortened = copy.deepcopy(current)
            shortened["metadata"]["deletionGracePeriodSeconds"] = 0
            shortened = self.storage.commit(resource, key, "MODIFIED", shortened, current)
            return resource.output(shortened)
        namespace = resource.is_("", "namespaces")
        if not (meta.get("finalizers") or namespace or grace):
            return resource.output(self.remove(resource, key))
        marked = copy.deepcopy(current)
        when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=grace)
        marked["metadata"]["deletionTimestamp"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
        marked["metadata"]["deletionGracePeriodSeconds"] = grace
        if namespace:
            marked["status"] = {"phase": "Terminating"}
        marked = self.storage.commit(resource, key, "MODIFIED", marked, current)
        if namespace:  # the namespace controller's work: empty it, then let it go
            for other in [k for k in self.storage.objects if k[2] == name]:
                if other in self.storage.objects:
                    self.delete(self._resource_of(other), other[2], other[3], {}, False)
            marked = self._finish_namespace(name) or marked
        return resource.output(marked)

    def delete_collection(self, resource: Resource, ns: str | None, params: Mapping[str, str],
                          options: Mapping[str, Any], dry: bool) -> Obj:
        victims = self.storage.select(resource, matcher(resource, ns, None, params))
        items = [self.delete(resource, o["metadata"].get("namespace"), o["metadata"]["name"],
                             options, dry) for o in victims]
        return {"apiVersion": resource.api_version, "kind": f"{resource.kind}List",
                "metadata": {"resourceVersion": str(self.storage.rv)}, "items": items}

    def remove(self, resource: Resource, key: Key) -> Obj:
        """Drop an object for good; what depended on it goes next."""
        current = self.storage.objects[key]
        gone = self.storage.commit(resource, key, "DELETED", current, current)
        if resource.is_(*CRD_KEY):
            self._drop_custom_resources(gone)
        if key[2] is not None:
            self._finish_namespace(key[2])
        self.schedule_gc()
        return gone

    def schedule_gc(self) -> None:
        """Collect garbage soon (after ``gc_delay``), on the running loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop yet (objects created at start-up): nothing to collect
        if self._gc_handle is None:
            self._gc_handle = loop.call_later(self.gc_delay, self._collect_garbage)

    def _drop_custom_resources(self, crd: Obj) -> None:
        """A deleted CRD's resources go, and its objects with them, finalizers or not (a real
        server waits for their finalizers)."""
        self.catalog.unregister(crd)
        spec = crd["spec"]
        plural = spec["names"]["plural"]
        for key in [k for k in self.storage.objects if k[:2] == (spec["group"], plural)]:
            obj = self.storage.objects[key]
            self.storage.commit(orphaned_resource(obj, spec), key, "DELETED", obj, obj)

    def _finish_namespace(self, name: str) -> Obj | None:
        """Remove a terminating namespace once nothing is left in it."""
        key = ("", "namespaces", None, name)
        namespace = self.storage.objects.get(key)
        if namespace is None or not namespace["metadata"].get("deletionTimestamp"):
            return None
        if namespace["metadata"].get("finalizers") or any(
                k[2] == name for k in self.storage.objects):
            return None
        return self.remove(self.catalog.resource(kmock.resource("v1", "namespaces")), key)

    def _resource_of(self, key: Key) -> Resource:
        return self.catalog.resource_of(key, self.storage.objects[key])

    def _collect_garbage(self) -> None:
        """Background propagation: delete the objects none of whose owners exist. An owner
        counts only in the dependent's namespace (or cluster-wide), as for the real collector."""
        self._gc_handle = None

        def exists(ref: Obj, namespace: str | None) -> bool:
            owner = self.storage.uids.get(ref.get("uid", ""))
            return owner is not None and owner[2] in (None, namespace)

        orphans = [key for key, obj in self.storage.objects.items()
                   if (refs := obj["metadata"].get("ownerReferences"))
                   and not obj["metadata"].get("deletionTimestamp")
                   and not any(exists(ref, key[2]) for ref in refs)]
        for key in orphans:
            if key in self.storage.objects:
                self.delete(self._resource_of(key), key[2], key[3], {}, False)

    def _orphan(self, uid: str) -> None:
        for key, obj in list(self.storage.objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if any(ref.get("uid") == uid for ref in refs):
                new = copy.deepcopy(obj)
                new["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
                self.storage.commit(self._resource_of(key), key, "MODIFIED", new, obj)


def _grace_period(resource: Resource, obj: Obj, options: Mapping[str, Any]) -> int:
    """Seconds a deletion waits for the kubelet: only pods bound to a node and not finished
    have one (``gracePeriodSeconds`` in the options, else the pod's own)."""
    if not resource.is_("", "pods"):
        return 0
    finished = obj.get("status", {}).get("phase") in ("Succeeded", "Failed")
    if finished or not obj["spec"].get("nodeName"):
        return 0
    asked = options.get("gracePeriodSeconds")
    return int(asked if asked is not None else obj["spec"].get("terminationGracePeriodSeconds", 30))
