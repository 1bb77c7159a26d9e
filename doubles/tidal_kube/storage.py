"""The stored objects: one cluster-wide resourceVersion counter, the history of changes per
resource, and the watch streams that replay it (as etcd and the API server's watch cache)."""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from tidal_kube.resources import Key, Obj, Resource, api_error


@dataclasses.dataclass(frozen=True, slots=True)
class Change:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj  # the state after the change (the last state for DELETED)
    old: Obj | None  # the state before (None for ADDED)


class Storage:
    """Objects by (group, plural, namespace, name), and the last ``history`` changes of each
    resource for the watches to resume from."""

    def __init__(self, history: int) -> None:
        self.history = history
        self.objects: dict[Key, Obj] = {}
        self.uids: dict[str, Key] = {}
        self.rv = 0
        self._changes: dict[tuple[str, str], collections.deque[Change]] = {}
        self._compacted: dict[tuple[str, str], int] = {}
        self._changed = asyncio.Event()
        self._closing = False

    def open(self) -> None:
        """Let watches run (again, after :meth:`close`)."""
        self._closing = False

    def close(self) -> None:
        """End the watch streams, or a server's shutdown would wait for them."""
        self._closing = True
        self._changed.set()

    def commit(self, resource: Resource, key: Key, kind: str, obj: Obj, old: Obj | None) -> Obj:
        """Store (or, for DELETED, drop) an object with the next resourceVersion; wake watches."""
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if kind == "DELETED":
            del self.objects[key]
            self.uids.pop(obj["metadata"]["uid"], None)
        else:
            self.objects[key] = obj
            self.uids[obj["metadata"]["uid"]] = key
        stream = (resource.group, resource.plural)
        changes = self._changes.setdefault(stream, collections.deque())
        changes.append(Change(self.rv, kind, obj, old))
        if len(changes) > self.history:
            self._compacted[stream] = changes.popleft().rv
        self._changed.set()
        self._changed = asyncio.Event()
        return obj

    def current(self, resource: Resource, ns: str | None, name: str) -> Obj:
        """The stored object; a 404 if there is none."""
        obj = self.objects.get(resource.key(ns, name))
        if obj is None:
            raise api_error(404, "NotFound", f'{resource.qualified} "{name}" not found',
                            name=name, group=resource.group, kind=resource.plural)
        return obj

    def select(self, resource: Resource, match: Callable[[Obj], bool]) -> list[Obj]:
        """The objects of a resource that ``match``, sorted by namespace and name."""
        found = [obj for (group, plural, _, _), obj in self.objects.items()
                 if (group, plural) == (resource.group, resource.plural) and match(obj)]
        return sorted(found, key=lambda o: (o["metadata"].get("namespace", ""),
                                            o["metadata"]["name"]))

    async def stream(self, resource: Resource, match: Callable[[Obj], bool],
                     timeout: float | None, params: Mapping[str, str]) -> AsyncIterator[Any]:
        """A watch: from ``resourceVersion`` in ``params`` (or the current objects, as ADDED),
        until ``timeout`` or :meth:`close`."""
        yield b""  # send the headers now: clients wait for them before reading events
        deadline = asyncio.get_running_loop().time() + timeout if timeout is not None else None
        since = params.get("resourceVersion") or "0"
        position = int(since) if since.isdigit() else 0
        stream = (resource.group, resource.plural)
        if position == 0 or params.get("sendInitialEvents") == "true":
            position = self.rv
            for obj in self.select(resource, match):
                yield {"type": "ADDED", "object": resource.output(obj)}
            if params.get("sendInitialEvents") == "true":
                yield {"type": "BOOKMARK", "object": {
                    "apiVersion": resource.api_version, "kind": resource.kind,
                    "metadata": {"resourceVersion": str(position),
                                 "annotations": {"k8s.io/initial-events-end": "true"}}}}
        elif position < self._compacted.get(stream, 0):
            oldest = self._compacted[stream]
            yield _watch_error(410, "Expired", f"too old resource version: {position} ({oldest})")
            return
        while not self._closing:
            waiter = self._changed
            pending = []
            for change in reversed(self._changes.get(stream, ())):
                if change.rv <= position:
                    break
                pending.append(change)
            for change in reversed(pending):
                position = change.rv
                if event := _event(resource, change, match):
                    yield event
            remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
            if remaining is not None and remaining <= 0:
                return
            try:
                await asyncio.wait_for(waiter.wait(), remaining)
            except TimeoutError:
                return


def check_preconditions(resource: Resource, current: Obj, meta: Obj) -> None:
    """A write's ``uid`` and ``resourceVersion`` against the stored object's: a 409 if stale."""
    name = current["metadata"]["name"]
    rv, uid = meta.get("resourceVersion"), meta.get("uid")
    failed = f'Operation cannot be fulfilled on {resource.qualified} "{name}": '
    if uid and uid != current["metadata"]["uid"]:
        raise api_error(409, "Conflict", f"{failed}Precondition failed: UID in precondition: "
                        f'{uid}, UID in object meta: {current["metadata"]["uid"]}',
                        name=name, group=resource.group, kind=resource.plural)
    if rv and rv != current["metadata"]["resourceVersion"]:
        raise api_error(409, "Conflict", f"{failed}the object has been modified; please apply "
                        "your changes to the latest version and try again",
                        name=name, group=resource.group, kind=resource.plural)


def _event(resource: Resource, change: Change, match: Callable[[Obj], bool]) -> Obj | None:
    """What a watch with this selector sees of a change: an object that enters the
    selector is ADDED, one that leaves it is DELETED."""
    now = match(change.obj)
    was = change.old is not None and match(change.old)
    if change.type == "MODIFIED":
        kind = "MODIFIED" if now and was else "ADDED" if now else "DELETED" if was else None
    else:
        kind = change.type if now else None
    if kind is None:
        return None
    return {"type": kind, "object": resource.output(change.obj)}


def _watch_error(code: int, reason: str, message: str) -> Obj:
    status = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
              "code": code, "reason": reason, "message": message}
    return {"type": "ERROR", "object": status}
