"""The `kubernetes` backend: carries out the executor's decisions on a cluster through
kubernetes-asyncio — a placement becomes a gang of gated pods and a headless Service, stops
delete them with the granted grace, checkpoints and quarantines are annotations and taints —
and reports what the pods do through its PodWatch (podwatch.py). The decisions stay in
handlers.py; this module only acts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio.client import ApiClient, CoreV1Api, PolicyV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from schemas.events import PlacementDecided
from services.executor.backend import (
    Action,
    Launch,
    Quarantine,
    Release,
    ReportKind,
    RunReport,
    SignalCheckpoint,
    Teardown,
    open_run,
)
from services.executor.kube import names
from services.executor.kube.names import GangNames, gang_selector
from services.executor.kube.pods import (
    PodOptions,
    build_disruption_budget,
    build_pod,
    build_service,
)
from services.executor.kube.podwatch import OVER, Gang, PodWatch, Sink, Ungate, version_number
from services.executor.kube.status import GangPhase
from services.executor.store import RunKey, RunningJob

log = structlog.get_logger()

# A run failure that ends the job: running it again would fail the same way.
INVALID_POD = "invalid_pod"

Obj = dict[str, Any]


class Permanent(Exception):
    """The API refused a request in a way retrying will not change (its status says why)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class KubeOptions:
    pods: PodOptions
    unschedulable_after_s: float = 120.0
    retry_for_s: float = 60.0
    quarantine_taint: str = ""


