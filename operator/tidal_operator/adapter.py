"""The one place the operator talks to the Kubernetes API (besides kopf's own watches).

Every write is idempotent where the API allows it: creating an object that already exists is
success (names are deterministic), deleting one that is gone is success. Other API errors
become ``ApiUnavailable`` so callers can back off and retry (kopf's TemporaryError in
handlers, the next round in the control loop) rather than crash. Every request has a timeout
(``REQUEST_TIMEOUT_S``, and ``CONNECT_TIMEOUT_S`` to connect), kopf's as the adapter's: an API
that stops answering costs a round, never a hung loop.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import httpx2
from lightkube import ApiError, AsyncClient, codecs
from lightkube.config.kubeconfig import KubeConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from tidal_api import GROUP, KIND, VERSION

log = logging.getLogger(__name__)

ElasticTrainingJobResource = create_namespaced_resource(
    GROUP, VERSION, KIND, "elastictrainingjobs", verbs=None
)
COMPONENT = "tidal-operator"
REQUEST_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0


class ApiUnavailable(RuntimeError):
    """A Kubernetes API call failed in a way worth retrying later."""


def rfc3339(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _client(kubeconfig: str | None) -> AsyncClient:
    timeout = httpx2.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    # Without a kubeconfig: $KUBECONFIG, ~/.kube/config or in-cluster.
    config = KubeConfig.from_file(kubeconfig).get() if kubeconfig else None
    return AsyncClient(config, field_manager=COMPONENT, timeout=timeout)


class Adapter:
    """Writes: pods, services, job status and Events."""

    def __init__(self, kubeconfig: str | None = None) -> None:
        self._kubeconfig = kubeconfig
        self._api: AsyncClient | None = None

    @property
    def api(self) -> AsyncClient:
        if self._api is None:
            self._api = _client(self._kubeconfig)
        return self._api

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None

    async def create(self, manifest: dict[str, Any]) -> bool:
        """Create ``manifest``; False when an object of that name already exists."""
        try:
            await self.api.create(codecs.from_dict(manifest))
        except ApiError as err:
            if err.status.code == 409:
                return False
            raise ApiUnavailable(f"create {_describe(manifest)}: {err.status.message}") from err
        except Exception as err:  # noqa: BLE001 - network errors of any kind: retry later
            raise ApiUnavailable(f"create {_describe(manifest)}: {err}") from err
        return True

    async def delete_pod(self, name: str, namespace: str) -> bool:
        """Delete a pod; False when it was already gone."""
        try:
            await self.api.delete(Pod, name, namespace=namespace)
        except ApiError as err:
            if err.status.code == 404:
                return False
            raise ApiUnavailable(f"delete pod {namespace}/{name}: {err.status.message}") from err
        except Exception as err:  # noqa: BLE001
            raise ApiUnavailable(f"delete pod {namespace}/{name}: {err}") from err
        return True

    async def patch_status(self, name: str, namespace: str, status: dict[str, Any]) -> None:
        """Merge ``status`` into the job's status subresource (null deletes a field)."""
        try:
            await self.api.patch(
                ElasticTrainingJobResource.Status, name, {"status": status},
                namespace=namespace, patch_type=PatchType.MERGE,
            )
        except ApiError as err:
            if err.status.code == 404:  # the job was deleted meanwhile: nothing to report on
                return
            raise ApiUnavailable(f"patch status {namespace}/{name}: {err.status.message}") from err
        except Exception as err:  # noqa: BLE001
            raise ApiUnavailable(f"patch status {namespace}/{name}: {err}") from err

    async def event(
        self, job: dict[str, Any], *, reason: str, message: str, warning: bool = False,
        now: float,
    ) -> None:
        """A core/v1 Event on the job, as ``kubectl describe etj`` shows them."""
        meta = job["metadata"]
        stamp = rfc3339(now)
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "namespace": meta.get("namespace", "default"),
                "name": f"{meta['name']}.{int(now * 1e6):x}",
            },
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "name": meta["name"],
                "namespace": meta.get("namespace", "default"),
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            await self.api.create(codecs.from_dict(event))
        except Exception as err:  # noqa: BLE001 - an Event lost is logged, never fatal
            log.warning("could not post event %s on %s: %s", reason, meta["name"], err)


def _describe(manifest: dict[str, Any]) -> str:
    meta = manifest.get("metadata", {})
    return f"{manifest.get('kind', '?')} {meta.get('namespace', '')}/{meta.get('name', '?')}"
