"""What the local scheduler and kubelet share: :class:`ClusterApi`, the few API calls they make
over one HTTP session, and how they read pods and nodes (GPUs as the operator counts them,
finished phases, conditions with their transition times)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import aiohttp

from tidal_kube.resources import Obj, now_rfc3339
from tidal_operator.snapshot import gpus_of, pod_gpus

GPU = "nvidia.com/gpu"
FINISHED = ("Succeeded", "Failed")
MERGE = {"Content-Type": "application/merge-patch+json"}


class ClusterApi:
    """The few API calls a scheduler and a kubelet make, over one HTTP session."""

    def __init__(self, url: str, session: aiohttp.ClientSession | None = None) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._owned = session is None

    async def __aenter__(self) -> ClusterApi:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._owned and self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, body: Any = None, ok: Iterable[int] = (),
                      headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """Send one request; an error status not in ``ok`` raises ClientResponseError."""
        assert self._session is not None, "use ClusterApi as an async context manager"
        data = None if body is None else json.dumps(body)
        headers = headers or {"Content-Type": "application/json"}
        url = self.url + path
        async with self._session.request(method, url, data=data, headers=headers) as rsp:
            payload = await rsp.json(content_type=None)
            if rsp.status >= 400 and rsp.status not in ok:
                message = payload.get("message") if isinstance(payload, dict) else payload
                raise aiohttp.ClientResponseError(rsp.request_info, (), status=rsp.status,
                                                  message=str(message))
            return rsp.status, payload

    async def items(self, path: str) -> list[Obj]:
        return (await self.request("GET", path))[1]["items"]

    async def patch_status(self, pod: Obj, status: Obj) -> None:
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        await self.request("PATCH", path, {"status": status}, ok=(404,), headers=MERGE)


def gpu_request(pod: Obj, resource: str = GPU) -> int:
    """The pod's request of ``resource``, counted as the operator counts it."""
    return pod_gpus(pod.get("spec") or {}, resource)


def node_gpus(node: Obj, resource: str = GPU) -> int:
    status = node.get("status") or {}
    return gpus_of(status.get("allocatable") or status.get("capacity"), resource)


def with_condition(conditions: list[Obj], condition: Obj) -> list[Obj]:
    """``conditions`` with ``condition`` in place of the one of its type; the transition time
    is kept when the condition's status does not change."""
    old = next((c for c in conditions if c.get("type") == condition["type"]), None)
    if old is not None and old.get("status") == condition["status"]:
        condition = {**condition,
                     "lastTransitionTime": old.get("lastTransitionTime") or now_rfc3339()}
    else:
        condition = {**condition, "lastTransitionTime": now_rfc3339()}
    return [c for c in conditions if c.get("type") != condition["type"]] + [condition]
