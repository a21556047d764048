"""A Kubernetes API double: the REST API of a kube-apiserver, served over HTTP by aiohttp, for
testing Quartermaster's `kubernetes` executor backend with the real `kubernetes-asyncio` client.

Why it exists: no kube-apiserver can run on the machines Quartermaster is built and tested on
(no Docker, so no kind, k3d or minikube; no package ships a standalone apiserver), and `kmock`'s
emulator is not faithful enough to drive a backend (its watches fail with kubernetes-asyncio,
it ignores selectors and resourceVersion, and it slows down quadratically). See
../shared/INFRA.md, "Kubernetes".

Faithful to (as a client sees it):
- Paths `/api/v1/...` and `/apis/<group>/<version>/...`, namespaced and cluster-scoped, listing
  across namespaces; discovery (`/api`, `/api/v1`, `/apis`, `/apis/<group>[/<version>]`),
  `/version`, `/healthz`. Resources come from a table (`strategies.BUILTIN_RESOURCES`; add a
  line, or call `double.register(custom_resource(...))`): core v1 pods, nodes, services, events,
  configmaps, secrets, serviceaccounts, namespaces; coordination.k8s.io leases; policy
  poddisruptionbudgets; scheduling.k8s.io priorityclasses; autoscaling.x-k8s.io
  provisioningrequests as a custom resource.
- Metadata: uid, creationTimestamp, generation, and resourceVersion from one global counter (a
  string, as in etcd); generateName; 201 on create, 409 AlreadyExists, 404 NotFound (also for a
  missing namespace), 409 Conflict on a stale resourceVersion in PUT or in a patch, 422 Invalid
  with causes (missing name, bad names, label keys and values, pods without containers or image,
  fractional or unequal request/limit of extended resources such as nvidia.com/gpu, pod spec
  changes other than image/tolerations/activeDeadlineSeconds, adding a scheduling gate, adding
  a finalizer to an object being deleted), all as real `Status` objects.
- Patches: JSON patch (add/remove/replace/move/copy/test), merge patch, strategic merge patch
  (simplified, see patches.py; refused with 415 for custom resources, as the API does);
  server-side apply is refused with 415 UnsupportedMediaType.
- The `status` subresource: PUT/PATCH on `/status` changes only status; a write to the object
  keeps the stored status (pods, nodes, services, namespaces, and custom resources that have
  one). A write that changes nothing bumps nothing and sends no event.
- Deletion: finalizers hold an object (deletionTimestamp set) until they are removed. A pod
  bound to a node and not yet finished is deleted gracefully: gracePeriodSeconds (query or
  DeleteOptions body) or else spec.terminationGracePeriodSeconds sets deletionTimestamp and
  deletionGracePeriodSeconds, and the pod stays until the kubelet ends it
  (`double.finish_pod_termination(...)`, or the auto kubelet); grace 0, an unscheduled pod or a
  finished one goes at once. A second delete may shorten the grace. Every delete is recorded in
  `double.deletions` with the grace asked for and applied.
- List and watch with labelSelector (=, ==, !=, in, notin, exists, !exists, gt, lt) and
  fieldSelector (=, ==, != on metadata.name, metadata.namespace and each resource's fields, e.g.
  spec.nodeName and status.phase for pods; others answer 400 as the API does); limit/continue.
- Watches (`watch=true`, `watch=True`, `watch=1`): newline-delimited ADDED/MODIFIED/DELETED/
  BOOKMARK/ERROR events; from resourceVersion N every later change is replayed from a history
  window per resource, so a resumed watch loses and repeats nothing; a resourceVersion older than
  the window (or than `double.compact()`) gets an ERROR event carrying a 410 Expired Status, as
  the API sends it; selectors are applied to events as the watch cache does (an object that stops
  matching arrives as DELETED); allowWatchBookmarks, sendInitialEvents with the
  initial-events-end bookmark, timeoutSeconds (a final bookmark, then the stream ends).

Simplified, on purpose:
- No authentication, authorization, admission webhooks, server-side apply, dryRun (400),
  protobuf or YAML bodies, managedFields, or resourceVersion semantics on get/list (always the
  newest state; `continue` pages are not a snapshot). A PUT without resourceVersion is an
  unconditional update for every resource (the API demands one for custom resources). Custom
  resources have no schema validation and select only on metadata.name/namespace. Timestamps a
  client writes are stored as sent, not normalized.
- No controllers run unless a test plays them: no garbage collector (ownerReferences do not
  cascade), no namespace controller (deleting a namespace removes its contents at once), no node
  lifecycle controller (hooks add its taints), no kube-scheduler or kubelet except the optional
  auto kubelet (kubelet.py: first fitting node by name, no scoring, no preemption, pod
  restartPolicy not applied). Defaults are the few a client can observe on pods (restartPolicy,
  terminationGracePeriodSeconds, schedulerName, requests from limits, qosClass) and services
  (cluster IP). Every object has metadata.generation, bumped by changes outside metadata/status.
- Namespaces default, kube-system, kube-public and kube-node-lease exist from the start; others
  must be created, as in a cluster. Watches from a resourceVersion newer than the newest are
  served as if from the newest; each watch's unsent events queue in memory without bound.

Test hooks (methods of `KubeApiDouble`, the double; all synchronous, run on its loop):
- nodes: add_node, set_node_ready (True/False/None=Unknown, with the controller's taints),
  cordon_node, set_node_taints, set_node_allocatable, delete_node;
- pods: bind_pod, pod_running, pod_succeeded, pod_failed, pod_oom_killed, pod_waiting
  (ImagePullBackOff, ErrImagePull...), pod_rejected (UnexpectedAdmissionError...), pod_evicted,
  pod_unschedulable, finish_pod_termination; any object: set_status, mutate; auto_kubelet;
- the API itself: compact, drop_watches (graceful or abrupt), send_bookmarks, watcher_count,
  inject_fault / clear_faults (next N requests by verb and resource answer an error status or
  hang), and the records `requests` (verb, resource, content type, query of each request) and
  `deletions` (grace asked for and applied); find, get, objects, create, delete and the other
  verbs, in Python.

What kubernetes-asyncio 36.1.0 does against it (measured by test_server.py; the same against a
real apiserver):
- `Watch().stream(...)` sends `watch=True`. An expired resourceVersion surfaces as
  `ApiException(status=410, reason="Expired: too old resource version: ...")`; without
  `timeout_seconds` the Watch first retries once from the same version by itself. The cure is
  to list again and watch from the list's metadata.resourceVersion.
- Without `timeout_seconds`, a Watch whose stream ends (timeout, `drop_watches()`) reconnects by
  itself from the last resourceVersion it yielded (bookmarks included), so nothing is lost; with
  `timeout_seconds` the iteration simply ends. A connection cut mid-stream
  (`drop_watches(abrupt=True)`) raises `aiohttp.ClientPayloadError` out of the iteration.
- CoreV1Api `patch_*` sends a dict as `application/strategic-merge-patch+json` and a list as
  `application/json-patch+json`; pass `_content_type="application/merge-patch+json"` for a merge
  patch. CustomObjectsApi `patch_*` sends a dict as `application/json-patch+json` (so the API
  answers 400): always pass `_content_type="application/merge-patch+json"` there.
- Errors are `ApiException` with `.status` and the Status JSON in `.body`; a 429 carries the
  `Retry-After` header in `.headers`; a hang beyond `_request_timeout` raises
  `asyncio.TimeoutError`.

Using it: `async with serve_double() as kube:` gives `kube.url` and `kube.double` (the hooks);
`kube.api_client()` (or `api_client_for(url)`) is a kubernetes-asyncio ApiClient for it;
`write_kubeconfig(path, url)` for a process that loads a kubeconfig; `run_in_thread()` serves
it beside synchronous tests; `python -m tests.kubeapi --port N` serves it standalone, with
the hooks at `POST /_double/<hook>` (JSON body: the hook's keyword arguments). Fixtures:
tests/kubeapi/fixtures.py (`kube_api`, `kube_client`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import yaml
from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration

from tests.kubeapi.kubelet import ClusterHooks
from tests.kubeapi.store import ABORT, END, ApiError, RequestRecord, Watcher, bad_request
from tests.kubeapi.strategies import Obj, ResourceType

T = TypeVar("T")

# Hooks reachable over HTTP (POST /_double/<name>), for a double in another process.
HTTP_HOOKS = frozenset(
    {
        "add_node",
        "set_node_ready",
        "cordon_node",
        "set_node_taints",
        "set_node_allocatable",
        "delete_node",
        "bind_pod",
        "pod_running",
        "pod_succeeded",
        "pod_failed",
        "pod_oom_killed",
        "pod_waiting",
        "pod_rejected",
        "pod_evicted",
        "pod_unschedulable",
        "finish_pod_termination",
        "set_status",
        "compact",
        "drop_watches",
        "send_bookmarks",
        "inject_fault",
        "clear_faults",
        "auto_kubelet",
        "watcher_count",
    }
)
_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
_NOT_FOUND = "the server could not find the requested resource"
_VERSION = {
    "major": "1",
    "minor": "31",
    "gitVersion": "v1.31.0+quartermaster-double",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2024-08-13T00:00:00Z",
    "goVersion": "go1.22.5",
    "compiler": "gc",
    "platform": "linux/amd64",
}


class KubeApiDouble(ClusterHooks):
    """The API's state, verbs and test hooks (see the module docstring); serve it with
    `serve_double`. All methods must run on the event loop serving it."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.closing = asyncio.Event()

    def shutdown(self) -> None:
        """End every watch, hang and timer, so the server stops at once."""
        self.closing.set()
        self.stop_timers()
        self.drop_watches()


