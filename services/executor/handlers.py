"""The executor's work: honour or refuse placements, stop jobs (cancel, preemption, node
loss), signal checkpoints, end runs when their time is up. State changes and the events
announcing them commit together (outbox), one change at a time."""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from aiokafka import ConsumerRecord
from pydantic import BaseModel, ValidationError

from schemas import topics
from schemas.bounds import escape_unsafe
from schemas.envelope import Envelope
from schemas.events import (
    JobCheckpointRequested,
    JobFinished,
    JobPreemptOrdered,
    JobStarted,
    JobStopOrdered,
    LeaderFence,
    Outcome,
    PlacementDecided,
    PlacementHead,
    PlacementRefused,
    RunFailed,
)
from schemas.health import NodeRecovered, NodeUnhealthy
from services.common.deadletter import dead_letter, decode_envelopes
from services.common.kafka import OutMessage, envelope_for
from services.common.logging import bind_event
from services.common.outbox import OutboxRelay
from services.common.tracing import Hops, Tracing, hops, incoming
from services.executor.backend import (
    NEVER,
    Action,
    Backend,
    Launch,
    Quarantine,
    Release,
    ReportKind,
    RunReport,
    SignalCheckpoint,
    SimulatedBackend,
    Teardown,
)
from services.executor.metrics import ExecutorMetrics
from services.executor.nodes import NodeBook
from services.executor.running import RunningJobs
from services.executor.runs import (
    ended_by_itself,
    fleet_s,
    preempted,
    reported_end,
    run_seconds,
)
from services.executor.simulated import RunEnd
from services.executor.store import Checkpoint, ExecutorStore, RunKey, RunningJob, utcnow

log = structlog.get_logger()

# What the executor consumes; items of another cluster are skipped after parsing.
PAYLOADS: dict[str, type[BaseModel]] = {
    topics.PLACEMENT_DECIDED: PlacementDecided,
    topics.JOB_STOP_ORDERED: JobStopOrdered,
    topics.NODE_UNHEALTHY: NodeUnhealthy,
    topics.NODE_RECOVERED: NodeRecovered,
    topics.JOB_CHECKPOINT_REQUESTED: JobCheckpointRequested,
    topics.JOB_PREEMPT_ORDERED: JobPreemptOrdered,
}


@dataclass(frozen=True)
class Unusable:
    """A placement for this cluster whose head reads but whose spec does not validate: it is
    refused (see Executor._unusable)."""

    placement: PlacementHead
    why: str


