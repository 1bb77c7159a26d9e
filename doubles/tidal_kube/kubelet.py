"""The local kubelet: runs the pods bound to nodes, in name only or through a :class:`PodRuntime`.

In name only, a bound pod goes Pending -> Running (a start time, ready containers), and a pod
annotated ``tidal.dev/duration-seconds`` Succeeded once it has run that long (so a non-elastic
job holds its GPUs for its duration and then frees them). Given a :class:`PodRuntime`, the pods
that runtime takes really run (the one-machine cluster runs worker pods as local processes):
their phase follows the process. A deleted pod is removed at the start of its grace period, or
once its process is gone; until then it holds its GPUs, as in a cluster.

Like the scheduler, the kubelet keeps no state: every step reads the pods and writes what
follows from them, so it can stop and restart at any time without losing a pod's start time.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Protocol

from tidal_kube.clusterapi import ClusterApi, with_condition
from tidal_kube.resources import Obj

DURATION_ANNOTATION = "tidal.dev/duration-seconds"


class PodRuntime(Protocol):
    """What really runs the containers of some pods; the kubelet asks it at every step, from
    one thread, and never blocks on it."""

    def takes(self, pod: Obj) -> bool:
        """Whether this runtime runs ``pod`` (else the kubelet runs it in name only)."""

    def start(self, pod: Obj) -> None:
        """Start the pod's containers (once: a second call for the same pod does nothing)."""

    def exit_code(self, pod: Obj) -> int | None:
        """None while the pod's containers run; their exit code once they have stopped."""

    def stop(self, pod: Obj) -> bool:
        """Stop the pod's containers within its grace period; True once they are gone."""

    def keep_only(self, uids: set[str]) -> None:
        """Stop the containers of pods that are no longer in the API (force-deleted)."""


class Kubelet:
    """Runs bound pods: in name only (Pending -> Running -> Succeeded after their duration), or
    through ``runtime`` for the pods it takes (Running while they run, then Succeeded or
    Failed by their exit code)."""

    def __init__(self, api: ClusterApi, runtime: PodRuntime | None = None) -> None:
        self.api = api
        self.runtime = runtime

    async def step(self, now: datetime.datetime | None = None) -> None:
        now = now or datetime.datetime.now(datetime.UTC)
        pods = await self.api.items("/api/v1/pods")
        if self.runtime is not None:
            self.runtime.keep_only({p["metadata"]["uid"] for p in pods})
        for pod in pods:
            if not pod["spec"].get("nodeName"):
                continue
            runtime = self.runtime if self.runtime is not None and self.runtime.takes(pod) else None
            if pod["metadata"].get("deletionTimestamp"):
                if runtime is None or runtime.stop(pod):
                    await self._terminated(pod)
                continue
            phase = pod.get("status", {}).get("phase")
            if phase == "Pending":
                if runtime is not None:  # off the loop: a start may wait (a fork server's)
                    await asyncio.to_thread(runtime.start, pod)
                await self.api.patch_status(pod, self._running(pod, now))
            elif phase == "Running" and runtime is not None:
                code = runtime.exit_code(pod)
                if code is not None:
                    await self.api.patch_status(pod, self._finished(pod, now, code))
            elif phase == "Running" and self._done(pod, now):
                await self.api.patch_status(pod, self._finished(pod, now))

    async def _terminated(self, pod: Obj) -> None:
        """A deleted pod's containers are gone at once: remove it (what a kubelet does once
        the grace period's kill is over). Finalizers, if any, still hold it."""
        if pod["metadata"].get("deletionGracePeriodSeconds"):
            meta = pod["metadata"]
            path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
            options = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                       "preconditions": {"uid": meta["uid"]}}
            await self.api.request("DELETE", path, options, ok=(404, 409))

    @staticmethod
    def _done(pod: Obj, now: datetime.datetime) -> bool:
        duration = (pod["metadata"].get("annotations") or {}).get(DURATION_ANNOTATION)
        started = pod.get("status", {}).get("startTime")
        if duration is None or started is None:
            return False
        return (now - _parse_time(started)).total_seconds() >= float(duration)

    @staticmethod
    def _running(pod: Obj, now: datetime.datetime) -> Obj:
        started = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        conditions = (pod.get("status") or {}).get("conditions") or []
        for kind in ("Initialized", "ContainersReady", "Ready"):
            conditions = with_condition(conditions, {"type": kind, "status": "True"})
        return {
            "phase": "Running", "startTime": started, "hostIP": "127.0.0.1", "podIP": "127.0.0.1",
            "conditions": conditions,
            "containerStatuses": [
                {"name": c["name"], "image": c.get("image", ""),
                 "imageID": f"local://{c.get('image', '')}", "ready": True, "started": True,
                 "restartCount": 0, "state": {"running": {"startedAt": started}}}
                for c in pod["spec"].get("containers") or []],
        }

    @staticmethod
    def _finished(pod: Obj, now: datetime.datetime, exit_code: int = 0) -> Obj:
        """Succeeded on exit code 0, else Failed (a negative code: killed by that signal)."""
        finished = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        status = pod.get("status") or {}
        conditions = status.get("conditions") or []
        reason = "PodCompleted" if exit_code == 0 else "PodFailed"
        for kind in ("ContainersReady", "Ready"):
            condition = {"type": kind, "status": "False", "reason": reason}
            conditions = with_condition(conditions, condition)
        code = exit_code if exit_code >= 0 else 128 - exit_code  # as a shell reports a signal
        return {
            "phase": "Succeeded" if exit_code == 0 else "Failed", "conditions": conditions,
            "containerStatuses": [
                {**c, "ready": False, "started": False,
                 "state": {"terminated": {"exitCode": code,
                                          "reason": "Completed" if exit_code == 0 else "Error",
                                          "startedAt": status.get("startTime"),
                                          "finishedAt": finished}}}
                for c in status.get("containerStatuses") or []],
        }


def _parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