class KubeBackend:
    def __init__(
        self,
        api: ApiClient,
        options: KubeOptions,
        hostnames: Callable[[str], str] = lambda node_id: node_id,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        pinned: Callable[[str], Mapping[str, str]] = lambda node_id: {},
    ) -> None:
        self.api = api
        self.policy: Any = PolicyV1Api(api)
        self.pinned = pinned
        # Bodies go as plain dicts and lists come back raw: typed as Any on purpose.
        self.core: Any = CoreV1Api(api)
        self.options = options
        self.namespace = options.pods.namespace
        self.hostnames = hostnames
        self.actions: asyncio.Queue[Action | Ungate] = asyncio.Queue()
        self.watch = PodWatch(
            self.core,
            self.namespace,
            options.pods.cluster,
            options.unschedulable_after_s,
            self.actions.put_nowait,
            clock,
        )
        self.gangs = self.watch.gangs

    # --- the executor's side of the seam ---

    def begin(self, p: PlacementDecided, now: datetime) -> RunningJob:
        self.gangs.setdefault((p.job_id, p.attempt), Gang(len(p.replicas)))
        return open_run(p, now)

    async def act(self, actions: Sequence[Action]) -> None:
        for action in actions:
            self.actions.put_nowait(action)

    def adopt(self, runs: Sequence[RunningJob]) -> None:
        """The runs the executor's store holds (after a restart): their pods are adopted by the
        first list; a run without its whole gang there is reported lost."""
        self.watch.expect(runs)

    async def run(self, sink: Sink) -> None:
        """Act and watch until cancelled; reports go to `sink` (Executor.report), which answers
        the reports naming no run it knows (their pods are removed)."""
        self.watch.sink = sink
        async with asyncio.TaskGroup() as group:
            group.create_task(self._act_forever())
            group.create_task(self.watch.watch_forever())
            group.create_task(self.watch.sweep_forever())

    # --- acting ---

    async def _act_forever(self) -> None:
        while True:
            action = await self.actions.get()
            try:
                await self._retrying(action)
            except Permanent as error:
                if isinstance(action, Launch):
                    await self.watch.report([_refusal(action.placement, error)])
            except Exception as error:  # retries exhausted: the cluster stays unreachable
                log.error("kubernetes action failed", action=repr(action), error=str(error))
                if isinstance(action, Launch):
                    p = action.placement
                    await self.watch.report(
                        [
                            RunReport(
                                p.job_id,
                                p.attempt,
                                ReportKind.REFUSED,
                                "cluster_api_error",
                                f"the cluster's API kept failing: {error}",
                            )
                        ]
                    )
            finally:
                self.actions.task_done()

    async def _retrying(self, action: Action | Ungate) -> None:
        deadline = time.monotonic() + self.options.retry_for_s
        delay = 0.1
        while True:
            try:
                await self._apply(action)
                return
            except ApiException as error:
                if error.status in (400, 403, 415, 422):
                    raise Permanent(error.status, _reason(error)) from error
                if time.monotonic() + delay > deadline:
                    raise
            except (aiohttp.ClientError, TimeoutError):
                if time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _apply(self, action: Action | Ungate) -> None:
        if isinstance(action, Ungate):
            await self._ungate(action.pod)
        elif isinstance(action, Launch):
            await self._launch(action.placement)
        elif isinstance(action, Teardown):
            await self._teardown(action)
        elif isinstance(action, SignalCheckpoint):
            await self._signal(action)
        elif isinstance(action, Quarantine):
            await self._quarantine(action)
        elif isinstance(action, Release):
            await self._release(action)

    async def _launch(self, p: PlacementDecided) -> None:
        """The Service, every pod behind the gang's gate, then the gates off: the gang starts
        together. Each object may exist already (a retry, a redelivery): 409 is fine."""
        options = self.options.pods
        gang = self.gangs.setdefault((p.job_id, p.attempt), Gang(len(p.replicas)))
        await created(
            self.core.create_namespaced_service(self.namespace, build_service(p, options))
        )
        if options.gang_disruption_budget:
            await self._protect(p)
        for r in sorted(p.replicas, key=lambda r: r.replica):
            pod = build_pod(p, r, self.hostnames(r.node_id), options, self.pinned(r.node_id))
            await created(self.core.create_namespaced_pod(self.namespace, pod))
        versions = [
            await self._ungate(GangNames(p.job_id, p.attempt).pod(r.replica)) for r in p.replicas
        ]
        # Complete once the watch has seen that far: a list answered before the creates must
        # not find the gang's pods "lost".
        gang.complete_at = max(versions, default=0)
        gang.complete = True
        log.info("gang created", job_id=p.job_id, attempt=p.attempt, replicas=len(p.replicas))

    async def _protect(self, p: PlacementDecided) -> None:
        """The gang's disruption budget. A protection, not a condition of running: a cluster
        whose role does not grant it (403) or that refuses it runs the gang without one."""
        budget = build_disruption_budget(p, self.options.pods)
        try:
            await created(
                self.policy.create_namespaced_pod_disruption_budget(self.namespace, budget)
            )
        except ApiException as error:
            if error.status >= 500 or error.status == 429:
                raise  # retried with the launch
            log.warning(
                "gang runs without a disruption budget",
                job_id=p.job_id,
                attempt=p.attempt,
                status=error.status,
                reason=_reason(error),
            )

    async def _ungate(self, pod: str) -> int:
        """Lift the gang's gate from `pod`; the resourceVersion the pod has then."""
        patched = await self.core.patch_namespaced_pod(
            pod,
            self.namespace,
            {"spec": {"schedulingGates": None}},
            _content_type="application/merge-patch+json",
        )
        return version_number(patched.metadata.resource_version)

    async def _teardown(self, t: Teardown) -> None:
        job_id, attempt = t.key
        gang = self.gangs.get(t.key)
        grace = t.grace_s if t.grace_s is not None else (gang.grace_s if gang else None)
        if gang is not None:
            gang.reported = GangPhase.LOST if gang.reported not in OVER else gang.reported
            gang.complete = True
        # One delete per pod (the executor's role grants `delete`, not `deletecollection`): the
        # pods the selector finds, and every name the gang would have (one may be on its way).
        listed = await self.watch.list_pods(gang_selector(self.options.pods.cluster, *t.key))
        doomed = {p["metadata"]["name"] for p in listed.get("items") or []}
        if gang is not None:
            doomed |= {GangNames(job_id, attempt).pod(i) for i in range(gang.replicas)}
        kwargs: Obj = {} if grace is None else {"grace_period_seconds": grace}
        for name in sorted(doomed):
            try:
                await self.core.delete_namespaced_pod(name, self.namespace, **kwargs)
            except ApiException as error:
                if error.status != 404:
                    raise
        with contextlib.suppress(ApiException):
            await self.core.delete_namespaced_service(
                GangNames(job_id, attempt).service, self.namespace
            )
        # Whether budgets are on now or not: one may be left from when they were.
        with contextlib.suppress(ApiException):
            await self.policy.delete_namespaced_pod_disruption_budget(
                GangNames(job_id, attempt).service, self.namespace
            )
        log.info("gang deleted", job_id=job_id, attempt=attempt, reason=t.reason, grace_s=grace)

    async def _signal(self, s: SignalCheckpoint) -> None:
        """The workload sees the request in its annotations (downward API file)."""
        body = {
            "metadata": {
                "annotations": {
                    names.CHECKPOINT: s.at.isoformat(),
                    names.CHECKPOINT_STOP_AT: s.stop_at.isoformat(),
                }
            }
        }
        for name in await self._pod_names(s.key):
            with contextlib.suppress(ApiException):
                await self.core.patch_namespaced_pod(name, self.namespace, body)

    async def _quarantine(self, q: Quarantine) -> None:
        """Cordon and taint the node, so the cluster's own scheduler keeps off it too."""
        key = self.options.quarantine_taint
        if not key:
            return
        node = json.loads(
            await (await self.core.read_node(q.node_id, _preload_content=False)).read()
        )
        taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") != key]
        taints.append({"key": key, "value": names.label_value(q.cause), "effect": "NoSchedule"})
        await self.core.patch_node(q.node_id, {"spec": {"unschedulable": True, "taints": taints}})

    async def _release(self, r: Release) -> None:
        """Take our taint off and uncordon the node, if the quarantine put them there."""
        key = self.options.quarantine_taint
        if not key:
            return
        response = await self.core.read_node(r.node_id, _preload_content=False)
        node = json.loads(await response.read())
        taints = (node.get("spec") or {}).get("taints") or []
        kept = [t for t in taints if t.get("key") != key]
        if len(kept) == len(taints):
            return  # not quarantined by us: an operator's cordon stays
        await self.core.patch_node(r.node_id, {"spec": {"unschedulable": None, "taints": kept}})

    async def _pod_names(self, key: RunKey) -> list[str]:
        gang = self.gangs.get(key)
        if gang is not None and gang.pods:
            return sorted(gang.pods)
        listed = await self.watch.list_pods(gang_selector(self.options.pods.cluster, *key))
        return sorted(p["metadata"]["name"] for p in listed["items"])


