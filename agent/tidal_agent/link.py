"""The agent's link to the Kubernetes API: one ElasticTrainingJob, as its agent sees it.

``ControlLink`` reads the job's spec, follows ``status.target`` with a watch (reconnecting with
backoff) and publishes the leader's fields (DESIGN.md section 3, tidal_api.status) as
rate-limited JSON merge patches of the status subresource, from threads of its own, so an API
error or a slow API server never stops training.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import httpx2
from lightkube import ApiError, Client, ConfigError, codecs
from lightkube.config.kubeconfig import KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.generic_resource import create_namespaced_resource
from lightkube.types import PatchType
from pydantic import ValidationError

from tidal_api import GROUP, KIND, VERSION, ElasticTrainingJob, JobStatus, Target, parse_job

log = logging.getLogger("tidal.agent")

ElasticTrainingJobResource = create_namespaced_resource(
    GROUP, VERSION, KIND, "elastictrainingjobs"
)

# The leader's status fields (tidal_api.status): the only ones the agent ever writes.
AGENT_FIELDS = frozenset({
    "generation", "members", "lost", "layout", "step", "loss", "tokens_per_second", "step_seconds",
    "predicted_step_seconds", "last_switch_seconds", "scale_table", "stragglers",
})


class ControlError(RuntimeError):
    """The agent cannot run: its job, identity or settings are missing or unusable."""


def kube_config(kubeconfig: str | None) -> KubeConfig:
    """A kubeconfig file, an API server URL (no auth: emulators, ``kubectl proxy``), or, with
    None, the pod's service account and then ``$KUBECONFIG``."""
    if kubeconfig is None:
        return KubeConfig.from_env()
    if kubeconfig.startswith(("http://", "https://")):
        return KubeConfig.from_one(cluster=Cluster(server=kubeconfig), user=User())
    return KubeConfig.from_file(kubeconfig)


# Errors of talking to the API server: logged and retried, never fatal to training.
_API_ERRORS = (httpx2.HTTPError, OSError)


