"""Start-up every outboxed service shares: its pool and migrated schema, the broker, the relay
(which first publishes whatever a crash left in the outbox) and the consumers' committer
and probe, with
their shutdown in the right order (commit, then stop consuming, then close the pool)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import asyncpg
from faststream.kafka import KafkaBroker

from services.common.consumer import Consumers
from services.common.db import create_pool, migrate
from services.common.housekeeping import Pruner, start_housekeeping
from services.common.outbox import OutboxRelay
from services.common.runtime import Runtime


async def open_outboxed(
    runtime: Runtime,
    broker: KafkaBroker,
    consumers: Consumers,
    *,
    schema: str,
    migrations: Path,
    pruners: Mapping[str, tuple[Pruner, float]] | None = None,
) -> tuple[asyncpg.Pool, OutboxRelay]:
    """Call from a start-up hook, before the service's own initialisation; start the broker
    (`await consumers.start()`) once that is done. Housekeeping prunes `processed_events` and
    whatever `pruners` (table -> pruner, retention in seconds) the service adds."""
    settings = runtime.settings
    pool = await create_pool(settings.database_url, settings.db_pool_size)
    await migrate(pool, schema, migrations)
    await broker.connect()
    consumers.probe = lambda: pool.fetchval("SELECT 1")
    relay = OutboxRelay(pool, broker, schema)
    await relay.flush()  # anything a crash left behind goes out before new work
    runtime.background(relay.run_forever)
    runtime.background(consumers.committer.run_forever)
    start_housekeeping(runtime, pool, schema, pruners)

    async def close() -> None:
        await consumers.committer.flush()
        await broker.stop()
        await pool.close()

    runtime.on_shutdown(close)
    return pool, relay
