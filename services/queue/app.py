"""The queue service: validates and dedupes submissions, persists jobs, tracks their lifecycle."""

from __future__ import annotations

from fastapi import FastAPI
from faststream.kafka.annotations import KafkaMessage

from services.common.db import create_pool
from services.common.kafka import batch_subscriber, make_broker, records_of
from services.common.outbox import OutboxRelay
from services.common.policyfile import load_policy
from services.common.runtime import Runtime, create_http_app
from services.queue import store
from services.queue.handlers import QueueMetrics, QueueProcessor
from services.queue.intake import LIFECYCLE_TOPICS, REQUEST_TOPICS
from services.queue.settings import QueueSettings

NAME = "queue"


def create_app(settings: QueueSettings | None = None) -> FastAPI:
    settings = settings or QueueSettings()
    runtime = Runtime(NAME, settings)
    broker = make_broker(settings, NAME, runtime.registry)
    policy = load_policy(settings.policy_file)
    metrics = QueueMetrics(runtime.registry)
    state: dict[str, QueueProcessor] = {}

    @batch_subscriber(broker, *REQUEST_TOPICS, group_id=settings.group_id, settings=settings)
    async def on_requests(message: KafkaMessage) -> None:
        await state["processor"].process(records_of(message))

    # Lifecycle events are not on any job's way to a placement: fetch them less eagerly.
    @batch_subscriber(
        broker,
        *LIFECYCLE_TOPICS,
        group_id=f"{settings.group_id}-lifecycle",
        settings=settings,
        fetch_max_wait_ms=settings.lifecycle_fetch_max_wait_ms,
    )
    async def on_lifecycle(message: KafkaMessage) -> None:
        await state["processor"].process(records_of(message))

    @runtime.on_startup
    async def start() -> None:
        pool = await create_pool(settings.database_url, settings.db_pool_size)
        await store.migrate_queue(pool)
        await broker.connect()
        relay = OutboxRelay(pool, broker, store.SCHEMA)
        await relay.flush()  # anything a crash left behind goes out before new work
        state["processor"] = QueueProcessor(pool, relay, policy, metrics)
        runtime.background(relay.run_forever)
        await broker.start()

        async def close() -> None:
            await broker.stop()
            await pool.close()

        runtime.on_shutdown(close)

    app = create_http_app(runtime)
    app.state.runtime = runtime
    app.state.broker = broker
    return app