@dataclasses.dataclass(frozen=True)
class Target:
    rt: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None

    @property
    def resource(self) -> str:
        return self.rt.key + (f"/{self.subresource}" if self.subresource else "")


def _flag(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1")


def _int(query: Any, key: str) -> int | None:
    value = query.get(key)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise bad_request(f"{key}: Invalid value: {value!r}: must be an integer") from None


def _json(obj: Any, status: int = 200) -> web.Response:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return web.Response(body=body, status=status, content_type="application/json")


def _line(event: Obj) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


def _error_response(error: ApiError) -> web.Response:
    response = _json(error.status(), error.code)
    response.headers.update(error.headers)
    return response


async def _body(request: web.Request, required: bool = True) -> Any:
    raw = await request.read()
    if not raw.strip():
        if required:
            raise bad_request("the request body is empty")
        return None
    try:
        return json.loads(raw)
    except ValueError as error:
        raise bad_request(f"couldn't get version/kind; json parse error: {error}") from None


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


class HttpApi:
    """Routes HTTP requests to the double: discovery, the REST verbs, watches and HTTP hooks."""

    def __init__(self, double: KubeApiDouble) -> None:
        self.double = double

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._route(request)
        except ApiError as error:
            return _error_response(error)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.path.strip("/")
        if path.startswith("/_double/"):
            return await self._hook(request, path.removeprefix("/_double/"))
        if path in ("/healthz", "/readyz", "/livez"):
            return web.Response(text="ok")
        if request.method == "GET" and (document := self._discovery(path)) is not None:
            return _json(document)
        target = self._target(path)
        verb = self._verb(request.method, target, request.query)
        self.double.requests.append(
            RequestRecord(
                verb,
                target.resource,
                target.namespace,
                target.name,
                request.content_type,
                dict(request.query),
            )
        )
        if fault := self.double.take_fault(verb, target.rt, target.subresource):
            await self._suffer(fault.hang)
            if fault.status is not None:
                raise fault.error()
        if "dryRun" in request.query:
            raise bad_request("dryRun is not supported by the Kubernetes API double")
        return await self._serve(request, verb, target)

    async def _suffer(self, hang: float) -> None:
        if hang > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.double.closing.wait(), hang)

    # --- paths and verbs ---

    def _target(self, path: str) -> Target:
        parts = [part for part in path.split("/") if part]
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, _NOT_FOUND)
        namespace = None
        # /namespaces/<ns>/<resource>/... unless <resource> is a subresource of the namespace.
        if (
            len(rest) >= 3
            and rest[0] == "namespaces"
            and self.double.lookup(group, version, rest[2])
        ):
            namespace, rest = rest[1], rest[2:]
        rt = self.double.lookup(group, version, rest[0]) if 1 <= len(rest) <= 3 else None
        if rt is None:
            raise ApiError(404, _NOT_FOUND)
        name = rest[1] if len(rest) > 1 else None
        subresource = rest[2] if len(rest) > 2 else None
        scoped_ok = rt.namespaced or namespace is None
        named_ok = not (rt.namespaced and name is not None and namespace is None)
        sub_ok = subresource is None or (subresource == "status" and rt.status)
        if not (scoped_ok and named_ok and sub_ok):
            raise ApiError(404, _NOT_FOUND)
        return Target(rt, namespace, name, subresource)

    @staticmethod
    def _verb(method: str, target: Target, query: Any) -> str:
        named = target.name is not None
        verbs = {
            ("GET", True): "get",
            ("GET", False): "watch" if _flag(query.get("watch")) else "list",
            ("POST", False): "create",
            ("PUT", True): "update",
            ("PATCH", True): "patch",
            ("DELETE", True): "delete",
            ("DELETE", False): "deletecollection",
        }
        verb = verbs.get((method, named))
        if verb is None or (target.subresource and verb not in ("get", "update", "patch")):
            raise ApiError(
                405, f"the server does not allow this method on the requested resource ({method})"
            )
        return verb

    # --- verbs ---

    async def _serve(self, request: web.Request, verb: str, t: Target) -> web.StreamResponse:
        double, query = self.double, request.query
        if verb == "get":
            return _json(double.get(t.rt, t.namespace, t.name or ""))
        if verb == "list":
            return _json(
                double.list(
                    t.rt,
                    t.namespace,
                    query.get("labelSelector", ""),
                    query.get("fieldSelector", ""),
                    _int(query, "limit"),
                    query.get("continue"),
                )
            )
        if verb == "watch":
            return await self._watch(request, t)
        if verb == "create":
            self._require_json(request)
            return _json(double.create(t.rt, t.namespace, await _body(request)), 201)
        if verb == "update":
            self._require_json(request)
            body = await _body(request)
            return _json(double.update(t.rt, t.namespace, t.name or "", body, t.subresource))
        if verb == "patch":
            return await self._patch(request, t)
        return await self._delete(request, verb, t)

    @staticmethod
    def _require_json(request: web.Request) -> None:
        if request.content_type not in ("application/json", "application/octet-stream"):
            raise ApiError(
                415,
                f"the body of the request was in an unknown format - accepted "
                f"media types include: application/json (got {request.content_type})",
            )

    async def _patch(self, request: web.Request, t: Target) -> web.Response:
        content_type = request.content_type
        self.double.check_patch_type(t.rt, content_type)
        body = await _body(request)
        patched = self.double.patch(
            t.rt, t.namespace, t.name or "", content_type, body, t.subresource
        )
        return _json(patched)

    async def _delete(self, request: web.Request, verb: str, t: Target) -> web.Response:
        query = request.query
        options = await _body(request, required=False) or {}
        if not isinstance(options, dict):
            raise bad_request("DeleteOptions must be a JSON object")
        if "propagationPolicy" in query:
            options["propagationPolicy"] = query["propagationPolicy"]
        grace = _int(query, "gracePeriodSeconds")
        if verb == "delete":
            return _json(self.double.delete(t.rt, t.namespace, t.name or "", grace, options))
        listed = self.double.delete_collection(
            t.rt,
            t.namespace,
            query.get("labelSelector", ""),
            query.get("fieldSelector", ""),
            grace,
            options,
        )
        return _json(listed)

    # --- watches ---

    async def _watch(self, request: web.Request, t: Target) -> web.StreamResponse:
        query = request.query
        timeout = _int(query, "timeoutSeconds")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        try:
            watcher = self.double.watch(
                t.rt,
                t.namespace,
                query.get("resourceVersion"),
                query.get("labelSelector", ""),
                query.get("fieldSelector", ""),
                _flag(query.get("allowWatchBookmarks")),
                _flag(query.get("sendInitialEvents")),
            )
        except ApiError as error:
            if error.code != 410:
                raise
            # The API answers an expired resourceVersion inside the stream: one ERROR event.
            await response.prepare(request)
            await response.write(_line({"type": "ERROR", "object": error.status()}))
            await response.write_eof()
            return response
        response.enable_chunked_encoding()
        try:
            await response.prepare(request)
            await self._pump(request, response, watcher, timeout)
        except ConnectionError:
            pass  # the client went away
        finally:
            self.double.unwatch(watcher)
        return response

    async def _pump(
        self,
        request: web.Request,
        response: web.StreamResponse,
        watcher: Watcher,
        timeout_s: int | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                first = await asyncio.wait_for(watcher.queue.get(), remaining)
            except TimeoutError:
                # As the API does at a watch's timeout: a last bookmark, then the end.
                watcher.bookmark(int(self.double.resource_version))
                watcher.end()
                deadline = None
                continue
            batch = [first]
            while not watcher.queue.empty():
                batch.append(watcher.queue.get_nowait())
            if await self._write_batch(request, response, batch):
                return

    @staticmethod
    async def _write_batch(
        request: web.Request, response: web.StreamResponse, batch: list[Obj | str]
    ) -> bool:
        """Write events up to an END or ABORT signal; True when the stream is over."""
        lines: list[bytes] = []
        for item in batch:
            if item == END:
                await response.write(b"".join(lines))
                await response.write_eof()
                return True
            if item == ABORT:
                await response.write(b"".join(lines))
                if request.transport is not None:
                    request.transport.abort()
                return True
            lines.append(_line(item))  # type: ignore[arg-type]
        await response.write(b"".join(lines))
        return False

    # --- discovery ---

    def _discovery(self, path: str) -> Obj | None:
        types = self.double.resource_types
        parts = path.split("/")[1:]
        if path == "/version":
            return dict(_VERSION)
        if path == "/api":
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ""}],
            }
        if path == "/api/v1":
            return _resource_list("v1", [rt for rt in types if not rt.group])
        if path == "/apis":
            groups = sorted({rt.group for rt in types if rt.group})
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [_group(g, types) for g in groups],
            }
        if len(parts) == 2 and parts[0] == "apis" and any(rt.group == parts[1] for rt in types):
            return {"kind": "APIGroup", "apiVersion": "v1", **_group(parts[1], types)}
        if len(parts) == 3 and parts[0] == "apis":
            matching = [rt for rt in types if rt.group == parts[1] and rt.version == parts[2]]
            return _resource_list(f"{parts[1]}/{parts[2]}", matching) if matching else None
        return None

    # --- hooks over HTTP ---

    async def _hook(self, request: web.Request, name: str) -> web.Response:
        if request.method != "POST" or name not in HTTP_HOOKS:
            raise ApiError(404, f"no test hook {name!r} (POST /_double/<hook>)")
        kwargs = await _body(request, required=False) or {}
        try:
            result = getattr(self.double, name)(**kwargs)
        except (TypeError, ValueError, KeyError) as error:
            raise bad_request(f"hook {name}: {error}") from None
        return _json({"result": _jsonable(result)})