class ControlLink:
    """One ElasticTrainingJob as its agent sees it: spec, target, and the leader's status.

    ``start`` launches the watch and the publisher threads; ``close`` flushes what is pending
    (bounded) and stops them. ``publish`` never blocks on the network.
    """

    def __init__(
        self,
        name: str,
        namespace: str,
        *,
        kubeconfig: str | None = None,
        publish_interval_s: float = 2.0,
        request_timeout_s: float = 10.0,
        watch_timeout_s: int = 300,
    ) -> None:
        self.name, self.namespace = name, namespace
        self.publish_interval_s = publish_interval_s
        self.watch_timeout_s = watch_timeout_s
        try:
            config = kube_config(kubeconfig)
        except ConfigError as err:
            raise ControlError(f"no Kubernetes API to talk to: {err}; pass --kubeconfig") from err
        # Separate clients: the watch holds its connection open for minutes.
        timeout = httpx2.Timeout(request_timeout_s)
        self._client = Client(config, namespace=namespace, timeout=timeout,
                              field_manager="tidal-agent")
        self._watch_client = Client(config, namespace=namespace, timeout=timeout)
        # lightkube reads a watch without a timeout: a half-open connection would hang it
        # for good, and close() could not stop it. The server ends a watch after
        # watch_timeout_s; the client gives up a little later.
        grace = min(10.0, watch_timeout_s)
        self._watch_client._client._watch_timeout.read = watch_timeout_s + grace
        self._target: Target | None = None
        self._bad_target: Any = None
        self._cond = threading.Condition()
        self._pending: dict[str, Any] = {}
        self._urgent = False
        self._closing = False
        self._stopped = threading.Event()
        self._last_patch = float("-inf")
        self._threads: list[threading.Thread] = []
        self.patches = 0  # status patches sent
        self._uid: str | None = None  # the job's, once read: its Events name it

    def job(self, *, retry_for_s: float = 60.0) -> ElasticTrainingJob:
        """The job as it is now, parsed; API errors are retried for ``retry_for_s``."""
        deadline, delay = time.monotonic() + retry_for_s, 0.5
        while True:
            try:
                obj = self._client.get(ElasticTrainingJobResource, self.name,
                                       namespace=self.namespace)
                break
            except _API_ERRORS as err:
                if time.monotonic() + delay > deadline:
                    raise ControlError(
                        f"cannot read ElasticTrainingJob {self.namespace}/{self.name}: {err}"
                    ) from err
                log.warning("reading the job failed (%s); retrying in %.1f s", err, delay)
                time.sleep(delay)
                delay = min(2 * delay, 10.0)
        raw = _plain(obj)
        self._uid = raw.get("metadata", {}).get("uid")
        self._take_target(raw)
        return parse_job(raw, f"ElasticTrainingJob {self.namespace}/{self.name}",
                         local_files=True)

    def target(self) -> Target | None:
        """The operator's current ``status.target`` as last seen."""
        return self._target

    def start(self) -> None:
        """Follow the target and publish status from now on."""
        for run, name in ((self._watch, "watch"), (self._publisher, "publish")):
            thread = threading.Thread(target=run, name=f"tidal-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def event(self, reason: str, message: str, *, warning: bool = False) -> None:
        """A core/v1 Event on the job (``kubectl describe etj`` shows it), posted from a thread
        of its own: an Event lost is logged, never in training's way."""
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
        involved = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": self.name,
                    "namespace": self.namespace, "uid": self._uid}
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"namespace": self.namespace, "name": f"{self.name}.{int(now * 1e6):x}"},
            "involvedObject": involved, "reason": reason, "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": "tidal-agent"}, "reportingComponent": "tidal-agent",
            "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }

        def post() -> None:
            try:
                self._client.create(codecs.from_dict(event))
            except (*_API_ERRORS, ApiError) as err:
                log.warning("could not post event %s: %s", reason, err)

        threading.Thread(target=post, name="tidal-event", daemon=True).start()

    def publish(self, **fields: Any) -> None:
        """Queue agent-owned status fields (snake_case names of ``tidal_api.JobStatus``).

        They go out as one merge patch at most every ``publish_interval_s``, later values
        replacing earlier ones; a new ``generation`` goes out at once.
        """
        unknown = set(fields) - AGENT_FIELDS
        if unknown:
            raise ValueError(f"not agent-owned status fields: {sorted(unknown)}")
        status = JobStatus.model_validate(fields)
        wire = status.model_dump(mode="json", by_alias=True, include=set(fields))
        with self._cond:
            self._pending.update(wire)
            self._urgent |= "generation" in fields
            self._cond.notify()

    def close(self, flush_timeout_s: float = 10.0) -> None:
        """Send what is pending (waiting at most ``flush_timeout_s``) and stop."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        deadline = time.monotonic() + flush_timeout_s
        for thread in self._threads:
            if thread.name == "tidal-publish":
                thread.join(max(0.0, deadline - time.monotonic()))
        self._stopped.set()
        with self._cond:
            if self._pending:
                log.warning("status fields not published before exit: %s", sorted(self._pending))
        self._watch_client.close()
        self._client.close()

    def _take_target(self, raw: Mapping[str, Any]) -> None:
        target = (raw.get("status") or {}).get("target")
        if target is None:
            self._target = None
            return
        try:
            self._target = Target.model_validate(target)
        except ValidationError as err:
            if target != self._bad_target:  # once per bad value, not once per event
                log.error("ignoring status.target %s: %s", target, err)
                self._bad_target = target

    def _watch(self) -> None:
        delay = 0.5
        while not self._stopped.is_set():
            try:
                events = self._watch_client.watch(
                    ElasticTrainingJobResource, namespace=self.namespace,
                    fields={"metadata.name": self.name}, server_timeout=self.watch_timeout_s,
                )
                for kind, obj in events:
                    delay = 0.5
                    raw = _plain(obj)
                    if raw.get("metadata", {}).get("name") != self.name:
                        continue
                    if kind == "DELETED":
                        log.warning("the ElasticTrainingJob was deleted; training goes on")
                        continue
                    self._take_target(raw)
            except httpx2.ReadTimeout:
                continue  # a quiet job past the watch's timeout: watch again
            except _API_ERRORS as err:
                if self._stopped.is_set():
                    return
                log.warning("watching the job failed (%s); reconnecting in %.1f s", err, delay)
            except Exception:  # noqa: BLE001 - a bug here must not stop training either
                if self._stopped.is_set():
                    return
                log.exception("watching the job failed; reconnecting in %.1f s", delay)
            self._stopped.wait(delay)
            delay = min(2 * delay, 30.0)

    def _publisher(self) -> None:
        delay = 0.5
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                wait = self._last_patch + self.publish_interval_s - time.monotonic()
                if wait > 0 and not (self._urgent or self._closing):
                    self._cond.wait(wait)
                    continue
                patch, self._pending, self._urgent = self._pending, {}, False
            try:
                self._client.patch(
                    ElasticTrainingJobResource.Status, self.name, {"status": patch},
                    namespace=self.namespace, patch_type=PatchType.MERGE,
                )
                self._last_patch = time.monotonic()
                self.patches += 1
                delay = 0.5
            except _API_ERRORS as err:
                log.warning("publishing status failed (%s); retrying in %.1f s", err, delay)
                with self._cond:
                    self._pending = {**patch, **self._pending}
                    self._urgent |= "generation" in patch
                time.sleep(min(delay, 1.0) if self._closing else delay)
                delay = min(2 * delay, 30.0)


def _plain(obj: Any) -> dict[str, Any]:
    """A lightkube generic object as plain JSON-like data."""
    return json.loads(json.dumps(obj, default=lambda o: o.to_dict()))