class Executor:
    def __init__(
        self,
        cluster: str,
        book: NodeBook,
        store: ExecutorStore,
        relay: OutboxRelay,
        metrics: ExecutorMetrics,
        *,
        time_scale: float,
        default_duration_s: float,
        backend: Backend | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.cluster = cluster
        self.tracing = tracing
        self.producer = f"executor/{cluster}"
        self._cluster_header = cluster.encode()
        self.book = book
        self.store = store
        self.relay = relay
        self.metrics = metrics
        self.time_scale = time_scale
        self.default_duration_s = default_duration_s
        self.backend: Backend = backend or SimulatedBackend(time_scale, default_duration_s)
        # What the change being committed decided to do outside the process (backend.act).
        self._acts: list[Action] = []
        self.running = RunningJobs()
        self.due: list[tuple[float, str, int]] = []
        self.epoch = 0
        # Stop orders for jobs not running here: job id -> when (wall seconds). A placement of
        # such a job is refused; kept `tombstone_retention_s`, longer than any placement of a
        # canceled job can still be on its way, then pruned (memory and table).
        self.tombstones: dict[str, float] = {}
        # Accepted placements not running yet (a Kubernetes gang until every pod runs): when
        # each was decided (wall seconds) and its start-up histogram labels. Memory only: a
        # run that starts after a restart of the executor is not observed.
        self.launching: dict[RunKey, tuple[float, tuple[str, str, str]]] = {}
        # Start-ups of the change being committed, observed once it has committed (a change
        # rolled back is tried again, and would observe them twice): run, labels, seconds.
        self._startups: list[tuple[RunKey, tuple[str, str, str], float]] = []
        self._changing = asyncio.Lock()
        self._stale = False  # memory may be ahead of the store (see _reload)

    async def restore(self) -> None:
        self._rebuild(*await self.store.load())

    @property
    def changing(self) -> asyncio.Lock:
        """Held while a change is decided and stored; node book changes from outside (an
        elastic pool's nodes coming and going) take it too."""
        return self._changing

    def _rebuild(self, jobs: list[RunningJob], epoch: int, tombstones: dict[str, float]) -> None:
        """Memory as the store has it (after a start, or after a failed transaction)."""
        for job_id in list(self.book.by_job):
            self.book.release(job_id)
        self.running.clear()
        self.due.clear()
        self.epoch, self.tombstones = epoch, tombstones
        # Runs whose replicas name their devices first (booked exactly there), then the rest
        # in the order they started (as they were booked when they came).
        jobs = sorted(
            jobs,
            key=lambda j: (not all(r.devices for r in j.replicas), j.started_at, j.job_id),
        )
        for job in jobs:
            if self.book.check(job.replicas, new=False) is None:
                self.book.allocate(job.job_id, job.replicas)
            else:
                log.error("restored job does not fit its nodes", job_id=job.job_id)
            self._track(job)
        log.info("restored", running=len(jobs), epoch=self.epoch)

    def _track(self, job: RunningJob) -> None:
        self.running[job.job_id] = job
        # A run its backend ends (a Kubernetes gang, an inference service) is never due on the
        # clock: in the heap it would stay, one entry per placement, until a restart.
        if job.ends_at - job.started_at < NEVER / 2:
            heapq.heappush(self.due, (job.ends_at.timestamp(), job.job_id, job.attempt))

    def _emit(
        self, topic: str, event_type: str, payload: Any, tenant: str | None, cause: Envelope | None
    ) -> OutMessage:
        env = envelope_for(event_type, payload, producer=self.producer, tenant=tenant, cause=cause)
        return OutMessage(topic, payload.job_id, env)

    def _for_another_cluster(self, record: ConsumerRecord[Any, Any]) -> bool:
        """A `cluster` header (the scheduler sets one on placements) lets us skip an item of
        another cluster without parsing it; items without one are parsed and looked at."""
        for name, value in record.headers or ():
            if name == "cluster":
                return bool(value != self._cluster_header)
        return False  # no header (another producer): parse it and look

    async def process(self, records: tuple[ConsumerRecord[Any, Any], ...]) -> None:
        records = tuple(r for r in records if not self._for_another_cluster(r))
        fences: list[LeaderFence] = []
        received, dead = decode_envelopes(
            records, consumer=self.producer, fences=fences, models=PAYLOADS
        )
        mine: list[tuple[Envelope, Any]] = []
        traced = hops(self.tracing, "executor.start")  # a placement's trace goes on here
        for got in received:
            try:
                item = PAYLOADS[got.record.topic].model_validate(got.envelope.payload)
                if getattr(item, "cluster", self.cluster) == self.cluster:
                    mine.append((got.envelope, item))
                    if isinstance(item, PlacementDecided):
                        traced.open(
                            got.envelope.event_id,
                            incoming(got.record.headers, got.envelope),
                            job_id=item.job_id,
                            attempt=item.attempt,
                            cluster=self.cluster,
                        )
            except ValidationError as exc:
                dead.append(dead_letter(got.record, str(exc), consumer=self.producer))
                unusable = self._unusable(got.record.topic, got.envelope.payload, exc)
                if unusable is not None:
                    mine.append((got.envelope, unusable))
        fence = max((f.epoch for f in fences), default=0)
        if not mine and not dead and fence <= self.epoch:
            return
        # One change at a time: a run that ends by its clock must not also be stopped,
        # preempted, checkpointed or handed back by a batch processed meanwhile.
        async with self._changing:
            if self._stale:
                await self._reload()
            try:
                with traced:
                    await self._commit(mine, dead, fence, traced)
            except Exception:
                # Memory may be ahead of the store: rebuild it from the store, then redeliver.
                await self._reload()
                raise

    async def _commit(
        self, items: list[tuple[Envelope, Any]], dead: list[OutMessage], fence: int, traced: Hops
    ) -> None:
        self._acts, self._startups = [], []
        async with self.relay.transaction() as tx:
            conn = tx.conn
            fresh = await tx.claim([e.event_id for e, _ in items])
            out = list(dead)
            started: list[RunningJob] = []
            ended: list[RunKey] = []
            tombs: list[str] = []
            checkpointed: list[RunningJob] = []
            epoch_before = self.epoch
            # A new leader's fence: from here on its predecessors' placements are stale. (Within
            # a batch the fence counts first; what was before it on its partition the new leader
            # has read, so at worst a placement it knows of is refused and placed again.)
            self.epoch = max(self.epoch, fence)
            for env, item in items:
                if env.event_id not in fresh:
                    continue
                if isinstance(item, PlacementDecided):
                    out.extend(self._place(env, item, started))
                elif isinstance(item, Unusable):
                    out.append(self._refuse_unusable(env, item))
                elif isinstance(item, JobStopOrdered):
                    out.extend(self._stop(env, item, ended, tombs))
                elif isinstance(item, NodeUnhealthy):
                    out.extend(self._node_lost(env, item, ended))
                elif isinstance(item, JobCheckpointRequested):
                    self._checkpoint(env, item, checkpointed)
                elif isinstance(item, JobPreemptOrdered):
                    out.extend(self._preempt(env, item, ended))
                else:
                    self.book.set_health(item.node_id, healthy=True)
                    self._acts.append(Release(item.node_id))
            await self.store.write(
                conn,
                started=started,
                ended=ended,
                epoch=self.epoch if self.epoch != epoch_before else None,
                tombstones=tombs,
                checkpointed=checkpointed,
            )
            traced.stamp(out)
            tx.emit(out)
        self._observe_startups()
        self.metrics.allocated.set(self.book.allocated_accelerators)
        await self.backend.act(self._acts)

    def _unusable(self, topic: str, payload: Any, exc: ValidationError) -> Unusable | None:
        """A placement for this cluster whose job spec does not validate (only a producer
        other than the scheduler writes one, or a scheduler of another version whose spec is
        less strict than ours): besides its dead letter, it is refused, so that
        the services that read placements without the spec (the schedulers among them) free
        the job and it is placed again, rather than waiting for a run that never starts."""
        if topic != topics.PLACEMENT_DECIDED:
            return None
        try:
            head = PlacementHead.model_validate(payload)
        except ValidationError:
            return None  # not even a placement's head: the dead letter says it all
        if head.cluster != self.cluster:
            return None
        first = " ".join(str(exc).splitlines()[:3])[:500]
        return Unusable(head, escape_unsafe(f"the job's spec is not valid: {first}"))

    def _refuse_unusable(self, env: Envelope, item: Unusable) -> OutMessage:
        # A deposed leader's copy is refused as such, whatever else is wrong with it (the
        # queue and the gateway pass those by); the epoch is not raised by it.
        p = item.placement
        if p.epoch < self.epoch:
            why = f"decided by leader epoch {p.epoch}; epoch {self.epoch} leads now"
            return self._refuse(env, p, "stale_epoch", why)
        return self._refuse(env, p, "invalid_spec", item.why)

    def _refuse(self, env: Envelope, p: PlacementHead, code: str, msg: str) -> OutMessage:
        self.metrics.refused.labels(code).inc()
        with bind_event(env, p.job_id):
            log.info("placement refused", reason=code, detail=msg, attempt=p.attempt)
        refusal = PlacementRefused(
            job_id=p.job_id,
            attempt=p.attempt,
            epoch=p.epoch,
            cluster=self.cluster,
            reason_code=code,
            message=msg,
        )
        return self._emit(topics.PLACEMENT_REFUSED, "PlacementRefused", refusal, p.spec.tenant, env)

    def _place(
        self, env: Envelope, p: PlacementDecided, started: list[RunningJob]
    ) -> list[OutMessage]:
        refusal = self._refusal(env, p)
        if refusal is not None:
            return [refusal]
        self.book.allocate(p.job_id, p.replicas)
        now = utcnow()
        job = self.backend.begin(p, now)
        self._track(job)
        started.append(job)
        self.metrics.started.inc()
        spec = p.spec
        launch = (env.occurred_at.timestamp(), (spec.tenant, spec.queue, spec.priority_class))
        if not job.started:  # it is announced when the backend reports it running
            self.launching[job.key] = launch
            self._acts.append(Launch(p))
            return []
        return [self._started(job, env, launch)]

    def _started(
        self,
        job: RunningJob,
        env: Envelope | None,
        launch: tuple[float, tuple[str, str, str]] | None = None,
    ) -> OutMessage:
        launch = launch or self.launching.get(job.key)
        if launch is not None:  # observed once the change commits (_observe_startups)
            placed_at, labels = launch
            seconds = max(0.0, job.started_at.timestamp() - placed_at)
            self._startups.append((job.key, labels, seconds))
        return self._emit(
            topics.JOB_STARTED,
            "JobStarted",
            JobStarted(
                job_id=job.job_id,
                attempt=job.attempt,
                cluster=self.cluster,
                nodes=job.nodes,
                started_at=job.started_at,
            ),
            job.tenant,
            env,
        )

    def _observe_startups(self) -> None:
        """After a commit: its start-ups, whose launches are then no longer awaited."""
        for key, labels, seconds in self._startups:
            self.launching.pop(key, None)
            self.metrics.startup.labels(*labels).observe(seconds)
        self._startups = []

    def _refusal(self, env: Envelope, p: PlacementDecided) -> OutMessage | None:
        if p.epoch < self.epoch:
            return self._refuse(
                env,
                p,
                "stale_epoch",
                f"decided by leader epoch {p.epoch}; epoch {self.epoch} leads now",
            )
        self.epoch = max(self.epoch, p.epoch)
        if p.job_id in self.tombstones:
            return self._refuse(env, p, "canceled", "the job was canceled before it started")
        if p.job_id in self.running:
            return self._refuse(
                env,
                p,
                "already_running",
                f"attempt {self.running[p.job_id].attempt} is still running",
            )
        why = self.book.check(p.replicas)
        if why is not None:
            return self._refuse(env, p, "would_overcommit", why)
        return None

    def _stop(
        self, env: Envelope, cmd: JobStopOrdered, ended: list[RunKey], tombs: list[str]
    ) -> list[OutMessage]:
        job = self.running.pop(cmd.job_id, None)
        if job is None:
            self.tombstones[cmd.job_id] = time.time()
            tombs.append(cmd.job_id)
            return []
        self._acts.append(Teardown(job.key, cmd.reason))
        return [
            self._end(
                job, env, Outcome.CANCELED, cmd.reason, f"stopped on request ({cmd.reason})", ended
            )
        ]

    def _this_run(self, job_id: str, attempt: int, now: datetime) -> RunningJob | None:
        """The run a command names, if it still runs here. One whose clock has run out is over
        (its own end is on the way, from finish_due): commands for it do nothing."""
        job = self.running.get(job_id)
        if job is None or job.attempt != attempt or job.ends_at <= now:
            return None
        return job

    def _checkpoint(
        self, env: Envelope, cmd: JobCheckpointRequested, checkpointed: list[RunningJob]
    ) -> None:
        """Signal the run to save its work; the simulated checkpoint completes
        `checkpoint_s` fleet seconds later. The same order again, or one while a checkpoint
        is being written, changes nothing."""
        now = utcnow()
        job = self._this_run(cmd.job_id, cmd.attempt, now)
        with bind_event(env, cmd.job_id):
            if job is None:
                log.info("checkpoint signal for a run not running here", attempt=cmd.attempt)
                return
            last = job.checkpoint
            if last is not None and (last.stop_at == cmd.stop_at or last.done_at > now):
                log.info("checkpoint already signalled", attempt=job.attempt)
                return
            done = now + timedelta(seconds=job.checkpoint_s / self.time_scale)
            job.checkpoint = Checkpoint(at=now, done_at=done, stop_at=cmd.stop_at)
            checkpointed.append(job)
            self._acts.append(SignalCheckpoint(job.key, now, cmd.stop_at))
            self.metrics.checkpoints.inc()
            log.info(
                "checkpoint signalled",
                attempt=job.attempt,
                for_job=cmd.for_job,
                saves_s=round(fleet_s(job.started_at, now, self.time_scale), 3),
                completes_at=done.isoformat(),
                stop_at=cmd.stop_at.isoformat(),
            )

    def _preempt(
        self, env: Envelope, cmd: JobPreemptOrdered, ended: list[RunKey]
    ) -> list[OutMessage]:
        """The grace period is over: stop the run, free its devices and hand it back with the
        work its checkpoints kept."""
        now = utcnow()
        job = self._this_run(cmd.job_id, cmd.attempt, now)
        if job is None:
            with bind_event(env, cmd.job_id):
                log.info("preempt order for a run not running here", attempt=cmd.attempt)
            return []
        del self.running[job.job_id]
        self._release(job, ended, "preempted")
        self._acts.append(Teardown(job.key, "preempted"))
        event = preempted(
            job,
            self.cluster,
            now,
            self.time_scale,
            reason_code=cmd.reason_code,
            message=cmd.message,
            for_job=cmd.for_job,
        )
        with bind_event(env, job.job_id):
            log.info(
                "run preempted",
                attempt=job.attempt,
                for_job=cmd.for_job,
                ran_s=event.ran_s,
                kept_s=event.work_kept_s,
                lost_s=event.work_lost_s,
            )
        return [self._emit(topics.JOB_PREEMPTED, "JobPreempted", event, job.tenant, env)]

    def _node_lost(
        self, env: Envelope, down: NodeUnhealthy, ended: list[RunKey]
    ) -> list[OutMessage]:
        """The health service quarantined a node: nothing new lands there, and every gang
        with a replica on it is stopped as a whole and handed back (job.preempted) to be
        requeued elsewhere."""
        # Marked already (a redelivery after a failed commit): hand back what still runs there.
        self.book.set_health(down.node_id, healthy=False)
        hit = self.running.on_node(down.node_id)
        message = f"node {down.node_id} failed ({down.cause}) under a replica of this job"
        log.warning(
            "node lost; handing its gangs back", node=down.node_id, cause=down.cause, jobs=len(hit)
        )
        out = []
        now = utcnow()
        self._acts.append(Quarantine(down.node_id, down.cause))
        for job in hit:
            del self.running[job.job_id]
            self._release(job, ended, "node_failure")
            self._acts.append(Teardown(job.key, "node_failure", grace_s=0))
            lost = preempted(
                job,
                self.cluster,
                now,
                self.time_scale,
                reason_code="node_failure",
                message=message,
                failed_nodes=[down.node_id],
            )
            out.append(self._emit(topics.JOB_PREEMPTED, "JobPreempted", lost, job.tenant, env))
        return out

    def _release(self, job: RunningJob, ended: list[RunKey], how: str) -> None:
        self.launching.pop(job.key, None)
        self.book.release(job.job_id)
        ended.append(job.key)
        self.metrics.finished.labels(how).inc()

    def _end(
        self,
        job: RunningJob,
        env: Envelope,
        outcome: Outcome,
        reason: str,
        message: str,
        ended: list[RunKey],
    ) -> OutMessage:
        self._release(job, ended, outcome.value)
        done = JobFinished(
            job_id=job.job_id,
            attempt=job.attempt,
            outcome=outcome,
            reason_code=reason,
            message=message,
            cluster=self.cluster,
            ran_s=run_seconds(job.started_at, utcnow(), self.time_scale),
        )
        return self._emit(topics.JOB_FINISHED, "JobFinished", done, job.tenant, env)

    async def finish_due(self, now: float) -> int:
        """End every run whose (virtual) run time is over: job.finished, or job.run.failed
        when the job itself failed."""
        async with self._changing:
            if self._stale:
                await self._reload()
            return await self._finish_due(now)

    async def _finish_due(self, now: float) -> int:
        due: list[RunningJob] = []
        while self.due and self.due[0][0] <= now:
            _, job_id, attempt = heapq.heappop(self.due)
            job = self.running.get(job_id)
            if job is not None and job.attempt == attempt:
                due.append(job)
        if not due:
            return 0
        out = []
        for job in due:
            event = ended_by_itself(job, self.cluster, self.time_scale)
            if isinstance(event, RunFailed):
                out.append(self._emit(topics.JOB_RUN_FAILED, "RunFailed", event, job.tenant, None))
            else:
                out.append(self._emit(topics.JOB_FINISHED, "JobFinished", event, job.tenant, None))
        try:
            async with self.relay.transaction() as tx:
                await self.store.write(
                    tx.conn, started=[], ended=[j.key for j in due], epoch=None, tombstones=[]
                )
                tx.emit(out)
        except Exception:
            # The commit may have gone through all the same (a connection lost while
            # committing): ending these runs again would announce their end twice, with new
            # event ids. The next tick reads the store back first (_reload): runs still there
            # end then, runs gone are not ended again.
            self._stale = True
            raise
        for job in due:
            self.running.pop(job.job_id, None)
            self.book.release(job.job_id)
            if job.end is RunEnd.RUN_FAILED:
                self.metrics.runs_failed.labels(job.reason_code or "unknown").inc()
            else:
                self.metrics.finished.labels(job.end.value).inc()
        return len(due)

    async def report(self, reports: Sequence[RunReport]) -> list[RunReport]:
        """Judge what the backend saw runs do (under the change lock, like any input): a gang
        running is announced once; its end is announced and its devices freed in the same
        change. Returns the reports that name no run here (the backend removes those)."""
        if not reports:
            return []
        async with self._changing:
            if self._stale:
                await self._reload()
            try:
                return await self._report(reports)
            except Exception:
                await self._reload()
                raise

    async def _report(self, reports: Sequence[RunReport]) -> list[RunReport]:
        self._acts, self._startups = [], []
        out: list[OutMessage] = []
        ended: list[RunKey] = []
        announced: list[RunningJob] = []
        unknown: list[RunReport] = []
        now = utcnow()
        for r in reports:
            job = self.running.get(r.job_id)
            if job is None or job.attempt != r.attempt:
                unknown.append(r)
            elif r.kind is ReportKind.RUNNING:
                if not job.started:
                    job.started, job.started_at = True, now
                    announced.append(job)
                    out.append(self._started(job, None))
            else:
                del self.running[job.job_id]
                out.append(self._run_over(job, r, now, ended))
        if out:
            async with self.relay.transaction() as tx:
                await self.store.write(
                    tx.conn,
                    started=[],
                    ended=ended,
                    epoch=None,
                    tombstones=[],
                    announced=announced,
                )
                tx.emit(out)
            self._observe_startups()
            await self.backend.act(self._acts)
        return unknown

    def _run_over(
        self, job: RunningJob, r: RunReport, now: datetime, ended: list[RunKey]
    ) -> OutMessage:
        """The event for a run the backend saw end, and the teardown of what is left of it."""
        end = reported_end(job, r, self.cluster, now, self.time_scale)
        log.info(
            "run over", job_id=job.job_id, attempt=job.attempt, how=end.how, reason=r.reason_code
        )
        self._release(job, ended, end.how)
        if r.kind is ReportKind.REFUSED:
            self.metrics.refused.labels(r.reason_code or "refused").inc()
        elif end.topic == topics.JOB_RUN_FAILED:
            self.metrics.runs_failed.labels(r.reason_code or "unknown").inc()
        self._acts.append(Teardown(job.key, end.how, grace_s=end.grace_s))
        return self._emit(end.topic, end.event_type, end.payload, job.tenant, None)

    async def prune_tombstones(self, retention_s: float, now: float | None = None) -> int:
        """Forget tombstones older than `retention_s`, in the table and in memory; returns how
        many left memory. Under the change lock, so no batch sees half of it."""
        cutoff = (time.time() if now is None else now) - retention_s
        async with self._changing:
            await self.store.forget_tombstones(datetime.fromtimestamp(cutoff, UTC))
            old = [j for j, at in self.tombstones.items() if at < cutoff]
            for job_id in old:
                del self.tombstones[job_id]
        self.metrics.tombstones.set(len(self.tombstones))
        return len(old)

    async def _reload(self) -> None:
        """Rebuild memory from the store. Until that succeeds (the store may be the reason the
        transaction failed) memory counts as stale, and nothing is decided on it: every batch
        and every clock tick tries the reload first. Memory is replaced only once the store
        has been read, never cleared before."""
        self._stale = True
        self._rebuild(*await self.store.load())
        self._stale = False
