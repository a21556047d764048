"""The double's state and the API's generic rules: objects by resource and namespace, one global
resourceVersion counter, the event history each watch resumes from, open watches, deletion with
grace periods and finalizers, and the fault table.

Everything here is synchronous and runs on the server's event loop, so each API call is atomic
with respect to every other and to the hooks: a watch registered in the same step as its replay
cannot miss or repeat an event. Stored objects are never changed in place (every write stores a
new dict), so history entries and responses can share them without copying.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tests.kubeapi import patches, strategies
from tests.kubeapi.selectors import SelectorError, parse_field_selector, parse_label_selector
from tests.kubeapi.strategies import BUILTIN_RESOURCES, Cause, Obj, ResourceType, rfc3339

DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
ResourceRef = str | ResourceType

# --- errors -----------------------------------------------------------------------------------

_CAUSE_REASONS = {
    "Required value": "FieldValueRequired",
    "Invalid value": "FieldValueInvalid",
    "Forbidden": "FieldValueForbidden",
    "Duplicate value": "FieldValueDuplicate",
}
_REASONS = {
    400: "BadRequest",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    """An answer other than success, sent as a `Status` object exactly as the API sends them."""

    def __init__(
        self,
        code: int,
        message: str,
        reason: str | None = None,
        details: Obj | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or _REASONS.get(code, "Unknown")
        self.details = details
        self.headers = headers or {}

    def status(self) -> Obj:
        body: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def _details(rt: ResourceType, name: str) -> Obj:
    details: Obj = {"name": name, "kind": rt.plural}
    if rt.group:
        details["group"] = rt.group
    return details


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, f'{rt.key} "{name}" not found', details=_details(rt, name))


def already_exists(rt: ResourceType, name: str) -> ApiError:
    return ApiError(409, f'{rt.key} "{name}" already exists', "AlreadyExists", _details(rt, name))


def conflict(rt: ResourceType, name: str, why: str | None = None) -> ApiError:
    why = why or "the object has been modified; please apply your changes to the latest version"
    message = f'Operation cannot be fulfilled on {rt.key} "{name}": {why}'
    if "latest version" in why:
        message += " and try again"
    return ApiError(409, message, "Conflict", _details(rt, name))


def invalid(rt: ResourceType, name: str, causes: list[Cause]) -> ApiError:
    rendered = [f"{path}: {kind}: {detail}".rstrip(": ") for path, kind, detail in causes]
    summary = rendered[0] if len(rendered) == 1 else "[" + ", ".join(rendered) + "]"
    details = {
        "name": name,
        "group": rt.group,
        "kind": rt.kind,
        "causes": [
            {
                "reason": _CAUSE_REASONS.get(kind, "FieldValueInvalid"),
                "message": text,
                "field": path,
            }
            for (path, kind, _), text in zip(causes, rendered, strict=True)
        ],
    }
    return ApiError(422, f'{rt.kind} "{name}" is invalid: {summary}', "Invalid", details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


# --- history and watchers ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Change:
    """One committed write: the object after it and, for a modification, before it."""

    rv: int
    type: str  # ADDED, MODIFIED or DELETED
    obj: Obj
    old: Obj | None = None


class History:
    """The last `window` changes of one resource. A watch may resume from any resourceVersion at
    or after `horizon` (the newest change it no longer holds); older ones get 410 Expired."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.changes: deque[Change] = deque()
        self.horizon = 0

    def append(self, change: Change) -> None:
        if len(self.changes) >= self.window:
            self.horizon = self.changes.popleft().rv
        self.changes.append(change)

    def since(self, rv: int) -> list[Change]:
        if rv < self.horizon:
            raise ApiError(410, f"too old resource version: {rv} ({self.horizon})")
        newer: list[Change] = []
        # Walk back from the newest change: cost is the number of events replayed, not the
        # history's length.
        for change in reversed(self.changes):
            if change.rv <= rv:
                break
            newer.append(change)
        newer.reverse()
        return newer

    def compact(self, rv: int) -> None:
        self.changes.clear()
        self.horizon = rv


END = "end"  # close the watch as the API does at its timeout: the stream simply ends
ABORT = "abort"  # cut the connection mid-stream, as a failing load balancer would


