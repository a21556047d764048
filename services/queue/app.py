"""The queue service: validates and dedupes submissions, persists jobs, tracks their lifecycle."""

from __future__ import annotations

from fastapi import FastAPI

from services.common.bootstrap import open_outboxed
from services.common.consumer import Consumers, Records
from services.common.kafka import make_broker
from services.common.policyfile import load_policy
from services.common.runtime import Runtime, create_http_app
from services.queue import store
from services.queue.handlers import QueueMetrics, QueueProcessor
from services.queue.intake import LIFECYCLE_TOPICS, REQUEST_TOPICS, answer_given_up
from services.queue.settings import QueueSettings

NAME = "queue"


def create_app(settings: QueueSettings | None = None) -> FastAPI:
    settings = settings or QueueSettings()
    runtime = Runtime(NAME, settings)
    broker = make_broker(settings, NAME, runtime.registry)
    policy = load_policy(settings.policy_file)
    metrics = QueueMetrics(runtime.registry)
    state: dict[str, QueueProcessor] = {}

    consumers = Consumers(broker, settings, service=NAME, registry=runtime.registry)

    async def handle(records: Records) -> None:
        await state["processor"].process(records)

    consumers.subscribe(
        *REQUEST_TOPICS,
        group_id=settings.group_id,
        handle=handle,
        give_up=answer_given_up,
        linger_ms=0,  # new work goes on at once
    )
    # Lifecycle events are not on any job's way to a placement: fetch them less eagerly.
    consumers.subscribe(
        *LIFECYCLE_TOPICS,
        group_id=f"{settings.group_id}-lifecycle",
        handle=handle,
        fetch_max_wait_ms=settings.lifecycle_fetch_max_wait_ms,
        linger_ms=settings.lifecycle_linger_ms,
    )

    @runtime.on_startup
    async def start() -> None:
        pool, relay = await open_outboxed(
            runtime, broker, consumers, schema=store.SCHEMA, migrations=store.MIGRATIONS
        )
        state["processor"] = QueueProcessor(
            pool,
            relay,
            policy,
            metrics,
            time_scale=settings.time_scale,
            tracing=runtime.tracing,
        )
        await consumers.start()

    app = create_http_app(runtime)
    app.state.runtime = runtime
    app.state.broker = broker
    return app