def _refusal(p: PlacementDecided, error: Permanent) -> RunReport:
    """A launch the API answered with a final no. Invalid (422: no image, a bad command): the
    job as specified can never run here, so it fails with the API's words instead of being
    placed and refused again and again. Forbidden (403: a full ResourceQuota, a PodSecurity
    or admission rule, a PriorityClass the cluster lacks) or otherwise rejected: the
    cluster's or its operator's doing, so the placement is refused back to the scheduler."""
    if error.status == 422:
        message = f"the cluster's API refused the job's pod as invalid: {error}"
        return RunReport(p.job_id, p.attempt, ReportKind.FAILED, INVALID_POD, message)
    code = "cluster_forbidden" if error.status == 403 else "cluster_rejected"
    message = f"the cluster's API refused the gang (HTTP {error.status}): {error}"
    return RunReport(p.job_id, p.attempt, ReportKind.REFUSED, code, message)


def _reason(error: ApiException) -> str:
    try:
        return str(json.loads(error.body or b"{}").get("message") or error.reason)
    except (TypeError, ValueError):
        return str(error.reason)


async def created(call: Awaitable[Any]) -> Any:
    """What a create answered; None if the object was there already (409: an earlier try)."""
    try:
        return await call
    except ApiException as error:
        if error.status != 409:
            raise
        return None