class Watcher:
    """One open watch: the events it still has to send, filtered the way the API's watch cache
    filters them (an object that stops matching the selectors is sent as DELETED, one that
    starts matching as ADDED)."""

    def __init__(self, rt: ResourceType, matches: Callable[[Obj], bool], bookmarks: bool) -> None:
        self.rt = rt
        self.matches = matches
        self.bookmarks = bookmarks
        self.queue: asyncio.Queue[Obj | str] = asyncio.Queue()

    def offer(self, change: Change) -> None:
        if (event := self._event(change)) is not None:
            self.queue.put_nowait(event)

    def _event(self, change: Change) -> Obj | None:
        now = self.matches(change.obj)
        if change.type != "MODIFIED" or change.old is None:
            return {"type": change.type, "object": change.obj} if now else None
        before = self.matches(change.old)
        if now:
            return {"type": "MODIFIED" if before else "ADDED", "object": change.obj}
        if before:
            # As the watch cache does: the last state that matched, at the new resourceVersion.
            gone = {**change.old, "metadata": {**change.old["metadata"]}}
            gone["metadata"]["resourceVersion"] = str(change.rv)
            return {"type": "DELETED", "object": gone}
        return None

    def bookmark(self, rv: int, initial_events_end: bool = False) -> None:
        if not self.bookmarks:
            return
        metadata: Obj = {"resourceVersion": str(rv)}
        if initial_events_end:
            metadata["annotations"] = {"k8s.io/initial-events-end": "true"}
        obj = {"kind": self.rt.kind, "apiVersion": self.rt.api_version, "metadata": metadata}
        self.queue.put_nowait({"type": "BOOKMARK", "object": obj})

    def end(self, abrupt: bool = False) -> None:
        self.queue.put_nowait(ABORT if abrupt else END)


# --- records and faults -----------------------------------------------------------------------


@dataclass(frozen=True)
class RequestRecord:
    """One API request as the double understood it (for tests that assert what a client sent)."""

    verb: str  # get, list, watch, create, update, patch, delete, deletecollection
    resource: str  # `pods`, `pods/status`, `leases.coordination.k8s.io`
    namespace: str | None
    name: str | None
    content_type: str
    query: dict[str, str]


@dataclass(frozen=True)
class DeletionRecord:
    """One delete: the grace period the client asked for and the one the API applied."""

    resource: str
    namespace: str | None
    name: str
    uid: str
    requested_grace_seconds: int | None
    grace_seconds: int
    propagation_policy: str | None


@dataclass
class Fault:
    """The next `times` requests matching `verb` and `resource` (None matches any) wait `hang`
    seconds, then answer `status` (a Status error) or, if `status` is None, are served normally.
    `times=None` keeps the fault until cleared."""

    verb: str | None = None
    resource: str | None = None
    status: int | None = 500
    hang: float = 0.0
    times: int | None = 1
    retry_after: int = 1
    message: str = ""
    hits: int = 0

    def applies(self, verb: str, resources: Iterable[str]) -> bool:
        verb_ok = self.verb is None or self.verb == verb
        return verb_ok and (self.resource is None or self.resource in resources)

    def error(self) -> ApiError:
        code = self.status or 500
        message = self.message or f"injected fault: {_REASONS.get(code, code)}"
        headers, details = {}, None
        if code == 429:
            headers["Retry-After"] = str(self.retry_after)
            details = {"retryAfterSeconds": self.retry_after}
        return ApiError(code, message, details=details, headers=headers)


# --- the store --------------------------------------------------------------------------------

Listener = Callable[[ResourceType, Change], None]


