"""The preemptor's shell: read a batch (or the clock), judge it with services.preemptor.guards,
then write the preemptions and the events they cause in one transaction, then relay."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import structlog
from aiokafka import ConsumerRecord
from prometheus_client import CollectorRegistry, Counter, Histogram

from core.policy import Policy
from schemas.envelope import Envelope
from services.common.kafka import OutMessage
from services.common.logging import bind_event
from services.common.outbox import OutboxRelay
from services.preemptor import emit, store
from services.preemptor.guards import (
    Cancel,
    Hold,
    Ignore,
    Limits,
    Order,
    Request,
    Signal,
    Situation,
    State,
    budget_since,
    decide_due,
    decide_request,
)
from services.preemptor.intake import Incoming, read_batch

log = structlog.get_logger()

Clock = Callable[[], datetime]
Decision = Signal | Cancel | Hold | Ignore | Order


class PreemptorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "qm_preemptor_requests_total",
            "Preemption requests taken, by first outcome (signaled, canceled, held, ignored)",
            ["outcome"],
            registry=registry,
        )
        self.signaled = Counter(
            "qm_preemptor_signaled_total", "Checkpoint requests sent", registry=registry
        )
        self.ordered = Counter(
            "qm_preemptor_ordered_total", "Stop orders sent after the grace", registry=registry
        )
        self.canceled = Counter(
            "qm_preemptor_canceled_total",
            "Preemptions refused or called off",
            ["reason"],
            registry=registry,
        )
        self.done = Counter(
            "qm_preemptor_done_total",
            "Ordered preemptions whose victim run ended",
            ["ended_by"],
            registry=registry,
        )
        self.dead = Counter(
            "qm_preemptor_dead_letters_total", "Records dead-lettered", registry=registry
        )
        self.unanswered = Counter(
            "qm_preemptor_stop_orders_unanswered_total",
            "Stop orders no run end answered within the timeout (each raised an alert)",
            registry=registry,
        )
        self.preemptions = Counter(
            "qm_preemptor_preemptions_total",
            "Runs ordered to stop for a higher claim, by reason code and the tenants that gain "
            "and lose the room",
            ["reason", "preemptor_tenant", "victim_tenant"],
            registry=registry,
        )
        self.order_delay = Histogram(
            "qm_preemptor_order_delay_seconds",
            "Wall seconds from a preemption's stop_at to its stop order",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )


@dataclass(frozen=True)
class Decided:
    request: Request
    cause: Envelope
    decision: Decision
    first: bool  # the first look at this request (counted in requests_total)
    order_delay_s: float | None = None


@dataclass
class Effects:
    """What one transaction decided, counted and logged only once it has committed."""

    messages: list[OutMessage] = field(default_factory=list)
    decided: list[Decided] = field(default_factory=list)
    done: list[tuple[Request, str]] = field(default_factory=list)


class Preemptor:
    def __init__(
        self,
        pool: asyncpg.Pool,
        relay: OutboxRelay,
        policy: Policy,
        limits: Limits,
        metrics: PreemptorMetrics,
        *,
        clock: Clock,
        timer_batch: int = 100,
        stop_answer_timeout_s: float = 60.0,
    ) -> None:
        self.pool = pool
        self.relay = relay
        self.policy = policy
        self.limits = limits
        self.metrics = metrics
        self.clock = clock
        self.timer_batch = timer_batch
        self.stop_answer_timeout_s = stop_answer_timeout_s

    # --- consuming ------------------------------------------------------------------------

    async def process(self, records: tuple[ConsumerRecord[Any, Any], ...]) -> Effects:
        batch = read_batch(records)
        requests = {got.request.id: got for got in batch.requests}  # a batch may repeat one
        effects = Effects(messages=list(batch.dead))
        now = self.clock()
        async with self.relay.transaction() as tx:
            conn = tx.conn
            fresh = await tx.claim(list(requests))
            # Facts first: a victim's job.started in the same batch as its request counts.
            await store.save_facts(conn, batch.facts.values())
            if batch.epoch:
                await store.raise_fence(conn, batch.epoch)
            taken = [got for rid, got in requests.items() if rid in fresh]
            await store.lock_tenants(conn, [got.request.tenant for got in taken])
            for got in taken:
                await self._take(conn, got, now, effects)
            effects.done = await store.runs_ended(conn, batch.ends, now)
            tx.emit(effects.messages)
        self.metrics.dead.inc(len(batch.dead))
        self._report(effects)
        return effects

    async def _take(
        self, conn: asyncpg.Connection, got: Incoming, now: datetime, effects: Effects
    ) -> None:
        req = got.request
        facts = await store.facts_of(conn, (req.job_id, req.for_job))
        situation = Situation(
            fence_epoch=await store.fence_epoch(conn),
            active=await store.has_active(conn, req.job_id, req.attempt),
            victim=facts[req.job_id],
            requester=facts[req.for_job],
            tenant_signals=await store.tenant_signals(
                conn, req.tenant, budget_since(now, self.limits)
            ),
            received_at=now,
        )
        decision = decide_request(req, situation, self.policy, self.limits, now)
        await store.raise_fence(conn, req.epoch)
        if isinstance(decision, Ignore):
            effects.decided.append(Decided(req, got.envelope, decision, first=True))
            return
        hold_until = decision.until if isinstance(decision, Hold) else None
        await store.insert(conn, got, State.HELD, now, hold_until=hold_until)
        await self._apply(conn, req, got.envelope, decision, now, effects, first=True)

    # --- the durable timer ------------------------------------------------------------------

    async def tick(self) -> int:
        """Act on every due preemption (and look again at held requests); returns how many
        changed. Held rows still waiting sort after every due one, so a full batch of changes
        is the only sign that more may be due right now."""
        now = self.clock()
        if not await store.anything_due(self.pool, now):
            return 0
        effects = Effects()
        async with self.relay.transaction() as tx:
            conn = tx.conn
            rows = await store.claim_due(conn, now, self.timer_batch)
            if not rows:
                return 0
            jobs = {j for t in rows for j in (t.request.job_id, t.request.for_job)}
            facts = await store.facts_of(conn, jobs)
            for t in rows:
                req = t.request
                cause = emit.cause_of(req.id, t.trace_id, req.tenant)
                victim, requester = facts[req.job_id], facts[req.for_job]
                if t.state == State.SIGNALED:
                    decision: Decision = decide_due(req, victim, requester)
                    await self._apply(conn, req, cause, decision, now, effects, stop_at=t.stop_at)
                    continue
                # Held: the budget is checked under the tenant's lock; if another
                # transaction holds it, look again on the next tick rather than wait.
                if not await store.try_lock_tenant(conn, req.tenant):
                    continue
                situation = Situation(
                    fence_epoch=await store.fence_epoch(conn),
                    # The unique index allows no other live preemption of this run.
                    active=False,
                    victim=victim,
                    requester=requester,
                    tenant_signals=await store.tenant_signals(
                        conn, req.tenant, budget_since(now, self.limits)
                    ),
                    received_at=t.received_at,
                )
                decision = decide_request(req, situation, self.policy, self.limits, now)
                if not isinstance(decision, Hold | Ignore):
                    await self._apply(conn, req, cause, decision, now, effects)
            tx.emit(effects.messages)
        self._report(effects)
        return len(effects.decided)

    async def alert_unanswered(self) -> int:
        """One alert per stop order that no run end has answered within the timeout (the
        executor may be wedged or gone); returns how many went out. Orders whose run ended by
        the job facts are settled as done first (see store.settle_ended)."""
        now = self.clock()
        before = now - timedelta(seconds=self.stop_answer_timeout_s)
        async with self.relay.transaction() as tx:
            settled = await store.settle_ended(tx.conn, now)
            late = await store.claim_unanswered(tx.conn, before, now, self.timer_batch)
            tx.emit(emit.unanswered(req, at, (now - at).total_seconds()) for req, at in late)
        for _req, ended_by in settled:
            self.metrics.done.labels(ended_by).inc()
        for req, at in late:
            self.metrics.unanswered.inc()
            log.warning(
                "stop order unanswered",
                job_id=req.job_id,
                attempt=req.attempt,
                cluster=req.cluster,
                ordered_at=at.isoformat(),
            )
        return len(late)

    async def run_timer(self, interval_s: float, answer_check_s: float = 1.0) -> None:
        last_check = 0.0
        while True:
            try:
                changed = await self.tick()
                if time.monotonic() - last_check >= answer_check_s:
                    last_check = time.monotonic()
                    await self.alert_unanswered()
            except Exception:
                log.warning("preemption timer failed; will retry", exc_info=True)
                changed = 0
            if changed < self.timer_batch:
                await asyncio.sleep(interval_s)

    # --- acting on a decision ---------------------------------------------------------------

    async def _apply(
        self,
        conn: asyncpg.Connection,
        req: Request,
        cause: Envelope,
        decision: Decision,
        now: datetime,
        effects: Effects,
        *,
        first: bool = False,
        stop_at: datetime | None = None,
    ) -> None:
        delay = None
        if isinstance(decision, Signal):
            await store.mark_signaled(conn, req.id, decision.grace_s, decision.stop_at, now)
            effects.messages.append(emit.checkpoint(req, decision, cause, now))
        elif isinstance(decision, Cancel):
            await store.mark_canceled(conn, req.id, decision.reason.value, decision.message, now)
            effects.messages.append(emit.canceled(req, decision, cause))
        elif isinstance(decision, Order):
            await store.mark_ordered(conn, req.id, now)
            effects.messages.append(emit.order(req, decision, cause, now))
            if stop_at is not None:
                delay = max(0.0, (now - stop_at).total_seconds())
        effects.decided.append(Decided(req, cause, decision, first, delay))

    def _report(self, effects: Effects) -> None:
        m = self.metrics
        for d in effects.decided:
            req, decision, delay = d.request, d.decision, d.order_delay_s
            with bind_event(d.cause, req.job_id):
                fields = {"attempt": req.attempt, "for_job": req.for_job}
                if isinstance(decision, Signal):
                    m.signaled.inc()
                    log.info(
                        "checkpoint requested",
                        grace_s=decision.grace_s,
                        stop_at=decision.stop_at.isoformat(),
                        **fields,
                    )
                elif isinstance(decision, Cancel):
                    m.canceled.labels(decision.reason.value).inc()
                    log.info(
                        "preemption canceled",
                        reason=decision.reason.value,
                        detail=decision.message,
                        **fields,
                    )
                elif isinstance(decision, Order):
                    m.ordered.inc()
                    m.preemptions.labels(
                        req.reason_code, req.for_tenant or "unknown", req.tenant
                    ).inc()
                    if delay is not None:
                        m.order_delay.observe(delay)
                    log.info("stop ordered", late_s=delay, **fields)
                elif isinstance(decision, Hold):
                    log.info("victim not seen running yet; holding", until=str(decision.until))
                else:
                    log.info("preemption already in hand; request ignored", **fields)
            if d.first:
                outcome = {Signal: "signaled", Cancel: "canceled", Hold: "held"}
                m.requests.labels(outcome.get(type(decision), "ignored")).inc()
        for req, how in effects.done:
            m.done.labels(how).inc()
            log.info("preempted run ended", job_id=req.job_id, attempt=req.attempt, ended_by=how)
