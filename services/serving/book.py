"""The serving service's books: every inference service (its desired state, rollout and
scale) and every replica job it made, kept from the log and driven by `core.serving`.

No I/O here: the app feeds it what arrives (declarations, commands, replica reports, the
lifecycle of replica jobs) and asks it, each round, what to do (`Book.round`): replica jobs to
submit, replicas to stop, statuses to publish. Times are wall seconds (epoch), passed in.

A replica is one job of kind `inference_service` with one replica. The first `min_replicas`
live replicas of a service are guaranteed (not preemptible, the service's priority class, so
the scheduler preempts batch work for them and never preempts them for batch work); replicas
above the minimum, added for load, are preemptible. A replica lost to a node failure is
requeued by the queue like any job and placed elsewhere; one that fails or is cancelled is
replaced by a new one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from core.serving import (
    LoadReport,
    Replica,
    ReplicaState,
    RolloutPhase,
    RolloutSpec,
    ScalingSpec,
    desired_replicas,
    rollout_step,
)
from schemas.job import JobSpec
from schemas.serving import (
    Endpoint,
    ReplicaReported,
    ReplicaView,
    ServiceAction,
    ServiceCommand,
    ServicePhase,
    ServiceSpec,
    ServiceStatus,
)

# Load reports are kept this much longer than the longest window that reads them.
REPORTS_SLACK_S = 60.0
MAX_REPORTS = 50_000  # per service: a flood of reports cannot grow memory without bound
# A failed replica is remembered this long when no rollout needs it (for the status).
FAILED_KEPT_S = 600.0
# After replicas fail one after another, a replacement waits 2, 4, 8 ... s (wall), up to this:
# a version that cannot start (or a spec the queue refuses) is not resubmitted every second.
BACKOFF_MAX_S = 300.0


def replica_job_id(service: str, n: int) -> str:
    return f"svc-{service}-{n}"


@dataclass
class ReplicaRecord:
    job_id: str
    service: str
    version: str
    guaranteed: bool
    state: ReplicaState
    since: float
    cluster: str | None = None
    node: str | None = None
    address: str | None = None
    latency_ms: float | None = None
    attempt: int = 0
    # A stop was sent: it no longer counts, and goes once its job ends.
    stopping: bool = False

    @property
    def live(self) -> bool:
        return not self.stopping and self.state is not ReplicaState.FAILED

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "state": self.state.value}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ReplicaRecord:
        return cls(**{**doc, "state": ReplicaState(doc["state"])})


@dataclass
class ServiceRecord:
    spec: ServiceSpec
    desired: int
    last_change_at: float
    # The template replicas ran before the current one (for a roll-back or `undo`).
    previous: ServiceSpec | None = None
    rollout_from: str | None = None
    rollout_started_at: float | None = None
    rolling_back: bool = False
    paused: bool = False
    deleted: bool = False
    seq: int = 0
    revision: int = 0
    change: str = "declared"
    reason: str = ""
    # Replicas failed since one was last ready, and no replacement before `retry_at`.
    failures: int = 0
    retry_at: float = 0.0
    last_failed_at: float = 0.0
    # What the last published status held (not the time): publish only on change.
    published: str = ""

    @property
    def name(self) -> str:
        return self.spec.name

    def to_json(self) -> dict[str, Any]:
        doc = dict(self.__dict__)
        doc["spec"] = self.spec.model_dump(mode="json")
        doc["previous"] = self.previous.model_dump(mode="json") if self.previous else None
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ServiceRecord:
        previous = doc.get("previous")
        return cls(
            **{
                **doc,
                "spec": ServiceSpec.model_validate(doc["spec"]),
                "previous": ServiceSpec.model_validate(previous) if previous else None,
            }
        )


@dataclass
class RoundOut:
    submit: list[JobSpec] = field(default_factory=list)
    stop: list[tuple[str, str, str]] = field(default_factory=list)  # job, tenant, reason
    statuses: list[ServiceStatus] = field(default_factory=list)
    changed_services: set[str] = field(default_factory=set)
    changed_replicas: set[str] = field(default_factory=set)
    dropped_replicas: set[str] = field(default_factory=set)


class Refused(ValueError):
    """A declaration or command that cannot apply; the reason is published in the status."""


class Book:
    """`time_scale`: fleet seconds per wall second. A spec's durations (scale-down window,
    ready timeout) are fleet seconds, like every duration in a spec; the book runs on the
    wall clock and divides them."""

    def __init__(self, time_scale: float = 1.0, silent_after_s: float = 20.0) -> None:
        self.time_scale = time_scale
        self.silent_after_s = silent_after_s
        self.services: dict[str, ServiceRecord] = {}
        self.replicas: dict[str, ReplicaRecord] = {}
        self.reports: dict[str, deque[LoadReport]] = {}
        # What changed outside a round (handlers), to persist with the next write.
        self.dirty_services: set[str] = set()
        self.dirty_replicas: set[str] = set()
        self.dropped: set[str] = set()
        # When each running replica's agent last reported it (memory only: after a restart
        # every replica counts as heard at the restart).
        self.heard: dict[str, float] = {}
        self.since_start: float | None = None

    # What arrives ---------------------------------------------------------------------------

    def declare(self, spec: ServiceSpec, now: float) -> None:
        """A service's desired state from now on. Raises Refused (with the reason) when the
        name is another tenant's, or the template changes and the version does not."""
        rec = self.services.get(spec.name)
        if rec is None or rec.deleted:
            seq = rec.seq if rec is not None else 0
            self.services[spec.name] = ServiceRecord(
                spec=spec,
                desired=spec.min_replicas,
                last_change_at=now,
                seq=seq,
                revision=(rec.revision + 1) if rec is not None else 1,
                change="declared",
                reason=f"{spec.model} {spec.version}: {spec.min_replicas} to "
                f"{spec.max_replicas} replica(s)",
            )
            self.dirty_services.add(spec.name)
            return
        if rec.spec.tenant != spec.tenant:
            raise Refused(f"the service name {spec.name!r} is taken by another tenant")
        old = rec.spec
        if old.template_differs(spec) and old.version == spec.version:
            raise Refused(
                f"the replicas' template changed but the version is still {spec.version!r}; "
                "declare it with a new version to roll it out"
            )
        if old == spec:
            return
        rec.revision += 1
        if old.version != spec.version:
            # The version to come back to is the last one known good: what runs when steady,
            # or what a roll-back (or undo) is returning to; not a version being rolled out.
            if rec.rollout_from is None or rec.rolling_back:
                rec.previous = old
            rec.rollout_from = old.version
            rec.rollout_started_at = now
            rec.rolling_back = False
            rec.change = "rollout_started"
            rec.reason = f"rolling out {spec.version} in place of {old.version}"
        else:
            rec.change = "declared"
            rec.reason = f"{spec.min_replicas} to {spec.max_replicas} replica(s)"
        rec.spec = spec
        clamped = min(max(rec.desired, spec.min_replicas), spec.max_replicas)
        if clamped != rec.desired:
            rec.desired, rec.last_change_at = clamped, now
        self.dirty_services.add(spec.name)

    def command(self, cmd: ServiceCommand, now: float) -> None:
        rec = self.services.get(cmd.service)
        if rec is None or rec.deleted or rec.spec.tenant != cmd.tenant:
            raise Refused(f"no service {cmd.service!r} of tenant {cmd.tenant!r}")
        spec = rec.spec
        if cmd.action is ServiceAction.SCALE:
            low = cmd.min_replicas if cmd.min_replicas is not None else spec.min_replicas
            high = cmd.max_replicas if cmd.max_replicas is not None else spec.max_replicas
            if low > high:
                raise Refused(f"min_replicas {low} is above max_replicas {high}")
            rec.spec = spec.model_copy(update={"min_replicas": low, "max_replicas": high})
            if rec.previous is not None:
                rec.previous = rec.previous.model_copy(
                    update={"min_replicas": low, "max_replicas": high}
                )
            clamped = min(max(rec.desired, low), high)
            if clamped != rec.desired:
                rec.desired, rec.last_change_at = clamped, now
            rec.change, rec.reason = "scaled", f"{low} to {high} replica(s), by {cmd.requested_by}"
        elif cmd.action is ServiceAction.PAUSE:
            if rec.rollout_from is None:
                raise Refused("no rollout in progress to pause")
            rec.paused = True
            rec.change, rec.reason = "rollout_paused", f"paused by {cmd.requested_by}"
        elif cmd.action is ServiceAction.RESUME:
            rec.paused = False
            rec.change, rec.reason = "rollout_resumed", f"resumed by {cmd.requested_by}"
        elif cmd.action is ServiceAction.UNDO:
            if rec.previous is None:
                raise Refused("no previous version to go back to")
            self._reverse(rec, now, f"undone by {cmd.requested_by}", back=True)
            rec.change = "rollout_undone"
        elif cmd.action is ServiceAction.DELETE:
            rec.deleted = True
            rec.change, rec.reason = "deleted", f"deleted by {cmd.requested_by}"
        rec.revision += 1
        self.dirty_services.add(rec.name)

    def _reverse(self, rec: ServiceRecord, now: float, reason: str, *, back: bool) -> None:
        """Roll to the previous template (a roll-back, or `undo`): the same rolling update
        the other way; the template left becomes the previous one."""
        assert rec.previous is not None
        left = rec.spec
        counts = {"min_replicas": left.min_replicas, "max_replicas": left.max_replicas}
        rec.spec = rec.previous.model_copy(update=counts)
        rec.previous = left
        rec.rollout_from = left.version
        rec.rollout_started_at = now
        rec.rolling_back = back
        rec.paused = False
        rec.reason = reason

    def report(self, r: ReplicaReported, at: float, now: float) -> None:
        """A replica's agent says it runs (not ready yet, or ready, and where), and/or the load
        it served. A report of an earlier attempt (a run since handed back) is ignored."""
        rep = self.replicas.get(r.replica)
        if rep is None or rep.service != r.service:
            return  # not a replica of this service (or one long gone): nothing to learn
        stale = r.attempt is not None and r.attempt < rep.attempt
        if r.ready is not None and rep.live and not stale:
            self.heard[rep.job_id] = now
            before = (rep.state, rep.address, rep.cluster, rep.node, rep.attempt)
            if r.attempt is not None:
                rep.attempt = r.attempt
            if r.ready and rep.state is not ReplicaState.READY:
                rep.state, rep.since = ReplicaState.READY, now
                rec = self.services.get(rep.service)
                if rec is not None and rec.failures:
                    rec.failures, rec.retry_at = 0, 0.0
                    self.dirty_services.add(rec.name)
            elif not r.ready and rep.state is not ReplicaState.STARTING:
                rep.state, rep.since = ReplicaState.STARTING, now
            rep.address = r.address or rep.address
            rep.cluster = r.cluster or rep.cluster
            rep.node = r.node or rep.node
            if (rep.state, rep.address, rep.cluster, rep.node, rep.attempt) != before:
                self.dirty_replicas.add(rep.job_id)
        if r.rps is not None and r.latency_ms is not None and not stale:
            rep.latency_ms = r.latency_ms
            queue = self.reports.setdefault(r.service, deque(maxlen=MAX_REPORTS))
            queue.append(LoadReport(r.replica, min(at, now), r.rps, r.latency_ms))

    def preempted(self, job_id: str, attempt: int, now: float) -> None:
        """Its node failed or a higher claim took it: the queue requeues it; it waits again."""
        rep = self.replicas.get(job_id)
        if rep is None or attempt < rep.attempt or not rep.live:
            return
        rep.attempt = attempt + 1
        rep.state, rep.since = ReplicaState.PENDING, now
        rep.address = rep.cluster = rep.node = None
        self.dirty_replicas.add(job_id)

    def ended(
        self, job_id: str, failed: bool, now: float, why: str = "", attempt: int | None = None
    ) -> None:
        """The job ended: a failure is remembered (a rollout judges it; replacements back
        off), anything else goes. The end of an earlier attempt (one since requeued) is not
        this run's."""
        rep = self.replicas.get(job_id)
        if rep is None or (attempt is not None and attempt < rep.attempt):
            return
        if failed and not rep.stopping:
            if rep.state is not ReplicaState.FAILED:
                rec = self.services.get(rep.service)
                if rec is not None:
                    # Replicas failing together (a node, an outage) count once.
                    if now - rec.last_failed_at >= 1.0:
                        rec.failures += 1
                    rec.last_failed_at = now
                    rec.retry_at = now + min(2.0 ** min(rec.failures, 16), BACKOFF_MAX_S)
                    rec.change = "replica_failed"
                    rec.reason = f"replica {job_id} of {rep.version} failed" + (
                        f": {why}" if why else ""
                    )
                    rec.revision += 1
                    self.dirty_services.add(rec.name)
            rep.state, rep.since = ReplicaState.FAILED, now
            rep.address = None
            self.dirty_replicas.add(job_id)
            return
        del self.replicas[job_id]
        self.heard.pop(job_id, None)
        self.dropped.add(job_id)
        self.dirty_replicas.discard(job_id)

    # Each round -------------------------------------------------------------------------------

    def round(self, now: float) -> RoundOut:
        out = RoundOut()
        self._silent(out, now)
        by_service: dict[str, list[ReplicaRecord]] = {}
        for rep in self.replicas.values():
            by_service.setdefault(rep.service, []).append(rep)
        for name, rec in self.services.items():
            mine = by_service.get(name, [])
            before = (rec.revision, len(out.submit), len(out.stop))
            first_new = len(out.submit)
            if rec.deleted:
                self._stop(out, rec, [r for r in mine if not r.stopping], "service deleted")
            else:
                self._scale(rec, mine, now)
                if rec.rollout_from is not None:
                    self._roll(out, rec, mine, now)
                else:
                    self._steady(out, rec, mine, now)
                self._forget_failures(out, rec, mine, now)
            if (rec.revision, len(out.submit), len(out.stop)) != before:
                out.changed_services.add(name)
            members = {r.job_id for r in mine} | {j.job_id or "" for j in out.submit[first_new:]}
            status = self.status(rec, [self.replicas[j] for j in members if j in self.replicas])
            key = status.model_dump_json(exclude={"reason", "change", "revision"})
            if key != rec.published or name in self.dirty_services:
                rec.published = key
                out.statuses.append(status)
                out.changed_services.add(name)
        self._trim_reports(now)
        out.changed_services |= self.dirty_services
        out.changed_replicas |= self.dirty_replicas
        out.dropped_replicas |= self.dropped
        self.dirty_services, self.dirty_replicas, self.dropped = set(), set(), set()
        return out

    def _silent(self, out: RoundOut, now: float) -> None:
        """A running replica whose agent has not reported it for `silent_after_s` is failed
        (its node or executor went away, or its job ended unseen) and stopped."""
        if self.since_start is None:
            self.since_start = now
        newest = max(self.heard.values(), default=self.since_start)
        if now - newest > self.silent_after_s:
            return  # nothing heard at all: our intake is stalled (or every agent), not them
        for rep in list(self.replicas.values()):
            if not rep.live or rep.state is ReplicaState.PENDING:
                continue
            last = self.heard.get(rep.job_id, self.since_start)
            if now - last > self.silent_after_s:
                rec = self.services.get(rep.service)
                tenant = rec.spec.tenant if rec is not None else ""
                self.ended(
                    rep.job_id, failed=True, now=now, why=f"not reported for {now - last:.0f} s"
                )
                out.stop.append((rep.job_id, tenant, "its agent stopped reporting it"))

    def _scale(self, rec: ServiceRecord, mine: list[ReplicaRecord], now: float) -> None:
        s = rec.spec
        spec = ScalingSpec(
            min_replicas=s.min_replicas,
            max_replicas=s.max_replicas,
            target_rps=s.target_rps,
            latency_slo_ms=s.latency_slo_ms,
            scale_down_after_s=s.scale_down_after_s / self.time_scale,
        )
        live = {r.job_id for r in mine if r.live}
        decision = desired_replicas(
            spec, rec.desired, list(self.reports.get(rec.name, ())), now, rec.last_change_at, live
        )
        if decision.replicas != rec.desired:
            rec.desired, rec.last_change_at = decision.replicas, now
            rec.change, rec.reason = "scaled", f"to {decision.replicas}: {decision.reason}"
            rec.revision += 1

    def _steady(
        self, out: RoundOut, rec: ServiceRecord, mine: list[ReplicaRecord], now: float
    ) -> None:
        live = [r for r in mine if r.live]
        stale = [r for r in live if r.version != rec.spec.version]
        self._stop(out, rec, stale, "not the service's version")
        current = [r for r in live if r.version == rec.spec.version]
        missing = rec.desired - len(current)
        if missing > 0:
            self._start(out, rec, current, missing, rec.spec, now)
        elif missing < 0:
            self._stop(out, rec, _least_useful(current)[:-missing], f"scaled to {rec.desired}")

    def _hold(
        self, out: RoundOut, rec: ServiceRecord, mine: list[ReplicaRecord], now: float
    ) -> None:
        """A paused update keeps the count (scaling, replacing lost replicas) without moving
        on: what it adds runs the version it updates from, as before the update."""
        live = [r for r in mine if r.live]
        missing = rec.desired - len(live)
        if missing > 0:
            template = rec.spec
            if rec.previous is not None and rec.previous.version == rec.rollout_from:
                template = rec.previous
            current = [r for r in live if r.version == template.version]
            self._start(out, rec, current, missing, template, now)
        elif missing < 0:
            self._stop(out, rec, _least_useful(live)[:-missing], f"scaled to {rec.desired}")

    def _roll(
        self, out: RoundOut, rec: ServiceRecord, mine: list[ReplicaRecord], now: float
    ) -> None:
        assert rec.rollout_from is not None and rec.rollout_started_at is not None
        if rec.paused:
            self._hold(out, rec, mine, now)
            return
        s = rec.spec
        spec = RolloutSpec(
            max_surge=s.rollout.max_surge,
            max_unavailable=s.rollout.max_unavailable,
            ready_timeout_s=s.rollout.ready_timeout_s / self.time_scale,
            latency_slo_ms=s.latency_slo_ms,
        )
        replicas = [
            Replica(r.job_id, r.version, r.state, r.since, r.latency_ms)
            for r in mine
            if not r.stopping
        ]
        step = rollout_step(
            spec, rec.desired, rec.rollout_from, s.version, replicas, now, rec.rollout_started_at
        )
        doomed = [self.replicas[j] for j in step.stop]
        if step.phase is RolloutPhase.ROLLING_BACK:
            self._stop(out, rec, doomed, step.reason)
            if rec.rolling_back or rec.previous is None:
                # The way back fails too: the update ends here, on the version returned to;
                # its replicas are replaced as they fail (with backoff), and it says why.
                rec.change = "rollback_failed"
                rec.reason = f"rolling back to {rec.spec.version}, and {step.reason}"
                rec.rollout_from = rec.rollout_started_at = None
                rec.rolling_back = False
                rec.revision += 1
                return
            self._reverse(rec, now, f"rolled back by itself: {step.reason}", back=True)
            rec.failures, rec.retry_at = 0, 0.0  # the old version starts at once
            rec.change = "rollback_started"
            rec.revision += 1
            return
        self._stop(out, rec, doomed, step.reason or "replaced by the new version")
        if step.phase is RolloutPhase.DONE:
            rec.change = "rolled_back" if rec.rolling_back else "rollout_done"
            rec.reason = step.reason
            rec.rollout_from = rec.rollout_started_at = None
            rec.rolling_back = False
            rec.revision += 1
            return
        if step.start > 0:
            current = [r for r in mine if r.live and r.version == s.version]
            self._start(out, rec, current, step.start, s, now)

    def _start(
        self,
        out: RoundOut,
        rec: ServiceRecord,
        current: list[ReplicaRecord],
        count: int,
        spec: ServiceSpec,
        now: float,
    ) -> None:
        if now < rec.retry_at:
            return  # replicas failed one after another: the next one waits (backoff)
        guaranteed = sum(1 for r in current if r.guaranteed)
        for _ in range(count):
            rec.seq += 1
            job_id = replica_job_id(rec.name, rec.seq)
            sure = guaranteed < spec.min_replicas
            guaranteed += sure
            out.submit.append(spec.replica_job(job_id, guaranteed=sure))
            self.replicas[job_id] = ReplicaRecord(
                job_id, rec.name, spec.version, sure, ReplicaState.PENDING, now
            )
            out.changed_replicas.add(job_id)

    def _stop(
        self, out: RoundOut, rec: ServiceRecord, doomed: list[ReplicaRecord], reason: str
    ) -> None:
        for r in doomed:
            if r.stopping:
                continue
            # The stop is sent (through the outbox): the replica is forgotten at once, its
            # job's end is the queue's and the executor's business.
            r.stopping = True
            out.stop.append((r.job_id, rec.spec.tenant, reason))
            self.replicas.pop(r.job_id, None)
            self.heard.pop(r.job_id, None)
            out.dropped_replicas.add(r.job_id)

    def _forget_failures(
        self, out: RoundOut, rec: ServiceRecord, mine: list[ReplicaRecord], now: float
    ) -> None:
        """A failed replica's job has ended: drop it once no rollout can need it."""
        started = rec.rollout_started_at
        for r in mine:
            if r.state is not ReplicaState.FAILED or r.job_id not in self.replicas:
                continue
            steady_old = rec.rollout_from is None and now - r.since > FAILED_KEPT_S
            # A failure from before the update under way is no evidence about it.
            before_update = started is not None and r.since < started
            if steady_old or before_update:
                del self.replicas[r.job_id]
                self.heard.pop(r.job_id, None)
                out.dropped_replicas.add(r.job_id)

    def _trim_reports(self, now: float) -> None:
        for name, queue in self.reports.items():
            rec = self.services.get(name)
            keep = (rec.spec.scale_down_after_s / self.time_scale if rec else 0.0) + REPORTS_SLACK_S
            while queue and now - queue[0].at > keep:
                queue.popleft()

    # What it shows ------------------------------------------------------------------------------

    def status(
        self, rec: ServiceRecord, replicas: list[ReplicaRecord] | None = None
    ) -> ServiceStatus:
        """The service's status; `replicas` are its replicas (all of the book's otherwise)."""
        if replicas is None:
            replicas = [r for r in self.replicas.values() if r.service == rec.name]
        mine = sorted((r for r in replicas if not r.stopping), key=lambda r: r.job_id)
        if rec.deleted:
            phase = ServicePhase.DELETED
        elif rec.rollout_from is None:
            phase = ServicePhase.STEADY
        elif rec.paused:
            phase = ServicePhase.PAUSED
        else:
            phase = ServicePhase.ROLLING_BACK if rec.rolling_back else ServicePhase.ROLLING
        ready = [r for r in mine if r.state is ReplicaState.READY]
        return ServiceStatus(
            service=rec.name,
            tenant=rec.spec.tenant,
            phase=phase,
            model=rec.spec.model,
            version=rec.spec.version,
            previous_version=rec.previous.version if rec.previous else None,
            min_replicas=rec.spec.min_replicas,
            max_replicas=rec.spec.max_replicas,
            desired_replicas=0 if rec.deleted else rec.desired,
            ready_replicas=len(ready),
            replicas=[
                ReplicaView(
                    replica=r.job_id,
                    version=r.version,
                    state=r.state.value,
                    guaranteed=r.guaranteed,
                    since=_at(r.since),
                    cluster=r.cluster,
                    node=r.node,
                    address=r.address,
                )
                for r in mine
            ],
            endpoints=[
                Endpoint(replica=r.job_id, version=r.version, address=r.address)
                for r in ready
                if r.address
            ],
            rollout_from=rec.rollout_from,
            rollout_started_at=_at(rec.rollout_started_at) if rec.rollout_started_at else None,
            change=rec.change,
            reason=rec.reason[:2000],
            revision=rec.revision,
        )


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _least_useful(replicas: list[ReplicaRecord]) -> list[ReplicaRecord]:
    """The order to stop replicas in: above the minimum before guaranteed ones (the
    guarantee holds), then waiting, then starting, then ready; the newest first."""
    return sorted(
        replicas,
        key=lambda r: (
            r.guaranteed,
            r.state is ReplicaState.READY,
            r.state is ReplicaState.STARTING,
            -r.since,
        ),
    )
