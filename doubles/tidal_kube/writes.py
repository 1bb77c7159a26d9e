"""Writes as a real API server makes them: create, replace, patch and ``pods/binding``.

Every write stamps ``uid``, ``resourceVersion``, ``creationTimestamp`` and ``generation``
(bumped when anything but metadata and status changes); a no-op write changes nothing, not even
the resourceVersion; a stale ``resourceVersion`` is a 409. The status subresource: writes to
``/status`` change only ``status``, writes to the object leave its ``status`` alone, and a
create drops it. Namespaces must exist (and not be terminating); a new namespace gets its
``default`` ServiceAccount and a CRD registers its resources (the controllers' part)."""

from __future__ import annotations

import copy
import random
import uuid
from collections.abc import Mapping
from typing import Any

from tidal_kube import patches
from tidal_kube.admission import Admission
from tidal_kube.deletion import Deletion
from tidal_kube.resources import CRD_KEY, Catalog, Obj, Resource, api_error, now_rfc3339
from tidal_kube.storage import Storage, check_preconditions
from tidal_kube.validation import metadata_errors

_GENERATED = "bcdfghjklmnpqrstvwxz2456789"  # the characters of generateName's suffixes


class Writes:
    """Creates and changes objects in ``storage``, through ``admission``."""

    def __init__(self, storage: Storage, catalog: Catalog, admission: Admission,
                 deletion: Deletion) -> None:
        self.storage = storage
        self.catalog = catalog
        self.admission = admission
        self.deletion = deletion

    def create_manifest(self, obj: Obj) -> Obj:
        """Create an object given as a manifest (apiVersion and kind pick the resource)."""
        resource = self.catalog.resource_for(obj.get("apiVersion", ""), obj.get("kind", ""))
        return self.create(resource, obj.get("metadata", {}).get("namespace"), obj)

    def create(self, resource: Resource, ns: str | None, body: Obj, dry: bool = False) -> Obj:
        obj = copy.deepcopy(body)
        _check_type(resource, obj)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise resource.invalid("?", ["metadata: Invalid value: must be an object"])
        if resource.namespaced:
            if meta.get("namespace") and ns and meta["namespace"] != ns:
                raise api_error(400, "BadRequest", "the namespace of the provided object does not "
                                "match the namespace sent on the request")
            meta["namespace"] = ns or meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise resource.invalid("", [
                    "metadata.name: Required value: name or generateName is required"])
            meta["name"] = meta["generateName"][:58] + "".join(random.choices(_GENERATED, k=5))
        name = meta["name"]
        if meta.get("resourceVersion"):
            raise api_error(500, "InternalError",
                            "resourceVersion should not be set on objects to be created")
        for field in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds",
                      "generation", "selfLink", "managedFields"):
            meta.pop(field, None)
        errors = metadata_errors(resource, meta)
        if errors:
            raise resource.invalid(name, errors)
        if resource.namespaced:
            self._check_namespace(resource, name, meta["namespace"])
        key = resource.key(meta.get("namespace"), name)
        if key in self.storage.objects:
            raise api_error(409, "AlreadyExists", f'{resource.qualified} "{name}" already exists',
                            name=name, group=resource.group, kind=resource.plural)
        if "status" in resource.subresources and not resource.is_("", "nodes"):
            obj.pop("status", None)  # status is written through its subresource only
        self.admission.admit(resource, obj, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
        if dry:
            return resource.output(obj)
        stored = self.storage.commit(resource, key, "ADDED", obj, None)
        self._after_create(resource, stored)
        if meta.get("ownerReferences"):
            self.deletion.schedule_gc()  # a dangling owner makes the new object garbage at once
        return resource.output(stored)

    def replace(self, resource: Resource, ns: str | None, name: str, body: Obj, sub: str | None,
                dry: bool) -> Obj:
        current = self.storage.current(resource, ns, name)
        _check_type(resource, body)
        check_preconditions(resource, current, body.get("metadata") or {})
        body_name = (body.get("metadata") or {}).get("name")
        if body_name and body_name != name:
            raise api_error(400, "BadRequest", f"the name of the object ({body_name}) does not "
                            f"match the name on the URL ({name})")
        return self._update(resource, current, body, sub, dry)

    def patch(self, resource: Resource, ns: str | None, name: str, body: Any, content_type: str,
              sub: str | None, params: Mapping[str, str], dry: bool) -> tuple[int, Obj]:
        """A patch of any type; server-side apply creates what does not exist (201)."""
        if content_type == patches.APPLY:
            if not params.get("fieldManager"):
                raise api_error(400, "BadRequest", "PatchOptions.meta.k8s.io is invalid: "
                                "fieldManager: Required value: is required for apply patch")
            if not isinstance(body, dict):
                raise api_error(400, "BadRequest", "the body must be a JSON object")
            if resource.key(ns, name) not in self.storage.objects:
                return 201, self.create(resource, ns, body, dry=dry)
        current = self.storage.current(resource, ns, name)
        result = patches.patched(resource, current, body, content_type)
        if isinstance(body, dict):  # a merge patch's metadata are its preconditions
            check_preconditions(resource, current, body.get("metadata") or {})
        return 200, self._update(resource, current, result, sub, dry)

    def bind(self, resource: Resource, ns: str | None, name: str, binding: Obj) -> Obj:
        """``pods/binding``, what a scheduler posts: sets spec.nodeName once, and PodScheduled;
        never for a pod that a scheduling gate still holds."""
        pod = self.storage.current(resource, ns, name)
        node = (binding.get("target") or {}).get("name")
        if not node:
            raise resource.invalid(name, ["target.name: Required value"])
        failed = f'Operation cannot be fulfilled on pods/binding "{name}": '
        if pod["spec"].get("nodeName"):
            raise api_error(409, "Conflict", f"{failed}pod {name} is already assigned to node "
                            f'"{pod["spec"]["nodeName"]}"')
        if pod["metadata"].get("deletionTimestamp"):
            raise api_error(409, "Conflict", f"{failed}pod {name} is being deleted")
        if pod["spec"].get("schedulingGates"):
            raise api_error(409, "Conflict", f"{failed}pod {name} has non-empty "
                            ".spec.schedulingGates")
        bound = copy.deepcopy(pod)
        bound["spec"]["nodeName"] = node
        status = bound.setdefault("status", {})
        scheduled = {"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                     "lastTransitionTime": now_rfc3339()}
        others = [c for c in status.get("conditions", []) if c.get("type") != "PodScheduled"]
        status["conditions"] = [*others, scheduled]
        self.storage.commit(resource, resource.key(ns, name), "MODIFIED", bound, pod)
        return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success",
                "code": 201}

    def _check_namespace(self, resource: Resource, name: str, namespace: str) -> None:
        found = self.storage.objects.get(("", "namespaces", None, namespace))
        if found is None:
            raise api_error(404, "NotFound", f'namespaces "{namespace}" not found',
                            name=namespace, kind="namespaces")
        if found["status"].get("phase") == "Terminating":
            raise api_error(403, "Forbidden", f'{resource.qualified} "{name}" is forbidden: unable '
                            f"to create new content in namespace {namespace} because it is being "
                            "terminated")

    def _update(self, resource: Resource, current: Obj, candidate: Obj, sub: str | None,
                dry: bool) -> Obj:
        """Turn a client's full object into the next stored state and commit it."""
        name = current["metadata"]["name"]
        if sub == "status":
            new = copy.deepcopy(current)
            if "status" in candidate:
                new["status"] = copy.deepcopy(candidate["status"])
            else:
                new.pop("status", None)
        else:
            new = copy.deepcopy(candidate)
            new["metadata"] = meta = dict(new.get("metadata") or {})
            if "status" in resource.subresources:
                if "status" in current:
                    new["status"] = copy.deepcopy(current["status"])
                else:
                    new.pop("status", None)
            for field in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
                          "deletionGracePeriodSeconds", "generation", "resourceVersion"):
                if field in current["metadata"]:
                    meta[field] = current["metadata"][field]
                else:
                    meta.pop(field, None)
            errors = metadata_errors(resource, meta)
            added = set(meta.get("finalizers") or ()) - set(
                current["metadata"].get("finalizers") or ())
            if current["metadata"].get("deletionTimestamp") and added:
                errors.append("metadata.finalizers: Forbidden: no new finalizers can be added if "
                              f"the object is being deleted, found new finalizers {sorted(added)}")
            if errors:
                raise resource.invalid(name, errors)
        new["apiVersion"], new["kind"] = current["apiVersion"], current["kind"]
        self.admission.admit(resource, new, current)
        if _without_rv(new) == _without_rv(current):
            return resource.output(current)  # a no-op write changes nothing
        if _spec_part(resource, new) != _spec_part(resource, current):
            new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        if dry:
            return resource.output(new)
        key = resource.key(current["metadata"].get("namespace"), name)
        stored = self.storage.commit(resource, key, "MODIFIED", new, current)
        self._after_update(resource, current, stored)
        meta = stored["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers") \
                and not meta.get("deletionGracePeriodSeconds"):  # the last finalizer is gone
            return resource.output(self.deletion.remove(resource, key))
        return resource.output(stored)

    def _after_create(self, resource: Resource, obj: Obj) -> None:
        if resource.is_("", "namespaces"):  # the service account controller's work
            self.create_manifest({"apiVersion": "v1", "kind": "ServiceAccount",
                                  "metadata": {"name": "default",
                                               "namespace": obj["metadata"]["name"]}})
        elif resource.is_(*CRD_KEY):
            self.catalog.register(obj)

    def _after_update(self, resource: Resource, old: Obj, new: Obj) -> None:
        if resource.is_(*CRD_KEY):
            self.catalog.unregister(old)
            self.catalog.register(new)


def _check_type(resource: Resource, obj: Obj) -> None:
    if not isinstance(obj, dict):
        raise api_error(400, "BadRequest", "the body must be a JSON object")
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if api_version not in (None, "", resource.api_version) or kind not in (
            None, "", resource.kind):
        raise api_error(400, "BadRequest", f"the API version in the data ({api_version}) or "
                        f"its kind ({kind}) does not match the expected "
                        f"({resource.api_version}, {resource.kind})")


def _spec_part(resource: Resource, obj: Obj) -> Obj:
    """What ``metadata.generation`` counts changes of: all but metadata (and status where it is
    a subresource)."""
    ignored = ("metadata", "status") if "status" in resource.subresources else ("metadata",)
    return {key: value for key, value in obj.items() if key not in ignored}


def _without_rv(obj: Obj) -> Obj:
    return {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}}
