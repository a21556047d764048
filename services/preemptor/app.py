"""The preemptor service: turns the scheduler's preemption.requested into a graceful lifecycle
(guards, checkpoint request, durable grace timer, stop order) and tells the scheduler when it
will not preempt (preemption.canceled, with the reason).

Several instances may run: requests and lifecycle facts are shared through PostgreSQL, and
the timer claims due rows with FOR UPDATE SKIP LOCKED, so no stop order is issued twice.
"""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import FastAPI

from services.common.bootstrap import open_outboxed
from services.common.consumer import Consumers, Records
from services.common.housekeeping import processed_events_pruner
from services.common.kafka import make_broker
from services.common.policyfile import load_policy
from services.common.runtime import Runtime, create_http_app
from services.preemptor import store
from services.preemptor.guards import Limits
from services.preemptor.handlers import Preemptor, PreemptorMetrics
from services.preemptor.intake import TOPICS
from services.preemptor.settings import PreemptorSettings

NAME = "preemptor"


def utcnow() -> datetime:
    return datetime.now(UTC)


def create_app(settings: PreemptorSettings | None = None) -> FastAPI:
    settings = settings or PreemptorSettings()
    runtime = Runtime(NAME, settings)
    broker = make_broker(settings, NAME, runtime.registry)
    policy = load_policy(settings.policy_file)
    limits = Limits.of(policy, time_scale=settings.time_scale, victim_wait_s=settings.victim_wait_s)
    metrics = PreemptorMetrics(runtime.registry)
    state: dict[str, Preemptor] = {}
    consumers = Consumers(broker, settings, service=NAME, registry=runtime.registry)

    async def handle(records: Records) -> None:
        await state["preemptor"].process(records)

    consumers.subscribe(*TOPICS, group_id=settings.group_id, handle=handle)

    async def timer_loop() -> None:
        await state["preemptor"].run_timer(settings.timer_interval_s, settings.answer_check_s)

    @runtime.on_startup
    async def start() -> None:
        # A preemption counts against its tenant's budget for the budget window.
        keep_s = max(
            settings.audit_retention_s, limits.wall(limits.budget_window_s).total_seconds()
        )
        pool, relay = await open_outboxed(
            runtime,
            broker,
            consumers,
            schema=store.SCHEMA,
            migrations=store.MIGRATIONS,
            pruners={
                # A request id is remembered as long as its preemption row: a replayed request
                # must find one or the other.
                "preemptor.processed_events": (processed_events_pruner(store.SCHEMA), keep_s),
                "preemptor.jobs": (store.prune_job_facts, keep_s),
                "preemptor.preemptions": (store.prune_preemptions, keep_s),
            },
        )
        state["preemptor"] = Preemptor(
            pool,
            relay,
            policy,
            limits,
            metrics,
            clock=utcnow,
            timer_batch=settings.timer_batch,
            stop_answer_timeout_s=settings.stop_answer_timeout_s,
        )
        runtime.background(timer_loop)
        await consumers.start()

    app = create_http_app(runtime)
    app.state.runtime = runtime
    app.state.broker = broker
    app.state.preemptor = state
    return app
