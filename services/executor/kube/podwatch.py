"""The pods of the gangs this executor manages, listed then watched from the list's
resourceVersion (a 410 Gone lists again, a cut stream is watched again from the last version
seen), judged gang by gang (status.py) and reported to the executor when a run changes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.watch import Watch

from services.executor.backend import Action, ReportKind, RunReport, Teardown
from services.executor.kube import names
from services.executor.kube.names import gang_selector
from services.executor.kube.status import GangPhase, gang_state
from services.executor.store import RunKey, RunningJob

log = structlog.get_logger()

Obj = dict[str, Any]
Sink = Callable[[list[RunReport]], Awaitable[list[RunReport]]]
_REPORTED = {
    GangPhase.RUNNING: ReportKind.RUNNING,
    GangPhase.SUCCEEDED: ReportKind.SUCCEEDED,
    GangPhase.FAILED: ReportKind.FAILED,
    GangPhase.REFUSED: ReportKind.REFUSED,
    GangPhase.LOST: ReportKind.LOST,
}
_PHASES = {kind: phase for phase, kind in _REPORTED.items()}
OVER = frozenset({GangPhase.SUCCEEDED, GangPhase.FAILED, GangPhase.REFUSED, GangPhase.LOST})


@dataclass(frozen=True)
class Ungate:
    """Take the gate off a pod found gated after a restart (its whole gang exists)."""

    pod: str


@dataclass
class Gang:
    """One attempt of a job on the cluster, as far as its pods show it."""

    replicas: int
    pods: dict[str, Obj] = field(default_factory=dict)
    complete: bool = False  # every pod was created (a missing one is lost, not to come)
    reported: GangPhase = GangPhase.PENDING
    grace_s: int | None = None
    complete_at: int = 0  # the resourceVersion by which every pod existed (0: known by a list)


def _key(pod: Obj) -> RunKey | None:
    meta = pod.get("metadata") or {}
    job = (meta.get("annotations") or {}).get(names.JOB)
    attempt = (meta.get("labels") or {}).get(names.ATTEMPT)
    if job is None or attempt is None or not attempt.isdigit():
        return None
    return (job, int(attempt))


def _replicas(pod: Obj) -> int:
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(names.REPLICAS, "1")
    return int(raw) if raw.isdigit() else 1


def version_number(version: str | None) -> int:
    """A resourceVersion as a number, to compare (etcd's are; 0 if not)."""
    return int(version) if version and version.isdigit() else 0


def _grace(pod: Obj) -> int | None:
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(names.GRACE)
    return int(raw) if raw is not None and raw.isdigit() else None


class PodWatch:
    def __init__(
        self,
        core: Any,
        namespace: str,
        cluster: str,
        unschedulable_after_s: float,
        enqueue: Callable[[Action | Ungate], None],
        clock: Callable[[], datetime],
    ) -> None:
        self.core = core
        self.namespace = namespace
        self.selector = gang_selector(cluster)
        self.unschedulable_after_s = unschedulable_after_s
        self.enqueue = enqueue
        self.clock = clock
        self.gangs: dict[RunKey, Gang] = {}
        self.listed = asyncio.Event()  # the first list is in: adoption is done
        self.lists = 0  # how many times the pods were (re-)listed
        self.version = 0  # the newest resourceVersion listed or watched
        self.sink: Sink | None = None
        self._expected: dict[RunKey, int] | None = None
        self._judging = asyncio.Lock()

    def expect(self, runs: Sequence[RunningJob]) -> None:
        """The runs the executor's store holds (after a restart): their pods are adopted by the
        first list; a run without its whole gang there is reported lost."""
        self._expected = {r.key: len(r.replicas) for r in runs}

    async def list_pods(self, selector: str) -> Obj:
        response = await self.core.list_namespaced_pod(
            self.namespace, label_selector=selector, _preload_content=False
        )
        listed: Obj = json.loads(await response.read())
        return listed

    async def watch_forever(self) -> None:
        while True:
            try:
                version = await self._relist()
                await self._watch(version)
            except asyncio.CancelledError:
                raise
            except ApiException as error:
                if error.status != 410:
                    log.warning("pod watch failed; listing again", status=error.status)
                    await asyncio.sleep(1.0)
            except Exception as error:
                log.warning("pod watch failed; listing again", error=str(error))
                await asyncio.sleep(1.0)

    async def _relist(self) -> str:
        """Every pod of this executor, as the cluster has them now; judge every gang."""
        listed = await self.list_pods(self.selector)
        seen: dict[RunKey, dict[str, Obj]] = {}
        for pod in listed.get("items") or []:
            key = _key(pod)
            if key is not None:
                seen.setdefault(key, {})[pod["metadata"]["name"]] = pod
                gang = self.gangs.setdefault(key, Gang(_replicas(pod)))
                gang.grace_s = _grace(pod)
        for key, gang in self.gangs.items():
            gang.pods = seen.get(key, {})
        self.version = version_number((listed.get("metadata") or {}).get("resourceVersion"))
        if self._expected is not None and not self.listed.is_set():
            self._adopted(self._expected, seen)
        self.lists += 1
        await self._judge(list(self.gangs))
        self.listed.set()
        return str((listed.get("metadata") or {}).get("resourceVersion", ""))

    def _adopted(self, expected: dict[RunKey, int], seen: dict[RunKey, dict[str, Obj]]) -> None:
        """After a restart: a gang found whole is watched on (and ungated, if a crash came
        between creating and ungating); a run of the store without its whole gang is lost
        (reported by the judging that follows); pods of no run in the store (a refused or
        stale epoch's, a run ended while the executor was away) are deleted."""
        for key, replicas in expected.items():
            gang = self.gangs.setdefault(key, Gang(replicas))
            gang.complete = True
            if len(seen.get(key, {})) == replicas:
                for name, pod in seen[key].items():
                    if (pod.get("spec") or {}).get("schedulingGates"):
                        self.enqueue(Ungate(name))
        for key in seen:
            gang = self.gangs[key]
            gang.complete = True
            if key not in expected:
                log.info("removing pods of no run here", job_id=key[0], attempt=key[1])
                gang.reported = GangPhase.LOST
                self.enqueue(Teardown(key, "not_ours", grace_s=0))

    async def _watch(self, version: str) -> None:
        """Watch from `version`; a cut stream is watched again from the last version seen, a
        410 Gone goes back to listing (the caller)."""
        while True:
            watch = Watch()
            try:
                async for event in watch.stream(
                    self.core.list_namespaced_pod,
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=version,
                    allow_watch_bookmarks=True,
                ):
                    raw = event.get("raw_object") or {}
                    version = str(raw.get("metadata", {}).get("resourceVersion") or version)
                    self.version = max(self.version, version_number(version))
                    await self._seen(event.get("type", ""), raw)
            except aiohttp.ClientPayloadError:
                log.info("pod watch cut; watching again", resource_version=version)
            finally:
                await watch.close()

    async def _seen(self, kind: str, pod: Obj) -> None:
        key = _key(pod)
        if kind not in ("ADDED", "MODIFIED", "DELETED") or key is None:
            return
        gang = self.gangs.setdefault(key, Gang(_replicas(pod)))
        gang.grace_s = _grace(pod)
        name = pod["metadata"]["name"]
        if kind == "DELETED":
            gang.pods.pop(name, None)
        else:
            gang.pods[name] = pod
        await self._judge([key])

    async def sweep_forever(self) -> None:
        """Pods stay unschedulable without any event: judge pending gangs now and then (and
        forget gangs that are over and have no pod left)."""
        every = min(max(self.unschedulable_after_s / 4, 0.2), 5.0)
        while True:
            await asyncio.sleep(every)
            keys = [
                k for k, g in self.gangs.items() if g.reported is GangPhase.PENDING or not g.pods
            ]
            await self._judge(keys)

    async def _judge(self, keys: list[RunKey]) -> None:
        """Report the gangs whose run changed. A gang counts as reported only once the
        executor took the report: if it failed, the next list judges it again."""
        async with self._judging:  # the watch and the sweep both judge
            reported = await self.report(self._changed(keys))
        for r in reported:
            gang = self.gangs.get(r.key)
            if gang is not None and gang.reported not in OVER:
                gang.reported = _PHASES[r.kind]

    def _changed(self, keys: list[RunKey]) -> list[RunReport]:
        reports = []
        now = self.clock()
        for key in keys:
            gang = self.gangs.get(key)
            if gang is None:
                continue
            if not gang.pods and gang.reported in OVER:
                del self.gangs[key]  # over and gone
                continue
            if gang.reported in OVER:
                continue
            state = gang_state(
                list(gang.pods.values()),
                gang.replicas,
                now=now,
                unschedulable_after_s=self.unschedulable_after_s,
                complete=gang.complete and self.version >= gang.complete_at,
            )
            if state.phase is GangPhase.PENDING or state.phase is gang.reported:
                continue
            failure = state.failure
            reports.append(
                RunReport(
                    key[0],
                    key[1],
                    _REPORTED[state.phase],
                    failure.reason_code if failure else None,
                    failure.message if failure else "",
                    failure.exit_code if failure else None,
                    state.nodes,
                )
            )
        return reports

    async def report(self, reports: list[RunReport]) -> list[RunReport]:
        """Hand reports to the executor; the ones it took."""
        if not reports or self.sink is None:
            return []
        for stray in await self.sink(reports):
            # No run of the executor's: a stale or refused epoch's pods, or a run it ended.
            log.info("removing pods of no run here", job_id=stray.job_id, attempt=stray.attempt)
            self.enqueue(Teardown(stray.key, "not_ours", grace_s=0))
            gang = self.gangs.get(stray.key)
            if gang is not None:
                gang.reported = GangPhase.LOST
        return reports
