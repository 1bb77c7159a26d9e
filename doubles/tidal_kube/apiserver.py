"""The emulated API server's front: HTTP requests routed to the parts that give them meaning.

kmock's ``KubernetesScaffold`` gives the HTTP plumbing, API discovery, ``Status`` errors and its
request DSL, so a test can still inject faults (``emulator["patch", kmock.resource("v1/pods")]
<< 500``). The state and its semantics are ours, because that is where a mock hides the bugs a
real API server catches; each concern has its module:

- :mod:`~tidal_kube.storage`: resourceVersions, the change history, watches (resumed after a
  resourceVersion, 410 once it left the history, ``timeoutSeconds``, ``sendInitialEvents``);
- :mod:`~tidal_kube.writes`, :mod:`~tidal_kube.patches`, :mod:`~tidal_kube.deletion`: what a
  create, an update, a patch and a delete do;
- :mod:`~tidal_kube.selector`: label and field selectors on list, watch and delete-collection
  (an object leaving a watch's selector is DELETED for it);
- :mod:`~tidal_kube.admission`, :mod:`~tidal_kube.validation`, :mod:`~tidal_kube.structural`:
  defaults and checks per kind, and custom resources against their CRD's schema and CEL rules;
- what kubectl and helm need: :mod:`~tidal_kube.tables` for ``kubectl get``,
  :mod:`~tidal_kube.openapi` for field validation and ``kubectl explain``,
  :mod:`~tidal_kube.protobuf` for the bodies typed clients send.

Not emulated: authentication and RBAC (every request is allowed; a kubeconfig's token shows in
the recorded requests), OpenAPI schemas of built-in kinds and strict field validation (unknown
fields of a custom resource are pruned, not refused), protobuf for other kinds (415), the core
and events.k8s.io views of one Event (they are two separate stores), field management of
server-side apply, conversion between versions of a custom resource (objects are shared,
apiVersion rewritten), and the controllers of a cluster (see :mod:`tidal_kube.scheduler` and
:mod:`tidal_kube.kubelet`).
"""

from __future__ import annotations

import collections
import itertools
import json
import re
import traceback
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal import parsing, rendering

from tidal_kube import openapi, tables
from tidal_kube.admission import Admission
from tidal_kube.deletion import Deletion
from tidal_kube.protobuf import PROTOBUF, from_protobuf
from tidal_kube.resources import CRD_KEY, KUBE_VERSION, Catalog, Obj, Resource, api_error
from tidal_kube.selector import matcher
from tidal_kube.storage import Storage
from tidal_kube.writes import Writes

INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
SYSTEM_PRIORITY_CLASSES = {"system-cluster-critical": 2_000_000_000,
                           "system-node-critical": 2_000_001_000}


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesScaffold):
    """The API server: serve it with :func:`~tidal_kube.serving.serve` or
    :class:`~tidal_kube.serving.EmulatorThread`.

    Its methods ``create``, ``get`` and ``list`` are for code on the emulator's event loop
    (tests, the local cluster); clients elsewhere use HTTP. ``gc_delay`` is how long the
    background garbage collector waits after an owner is deleted; ``history`` is how many
    changes per resource a watch can resume from, and ``requests`` holds the last ``history``
    requests (who asked what, for tests that audit it). kmock's DSL sees only the last
    ``dsl_requests``: it matches each request against each reaction by scanning its own log,
    so a long one makes every request slow (quadratic over a test); a fault injected with a
    slice (``[:N]``) or a count sees only those.
    """

    gc_delay: float = 0.0
    history: int = 10_000
    dsl_requests: int = 16
    requests: collections.deque[kmock.Request] = attrs.field(init=False)
    _ids: Iterator[int] = attrs.field(factory=itertools.count, init=False)
    failures: list[BaseException] = attrs.field(factory=list, init=False)
    storage: Storage = attrs.field(init=False)
    _catalog: Catalog = attrs.field(init=False)
    _deletion: Deletion = attrs.field(init=False)
    _writes: Writes = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.storage = Storage(self.history)
        self.requests = collections.deque(maxlen=self.history)
        self._catalog = Catalog(self.resources)
        self._deletion = Deletion(self.storage, self._catalog, self.gc_delay)
        self._writes = Writes(self.storage, self._catalog, Admission(self.storage, self._catalog),
                              self._deletion)
        self.fallback[self._is_object_request] << self._serve
        self.fallback["get", re.compile(r"/openapi/v3(/.+)?")] << self._serve_openapi
        for name in INITIAL_NAMESPACES:
            self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        for name, value in SYSTEM_PRIORITY_CLASSES.items():
            self.create({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                         "metadata": {"name": name}, "value": value})

    # -- in-process access (on the emulator's loop) ---------------------------------------------

    def create(self, obj: Obj) -> Obj:
        """Create an object given as a manifest (apiVersion and kind pick the resource)."""
        return self._writes.create_manifest(obj)

    def get(self, resource: str, namespace: str | None, name: str) -> Obj | None:
        """The stored object, e.g. ``get("v1/pods", "default", "w-0")``, or None."""
        found = self._catalog.resource(kmock.resource(resource))
        obj = self.storage.objects.get(found.key(namespace, name))
        return found.output(obj) if obj is not None else None

    def list(self, resource: str, namespace: str | None = None,
             labels: str | None = None) -> list[Obj]:
        """The stored objects of a resource, sorted by namespace and name."""
        found = self._catalog.resource(kmock.resource(resource))
        match = matcher(found, namespace, None, {"labelSelector": labels or ""})
        return [found.output(obj) for obj in self.storage.select(found, match)]

    def resource_for(self, api_version: str, kind: str) -> Resource:
        """The resource that serves ``kind`` in ``api_version``."""
        return self._catalog.resource_for(api_version, kind)

    @property
    def resource_version(self) -> int:
        return self.storage.rv

    # -- HTTP -----------------------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """The API server's answer, with the bare ``application/json`` content type it sends:
        clients (lightkube) parse a Status only from that exact type."""
        response = await self._answer(raw_request)
        if not response.prepared and response.content_type == "application/json":
            response.charset = None
        return response

    async def _answer(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """kmock's entry point with a path parser that knows ``/api/v1/namespaces/{name}``; an
        API error (404, 409, 422...) is an answer, not an error of the emulator."""
        await raw_request.read()
        try:
            request = await _parse_request(raw_request, next(self._ids))
            self.requests.append(request)
            self._requests.append(request)
            if len(self._requests) > 2 * self.dsl_requests:
                del self._requests[: -self.dsl_requests]
            return await self._handle(request)
        except rendering.StreamingError as exc:  # a watch has started: end it with an ERROR
            raw_response = exc.args[0]
            self._record(exc.__cause__ or exc)
            await self._stream_error(exc.__cause__ or exc, raw_response)
            await raw_response.write_eof()
            return raw_response
        except kmock.KubernetesError as exc:
            return await self._render_error(exc)
        except Exception as exc:
            self._record(exc)
            return await self._render_error(exc)

    def _record(self, exc: BaseException) -> None:
        """A failure of the emulator itself (not an API error): kept for tests in ``failures``."""
        traceback.print_exception(exc)
        self.failures.append(exc)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if not isinstance(exc, kmock.KubernetesError):
            exc = api_error(500, "InternalError", f"emulator failure: {exc!r}")
        return aiohttp.web.json_response({
            "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
            "code": exc.status, "reason": exc.reason, "message": exc.message,
            "details": exc.details,
        }, status=exc.status)

    @staticmethod
    def _is_object_request(request: kmock.Request) -> bool:
        return request.resource is not None and request.resource.plural is not None

    async def _serve(self, request: kmock.Request) -> kmock.Response:
        """Every request to an object or a collection: dispatch by method and path."""
        assert request.resource is not None
        resource = self._catalog.resource(request.resource)
        ns, name, sub, params = request.namespace, request.name, request.subresource, request.params
        method = request.method.value
        if ns is not None and not resource.namespaced:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        table = tables.wants_table(request)
        if method == "GET" and params.get("watch") in ("true", "1"):
            events = self._watch(resource, ns, name, params)
            if table:
                events = tables.table_events(resource, events, params, self._columns(resource))
            # kubectl reads a watch only with the content type a real server sends
            return kmock.Response(status=200, payload=events,
                                  headers={"Content-Type": "application/json"})
        if sub not in (None, "status") and not (resource.is_("", "pods") and sub == "binding"):
            raise api_error(404, "NotFound", f"the server could not find the requested resource "
                            f"({sub})")
        if sub == "status" and "status" not in resource.subresources:
            raise api_error(404, "NotFound", f"{resource.qualified} have no status subresource")
        dry = params.get("dryRun") == "All"
        protobuf = request.headers.get("Content-Type", "").startswith(PROTOBUF)
        body = from_protobuf(resource, request.body) if protobuf else _body(request)
        status, payload = 200, None
        if method == "GET":
            payload = (self._list(resource, ns, params) if name is None
                       else resource.output(self.storage.current(resource, ns, name)))
            if table:
                payload = tables.table(resource, payload, params, self._columns(resource))
        elif method == "POST" and name is None:
            if resource.namespaced and ns is None:
                raise api_error(405, "MethodNotAllowed", "create namespaced objects in a namespace")
            status, payload = 201, self._writes.create(resource, ns, _object(body), dry=dry)
        elif method == "POST" and sub == "binding":
            status, payload = 201, self._writes.bind(resource, ns, name, _object(body))
        elif method == "PUT" and name is not None:
            payload = self._writes.replace(resource, ns, name, _object(body), sub, dry)
        elif method == "PATCH" and name is not None:
            content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
            status, payload = self._writes.patch(resource, ns, name, body, content_type, sub,
                                                 params, dry)
        elif method == "DELETE":
            options = {**(body if isinstance(body, dict) else {}), **params}
            payload = (self._deletion.delete_collection(resource, ns, params, options, dry)
                       if name is None else self._deletion.delete(resource, ns, name, options, dry))
        else:
            raise api_error(405, "MethodNotAllowed", f"{method} is not supported here")
        # Always with a status: kmock keeps the last one given on the reaction for the next answer.
        return kmock.Response(status=status, payload=payload)

    def _list(self, resource: Resource, ns: str | None, params: Mapping[str, str]) -> Obj:
        items = self.storage.select(resource, matcher(resource, ns, None, params))
        start = int(params.get("continue") or 0)
        limit = int(params.get("limit") or 0)
        end = start + limit if limit > 0 else len(items)
        meta: Obj = {"resourceVersion": str(self.storage.rv)}
        if end < len(items):
            meta["continue"] = str(end)
        return {
            "apiVersion": resource.api_version, "kind": f"{resource.kind}List", "metadata": meta,
            "items": [resource.output(obj, with_kind=resource.custom) for obj in items[start:end]],
        }

    def _watch(self, resource: Resource, ns: str | None, name: str | None,
               params: Mapping[str, str]) -> AsyncIterator[Any]:
        """A watch stream; a bad selector is a 400 before the stream starts."""
        match = matcher(resource, ns, name, params)
        timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        return self.storage.stream(resource, match, timeout, params)

    def _columns(self, resource: Resource) -> list[tables.Column]:
        crd = self.storage.objects.get((*CRD_KEY, None, f"{resource.plural}.{resource.group}"))
        return tables.columns_of(resource, crd)

    # -- discovery, OpenAPI and the server's version --------------------------------------------

    async def _serve_version(self, request: kmock.Request) -> kmock.Payload:
        """``/api/v1``, ``/apis/{group}/{version}``: the resources and the subresources served."""
        assert request.resource is not None
        group, version = request.resource.group or "", request.resource.version or ""
        entries = []
        for key, info in self.resources.items():
            if (key.group, key.version) != (group, version):
                continue
            entries.append({
                "name": key.plural, "singularName": info.singular or key.plural, "kind": info.kind,
                "namespaced": bool(info.namespaced), "verbs": sorted(info.verbs),
                "shortNames": sorted(info.shortnames), "categories": sorted(info.categories),
            })
            for sub in sorted(info.subresources):
                binding = sub == "binding"
                entries.append({
                    "name": f"{key.plural}/{sub}", "singularName": "",
                    "namespaced": bool(info.namespaced),
                    "kind": "Binding" if binding else info.kind,
                    "verbs": ["create"] if binding else ["get", "patch", "update"],
                })
        if not entries and group:
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        return {"apiVersion": "v1", "kind": "APIResourceList",
                "groupVersion": f"{group}/{version}" if group else version, "resources": entries}

    async def _serve_openapi(self, request: kmock.Request) -> kmock.Payload:
        return openapi.answer(request.url.path.removeprefix("/openapi/v3"), self._catalog)

    async def _serve_server_version(self, request: kmock.Request) -> kmock.Payload:
        """The Kubernetes version whose API this emulates (helm reads it for Capabilities)."""
        major, minor, _ = KUBE_VERSION.removeprefix("v").split(".", 2)
        return {"major": major, "minor": minor, "gitVersion": f"{KUBE_VERSION}+tidal.emulator",
                "gitCommit": "", "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z",
                "goVersion": "python", "compiler": "tidal", "platform": "linux/amd64"}


def _body(request: kmock.Request) -> Any:
    if request.data is not None or not request.text.strip():
        return request.data
    try:  # server-side apply sends YAML
        return yaml.safe_load(request.text)
    except yaml.YAMLError as exc:
        raise api_error(400, "BadRequest", f"the body could not be decoded: {exc}") from None


def _object(body: Any) -> Obj:
    if not isinstance(body, dict):
        raise api_error(400, "BadRequest", "the body must be a JSON object")
    return body


async def _parse_request(raw: aiohttp.web.BaseRequest, id: int) -> kmock.Request:
    """kmock's request, from a path parser that tells ``/api/v1/namespaces/{name}`` (a
    namespace) from ``/api/v1/namespaces/{namespace}/{plural}``."""
    body = await raw.read()
    text = body.decode("utf-8", errors="replace")  # protobuf bodies are not text
    try:
        data = json.loads(text) if raw.body_exists else None
    except ValueError:
        data = None
    path = parse_path(raw.path)
    method = kmock.method(raw.method)
    resource = None if path.group is None else kmock.resource(
        group=path.group, version=path.version, plural=path.plural)
    return kmock.Request(
        id=id, raw_request=raw, url=raw.url, method=raw.method, params=dict(raw.query),
        headers=dict(raw.headers), cookies=dict(raw.cookies), data=data, body=body,
        text=text, action=parsing.guess_k8s(path, method, dict(raw.query)),
        resource=resource, namespace=path.namespace, name=path.name, subresource=path.subresource,
    )


def parse_path(path: str) -> parsing.ParsedPath:
    """``/api/v1/...`` or ``/apis/{group}/{version}/...`` into group, version, plural, namespace,
    name and subresource."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return parsing.ParsedPath()
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    plural = rest[0] if rest else None
    name = rest[1] if len(rest) > 1 else None
    subresource = "/".join(rest[2:]) or None
    return parsing.ParsedPath(group, version, plural, namespace, name, subresource)