class ApiStore:
    """The API's state and verbs. `KubeApiDouble` adds the kubelet and controller hooks."""

    def __init__(
        self,
        *,
        history_window: int = 10_000,
        namespaces: Iterable[str] = DEFAULT_NAMESPACES,
        resources: Iterable[ResourceType] = BUILTIN_RESOURCES,
        seed: int = 0,
    ) -> None:
        self.history_window = history_window
        self._types: dict[str, ResourceType] = {}
        self._objects: dict[str, dict[tuple[str, str], Obj]] = {}
        self._history: dict[str, History] = {}
        self._watchers: dict[str, set[Watcher]] = {}
        self._listeners: list[Listener] = []
        self._rv = 0
        self._ips = 0
        self._random = random.Random(seed)  # uids and generated names, repeatable run to run
        self.faults: list[Fault] = []
        self.requests: list[RequestRecord] = []
        self.deletions: list[DeletionRecord] = []
        for rt in resources:
            self.register(rt)
        for namespace in namespaces:
            self.create("namespaces", None, {"metadata": {"name": namespace}})

    # -- the resource table --

    def register(self, rt: ResourceType) -> ResourceType:
        """Serve another resource (a custom resource, say) from now on."""
        self._types[rt.key] = rt
        self._objects.setdefault(rt.key, {})
        self._history.setdefault(rt.key, History(self.history_window))
        self._watchers.setdefault(rt.key, set())
        return rt

    @property
    def resource_types(self) -> list[ResourceType]:
        return list(self._types.values())

    def resource(self, ref: ResourceRef) -> ResourceType:
        """A resource by key (`pods`, `leases.coordination.k8s.io`) or by a unique plural."""
        if isinstance(ref, ResourceType):
            return ref
        if ref in self._types:
            return self._types[ref]
        matches = [rt for rt in self._types.values() if ref in (rt.plural, rt.kind)]
        if len(matches) != 1:
            raise KeyError(f"no single resource named {ref!r}")
        return matches[0]

    def lookup(self, group: str, version: str, plural: str) -> ResourceType | None:
        rt = self._types.get(f"{plural}.{group}" if group else plural)
        return rt if rt is not None and rt.version == version else None

    @property
    def resource_version(self) -> str:
        """The newest resourceVersion handed out (one counter for every resource, as in etcd)."""
        return str(self._rv)

    def add_listener(self, listener: Listener) -> None:
        """Call `listener` after every committed change (the auto kubelet's informer)."""
        self._listeners.append(listener)

    # -- reads --

    def find(self, resource: ResourceRef, namespace: str | None, name: str) -> Obj | None:
        rt = self.resource(resource)
        return self._objects[rt.key].get((self._ns(rt, namespace), name))

    def get(self, resource: ResourceRef, namespace: str | None, name: str) -> Obj:
        rt = self.resource(resource)
        obj = self.find(rt, namespace, name)
        if obj is None:
            raise not_found(rt, name)
        return obj

    def objects(self, resource: ResourceRef, namespace: str | None = None) -> list[Obj]:
        """The stored objects of a resource (in one namespace, or all), by namespace and name."""
        rt = self.resource(resource)
        found = self._objects[rt.key]
        namespace = namespace if rt.namespaced else None
        keys = sorted(key for key in found if namespace is None or key[0] == namespace)
        return [found[key] for key in keys]

    def list(
        self,
        resource: ResourceRef,
        namespace: str | None = None,
        label_selector: str = "",
        field_selector: str = "",
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> Obj:
        """The List object the API answers a list with, resourceVersion and paging included."""
        rt = self.resource(resource)
        matches = self._matcher(rt, namespace, label_selector, field_selector)
        items = [obj for obj in self.objects(rt, namespace) if matches(obj)]
        if continue_token:
            start = _decode_continue(continue_token)
            items = [obj for obj in items if _sort_key(obj) > start]
        metadata: Obj = {"resourceVersion": str(self._rv)}
        if limit and len(items) > limit:
            metadata["remainingItemCount"] = len(items) - limit
            items = items[:limit]
            metadata["continue"] = _encode_continue(_sort_key(items[-1]))
        return {
            "kind": f"{rt.kind}List",
            "apiVersion": rt.api_version,
            "metadata": metadata,
            "items": items,
        }

    def _matcher(
        self, rt: ResourceType, namespace: str | None, label_text: str, field_text: str
    ) -> Callable[[Obj], bool]:
        try:
            labels = parse_label_selector(label_text)
            fields = parse_field_selector(field_text)
        except SelectorError as error:
            raise bad_request(str(error)) from None
        allowed = {"metadata.name", "metadata.namespace", *rt.fields}
        for label in fields.fields - allowed:
            raise bad_request(f'field label not supported: "{label}"')
        wanted = fields.fields

        def matches(obj: Obj) -> bool:
            meta = obj["metadata"]
            if namespace is not None and meta.get("namespace") != namespace:
                return False
            if not labels.matches(meta.get("labels")):
                return False
            return fields.matches({f: strategies.field_value(obj, f) for f in wanted})

        return matches

    # -- writes --

    def create(self, resource: ResourceRef, namespace: str | None, body: Any) -> Obj:
        rt = self.resource(resource)
        namespace = self._ns(rt, namespace)
        # A copy: the caller's dict must not become (and later change) the stored object.
        obj = self._checked_body(rt, namespace, _owned(body))
        meta = obj["metadata"]
        self._require_namespace(rt, namespace)
        name = meta.get("name") or self._generated_name(rt, namespace, meta)
        for system_field in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(system_field, None)
        meta.update(name=name, uid=self._uid(), creationTimestamp=rfc3339(), generation=1)
        strategies.prepare_create(rt, obj, self._allocate_ip)
        if causes := strategies.validate(rt, obj):
            raise invalid(rt, name, causes)
        if (namespace, name) in self._objects[rt.key]:
            raise already_exists(rt, name)
        return self._commit_new(rt, obj)

    def update(
        self,
        resource: ResourceRef,
        namespace: str | None,
        name: str,
        body: Any,
        subresource: str | None = None,
    ) -> Obj:
        """PUT: the whole object; a stale metadata.resourceVersion is a 409 Conflict (none at all
        is an unconditional update, as the built-in resources allow)."""
        rt = self.resource(resource)
        old = self.get(rt, namespace, name)
        incoming = self._checked_body(rt, self._ns(rt, namespace), _owned(body))
        return self._write(rt, old, incoming, subresource)

    def patch(
        self,
        resource: ResourceRef,
        namespace: str | None,
        name: str,
        content_type: str,
        patch: Any,
        subresource: str | None = None,
    ) -> Obj:
        rt = self.resource(resource)
        old = self.get(rt, namespace, name)
        self.check_patch_type(rt, content_type)
        try:
            patched = patches.apply_patch(content_type, patches.clone(old), patch)
        except patches.PatchError as error:
            raise ApiError(error.code, str(error)) from None
        incoming = self._checked_body(rt, self._ns(rt, namespace), patched)
        return self._write(rt, old, incoming, subresource)

    def check_patch_type(self, rt: ResourceType, content_type: str) -> None:
        if content_type in patches.APPLY_PATCHES:
            raise ApiError(
                415,
                "server-side apply is not supported by the Kubernetes API double; "
                "send a merge, strategic merge or JSON patch",
            )
        accepted = [patches.JSON_PATCH, patches.MERGE_PATCH]
        if rt.builtin:
            accepted.append(patches.STRATEGIC_MERGE_PATCH)
        if content_type not in accepted:
            raise ApiError(
                415,
                "the body of the request was in an unknown format - accepted "
                f"media types include: {', '.join(accepted)}",
            )

    def _write(self, rt: ResourceType, old: Obj, incoming: Obj, subresource: str | None) -> Obj:
        meta, old_meta = incoming["metadata"], old["metadata"]
        name = old_meta["name"]
        if meta.get("name") != name:
            raise bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the URL "
                f"({name})"
            )
        if meta.get("resourceVersion") and meta["resourceVersion"] != old_meta["resourceVersion"]:
            raise conflict(rt, name)
        if subresource == "status":
            new = patches.clone(old)
            new["status"] = incoming.get("status") or {}
        elif subresource is not None:
            raise not_found(rt, f"{name}/{subresource}")
        else:
            new = self._main_update(rt, old, incoming)
        return self._commit_update(rt, old, new)

    def _main_update(self, rt: ResourceType, old: Obj, new: Obj) -> Obj:
        """A write to the object itself: system metadata is kept, and so is the status of a
        resource with a status subresource (as the API ignores it there)."""
        meta, old_meta = new["metadata"], old["metadata"]
        for system_field in (
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "namespace",
        ):
            if system_field in old_meta:
                meta[system_field] = old_meta[system_field]
            else:
                meta.pop(system_field, None)
        if rt.status:
            if "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        causes = strategies.prepare_update(rt, old, new) + strategies.validate(rt, new)
        if "deletionTimestamp" in old_meta:
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                causes.append(
                    (
                        "metadata.finalizers",
                        "Forbidden",
                        "no new finalizers can be added if the object is being deleted",
                    )
                )
        if causes:
            raise invalid(rt, old_meta["name"], causes)
        return new

    def mutate(
        self, resource: ResourceRef, namespace: str | None, name: str, change: Callable[[Obj], Any]
    ) -> Obj:
        """For hooks playing kubelet and controllers: `change` edits a copy of the object in
        place (any field, spec or status); the result is committed like any write."""
        rt = self.resource(resource)
        old = self.get(rt, namespace, name)
        new = patches.clone(old)
        change(new)
        return self._commit_update(rt, old, new)

    def delete(
        self,
        resource: ResourceRef,
        namespace: str | None,
        name: str,
        grace_period_seconds: int | None = None,
        options: Obj | None = None,
    ) -> Obj:
        """DELETE. A pod on a node with a grace period is only marked (deletionTimestamp and
        deletionGracePeriodSeconds) and stays until the kubelet finishes it; any object with
        finalizers stays, marked, until its finalizers are gone."""
        rt = self.resource(resource)
        old = self.get(rt, namespace, name)
        options = options or {}
        self._check_preconditions(rt, old, options.get("preconditions") or {})
        if grace_period_seconds is None:
            grace_period_seconds = options.get("gracePeriodSeconds")
        grace = self._grace(rt, old, grace_period_seconds)
        meta = old["metadata"]
        self.deletions.append(
            DeletionRecord(
                rt.key,
                meta.get("namespace"),
                name,
                meta["uid"],
                grace_period_seconds,
                grace,
                options.get("propagationPolicy"),
            )
        )
        if rt.key == "namespaces":
            self._empty_namespace(name)
        return self._delete(rt, old, grace)

    def _check_preconditions(self, rt: ResourceType, old: Obj, preconditions: Obj) -> None:
        meta = old["metadata"]
        for key, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            wanted = preconditions.get(key)
            if wanted and wanted != meta[key]:
                raise conflict(
                    rt,
                    meta["name"],
                    f"Precondition failed: {label} in precondition: "
                    f"{wanted}, {label} in object meta: {meta[key]}",
                )

    @staticmethod
    def _grace(rt: ResourceType, obj: Obj, requested: int | None) -> int:
        """The pod strategy's rule; other resources have no graceful deletion."""
        if rt.key != "pods":
            return 0
        grace = requested
        if grace is None:
            grace = (obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
        if not (obj.get("spec") or {}).get("nodeName"):
            return 0  # never scheduled: nothing to stop
        if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return 0  # already stopped
        return 1 if grace < 0 else int(grace)

    def _delete(self, rt: ResourceType, old: Obj, grace: int) -> Obj:
        meta = old["metadata"]
        if not meta.get("finalizers") and grace == 0:
            return self._remove(rt, old)
        if "deletionTimestamp" in meta:
            # A second delete may only shorten a pod's grace period.
            current = meta.get("deletionGracePeriodSeconds")
            if rt.key != "pods" or current is None or grace >= current:
                return old
        new = patches.clone(old)
        new_meta = new["metadata"]
        new_meta["deletionTimestamp"] = rfc3339(time.time() + grace)
        new_meta["deletionGracePeriodSeconds"] = grace
        if "deletionTimestamp" not in meta:
            new_meta["generation"] = meta.get("generation", 0) + 1
        return self._commit_update(rt, old, new)

    def _empty_namespace(self, namespace: str) -> None:
        """Simplified namespace controller: everything in the namespace goes at once."""
        for rt in self._types.values():
            if rt.namespaced:
                for obj in self.objects(rt, namespace):
                    self._remove(rt, obj)

    def delete_collection(
        self,
        resource: ResourceRef,
        namespace: str | None,
        label_selector: str = "",
        field_selector: str = "",
        grace_period_seconds: int | None = None,
        options: Obj | None = None,
    ) -> Obj:
        rt = self.resource(resource)
        listed = self.list(rt, namespace, label_selector, field_selector)
        for obj in listed["items"]:
            meta = obj["metadata"]
            self.delete(rt, meta.get("namespace"), meta["name"], grace_period_seconds, options)
        return listed

    # -- commits: the only places that store, bump resourceVersion and emit events --

    def _commit_new(self, rt: ResourceType, obj: Obj) -> Obj:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        meta = obj["metadata"]
        self._objects[rt.key][(meta.get("namespace", ""), meta["name"])] = obj
        self._record(rt, Change(self._rv, "ADDED", obj))
        return obj

    def _commit_update(self, rt: ResourceType, old: Obj, new: Obj) -> Obj:
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:
            return old  # the API does not write, bump or notify for a write that changes nothing
        if strategies.spec_changed(old, new):
            new["metadata"]["generation"] = old["metadata"].get("generation", 0) + 1
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        meta = new["metadata"]
        self._objects[rt.key][(meta.get("namespace", ""), meta["name"])] = new
        self._record(rt, Change(self._rv, "MODIFIED", new, old))
        return self._finish_if_done(rt, new)

    def _finish_if_done(self, rt: ResourceType, obj: Obj) -> Obj:
        """A deleted object goes once its finalizers are empty (and, for a pod, once the kubelet
        has ended it: deletionGracePeriodSeconds 0)."""
        meta = obj["metadata"]
        if "deletionTimestamp" not in meta or meta.get("finalizers"):
            return obj
        if rt.key == "pods" and meta.get("deletionGracePeriodSeconds", 0) > 0:
            return obj
        return self._remove(rt, obj)

    def _remove(self, rt: ResourceType, obj: Obj) -> Obj:
        meta = obj["metadata"]
        del self._objects[rt.key][(meta.get("namespace", ""), meta["name"])]
        self._rv += 1
        final = {**obj, "metadata": {**meta, "resourceVersion": str(self._rv)}}
        self._record(rt, Change(self._rv, "DELETED", final, obj))
        return final

    def _record(self, rt: ResourceType, change: Change) -> None:
        self._history[rt.key].append(change)
        for watcher in self._watchers[rt.key]:
            watcher.offer(change)
        for listener in self._listeners:
            listener(rt, change)

    # -- watches --

    def watch(
        self,
        resource: ResourceRef,
        namespace: str | None = None,
        resource_version: str | None = None,
        label_selector: str = "",
        field_selector: str = "",
        bookmarks: bool = False,
        send_initial_events: bool = False,
    ) -> Watcher:
        """Open a watch. Without a resourceVersion (or "0"), or with sendInitialEvents, it starts
        with ADDED for every matching object; from resourceVersion N it replays every change
        after N, or raises 410 Expired if the history no longer reaches back to N."""
        rt = self.resource(resource)
        watcher = Watcher(
            rt, self._matcher(rt, namespace, label_selector, field_selector), bookmarks
        )
        if send_initial_events or resource_version in (None, "", "0"):
            for obj in self.objects(rt, namespace):
                watcher.offer(Change(int(obj["metadata"]["resourceVersion"]), "ADDED", obj))
            if send_initial_events:
                watcher.bookmark(self._rv, initial_events_end=True)
        else:
            for change in self._history[rt.key].since(_parse_rv(resource_version)):
                watcher.offer(change)
        self._watchers[rt.key].add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers[watcher.rt.key].discard(watcher)

    def watcher_count(self, resource: ResourceRef | None = None) -> int:
        """Open watches (on one resource, or all): wait on this before changing what a watch
        must see, rather than sleeping."""
        if resource is None:
            return sum(len(watchers) for watchers in self._watchers.values())
        return len(self._watchers[self.resource(resource).key])

    def drop_watches(self, resource: ResourceRef | None = None, abrupt: bool = False) -> int:
        """End open watches. Graceful (default): the stream ends as at a timeout, so a client
        resumes from its last resourceVersion. Abrupt: the connection is cut mid-stream."""
        keys = [self.resource(resource).key] if resource is not None else list(self._watchers)
        dropped = 0
        for key in keys:
            for watcher in self._watchers[key]:
                watcher.end(abrupt)
                dropped += 1
            self._watchers[key] = set()
        return dropped

    def send_bookmarks(self) -> int:
        """A BOOKMARK now on every watch that allowed them (the API sends one about a minute)."""
        watchers = [w for ws in self._watchers.values() for w in ws if w.bookmarks]
        for watcher in watchers:
            watcher.bookmark(self._rv)
        return len(watchers)

    def compact(self) -> str:
        """Forget all history, as etcd compaction does: a watch from any older resourceVersion
        now gets 410 Expired and the client must list again."""
        for history in self._history.values():
            history.compact(self._rv)
        return str(self._rv)

    # -- faults --

    def inject_fault(
        self,
        verb: str | None = None,
        resource: str | None = None,
        status: int | None = 500,
        hang: float = 0.0,
        times: int | None = 1,
        retry_after: int = 1,
        message: str = "",
    ) -> Fault:
        """See `Fault`. `resource` is a key such as `pods`, `pods/status` or `leases`."""
        fault = Fault(verb, resource, status, hang, times, retry_after, message)
        self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        self.faults.clear()

    def take_fault(self, verb: str, rt: ResourceType, subresource: str | None) -> Fault | None:
        suffix = f"/{subresource}" if subresource else ""
        names = {rt.key + suffix, rt.plural + suffix}
        for fault in self.faults:
            if fault.applies(verb, names):
                fault.hits += 1
                if fault.times is not None and fault.hits >= fault.times:
                    self.faults.remove(fault)
                return fault
        return None

    # -- helpers --

    @staticmethod
    def _ns(rt: ResourceType, namespace: str | None) -> str:
        return (namespace or "") if rt.namespaced else ""

    def _checked_body(self, rt: ResourceType, namespace: str, body: Any) -> Obj:
        if not isinstance(body, dict):
            raise bad_request(f"the body must be a JSON object describing a {rt.kind}")
        for key, expected in (("apiVersion", rt.api_version), ("kind", rt.kind)):
            if body.get(key) not in (None, "", expected):
                raise bad_request(
                    f"the {key} in the data ({body[key]}) does not match the expected {key} "
                    f"({expected})"
                )
        body.update(apiVersion=rt.api_version, kind=rt.kind)
        meta = body.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        if rt.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise bad_request(
                    "the namespace of the provided object does not match the "
                    "namespace sent on the request"
                )
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        return body

    def _require_namespace(self, rt: ResourceType, namespace: str) -> None:
        if not rt.namespaced:
            return
        ns = self._objects["namespaces"].get(("", namespace))
        if ns is None:
            raise not_found(self._types["namespaces"], namespace)
        if "deletionTimestamp" in ns["metadata"]:
            raise ApiError(
                403,
                f"unable to create new content in namespace {namespace} because "
                "it is being terminated",
            )

    def _generated_name(self, rt: ResourceType, namespace: str, meta: Obj) -> str:
        prefix = meta.get("generateName")
        if not prefix:
            raise invalid(
                rt, "", [("metadata.name", "Required value", "name or generateName is required")]
            )
        alphabet = "bcdfghjklmnpqrstvwxz2456789"  # the API's: no vowels, no look-alikes
        while True:
            name = prefix + "".join(self._random.choice(alphabet) for _ in range(5))
            if (namespace, name) not in self._objects[rt.key]:
                return name

    def _uid(self) -> str:
        return str(uuid.UUID(int=self._random.getrandbits(128), version=4))

    def _allocate_ip(self) -> str:
        self._ips += 1
        return f"10.96.{self._ips // 250}.{self._ips % 250 + 1}"


def _owned(body: Any) -> Any:
    return patches.clone(body) if isinstance(body, dict) else body


def _sort_key(obj: Obj) -> tuple[str, str]:
    meta = obj["metadata"]
    return meta.get("namespace", ""), meta["name"]


def _encode_continue(key: tuple[str, str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode()


def _decode_continue(token: str) -> tuple[str, str]:
    try:
        namespace, name = json.loads(base64.urlsafe_b64decode(token.encode()))
    except (ValueError, binascii.Error, TypeError):
        raise bad_request("continue key is not valid") from None
    return str(namespace), str(name)


def _parse_rv(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ApiError(
            400, f"resourceVersion: Invalid value: {text!r}: must be an integer"
        ) from None


__all__ = ["ApiError", "ApiStore", "Change", "DeletionRecord", "Fault", "RequestRecord", "Watcher"]