def _resource_list(group_version: str, types: list[ResourceType]) -> Obj:
    resources: list[Obj] = []
    for rt in types:
        resources.append(
            {
                "name": rt.plural,
                "singularName": rt.singular,
                "namespaced": rt.namespaced,
                "kind": rt.kind,
                "verbs": _VERBS,
                "shortNames": list(rt.short_names),
            }
        )
        if rt.status:
            resources.append(
                {
                    "name": f"{rt.plural}/status",
                    "singularName": "",
                    "namespaced": rt.namespaced,
                    "kind": rt.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": resources,
    }


def _group(name: str, types: list[ResourceType]) -> Obj:
    versions = sorted({rt.version for rt in types if rt.group == name})
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": entries, "preferredVersion": entries[0]}


def build_app(double: KubeApiDouble) -> web.Application:
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_route("*", "/{path:.*}", HttpApi(double).handle)
    return app


# --- running it -----------------------------------------------------------------------------


def api_client_for(url: str) -> ApiClient:
    """A kubernetes-asyncio ApiClient for the double at `url` (plain HTTP, no credentials).
    Close it (`async with api_client_for(url) as client:`)."""
    return ApiClient(configuration=Configuration(host=url))


def kubeconfig(url: str, namespace: str = "default") -> Obj:
    """A kubeconfig pointing at the double, for code that loads one."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "double", "cluster": {"server": url}}],
        "users": [{"name": "double", "user": {}}],
        "contexts": [
            {
                "name": "double",
                "context": {"cluster": "double", "user": "double", "namespace": namespace},
            }
        ],
        "current-context": "double",
    }


def write_kubeconfig(path: Path, url: str, namespace: str = "default") -> Path:
    path.write_text(yaml.safe_dump(kubeconfig(url, namespace)))
    return path


@dataclasses.dataclass(frozen=True)
class RunningDouble:
    url: str
    double: KubeApiDouble

    def api_client(self) -> ApiClient:
        return api_client_for(self.url)


@contextlib.asynccontextmanager
async def serve_double(
    double: KubeApiDouble | None = None, host: str = "127.0.0.1", port: int = 0, **options: Any
) -> AsyncIterator[RunningDouble]:
    """Serve a double (a new one, built with `options`, unless given) on `host` and a free port
    (or `port`) until the block ends."""
    double = double or KubeApiDouble(**options)
    runner = web.AppRunner(
        build_app(double), access_log=None, shutdown_timeout=1.0, handler_cancellation=True
    )
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    try:
        site = web.SockSite(runner, sock)
        await site.start()
        yield RunningDouble(f"http://{host}:{sock.getsockname()[1]}", double)
    finally:
        double.shutdown()
        await runner.cleanup()
        sock.close()


@dataclasses.dataclass(frozen=True)
class ThreadedDouble:
    """A double served by a thread of its own, for synchronous tests."""

    url: str
    double: KubeApiDouble
    loop: asyncio.AbstractEventLoop

    def call(self, hook: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `hook` (e.g. `threaded.double.pod_running`) on the double's loop; its result."""

        async def invoke() -> T:
            return hook(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(invoke(), self.loop).result(timeout=30)


@contextlib.contextmanager
def run_in_thread(double: KubeApiDouble | None = None, **options: Any) -> Iterator[ThreadedDouble]:
    started: Future[tuple[RunningDouble, asyncio.AbstractEventLoop, asyncio.Event]] = Future()

    async def serve() -> None:
        stop = asyncio.Event()
        async with serve_double(double or KubeApiDouble(**options)) as running:
            started.set_result((running, asyncio.get_running_loop(), stop))
            await stop.wait()

    def main() -> None:
        try:
            asyncio.run(serve())
        except BaseException as error:
            if not started.done():
                started.set_exception(error)
            raise

    thread = threading.Thread(target=main, name="kubeapi-double", daemon=True)
    thread.start()
    running, loop, stop = started.result(timeout=30)
    try:
        yield ThreadedDouble(running.url, running.double, loop)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)


async def _serve_forever(args: argparse.Namespace) -> None:
    async with serve_double(host=args.host, port=args.port) as running:
        for node in args.node:
            running.double.add_node(node)
        if args.auto_kubelet:
            running.double.auto_kubelet(run_delay=args.run_delay)
        print(f"KUBEAPI_URL={running.url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the Kubernetes API double.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--node", action="append", default=[], help="add a Ready node")
    parser.add_argument("--auto-kubelet", action="store_true")
    parser.add_argument("--run-delay", type=float, default=0.0)
    asyncio.run(_serve_forever(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
