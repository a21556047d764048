"""Pruning the tables that would otherwise only grow.

Every outboxed service remembers the event ids it has processed (`processed_events`), to skip
redeliveries. A redelivery is a record read again after a crash or a rebalance, from the last
committed offset: minutes old, not months. Ids older than `processed_retention_s` (30 days)
go, which holds as long as no consumer group re-reads further back than that (its committed
offsets must not expire: see ServiceSettings). A service may add pruners of its own (the
preemptor's job facts and finished preemptions).

The loop runs every `housekeeping_every_s`, each pruner in its own transaction and in chunks, so
it never holds locks the consumers need for long; what one instance deleted another finds gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta

import asyncpg
import structlog
from prometheus_client import CollectorRegistry, Counter

from services.common.runtime import Runtime

log = structlog.get_logger()

# (connection, cut-off, chunk) -> rows deleted: at most `chunk` rows older than the cut-off.
Pruner = Callable[[asyncpg.Connection, datetime, int], Awaitable[int]]
CHUNK = 5000


def rows_pruner(table: str, key: str, old: str) -> Pruner:
    """Deletes a chunk of `table`'s rows (by primary key `key`) for which the SQL condition
    `old` holds; `$1` in it is the cut-off time."""

    async def prune(conn: asyncpg.Connection, before: datetime, chunk: int) -> int:
        status = await conn.execute(
            f"DELETE FROM {table} WHERE {key} IN (SELECT {key} FROM {table} WHERE {old} LIMIT $2)",
            before,
            chunk,
        )
        return int(status.split()[-1])

    return prune


def processed_events_pruner(schema: str) -> Pruner:
    return rows_pruner(f'"{schema}".processed_events', "event_id", "processed_at < $1")


class Housekeeping:
    """Runs pruners, each with its own retention, until nothing older is left."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        pruners: Mapping[str, tuple[Pruner, float]],
        registry: CollectorRegistry,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        chunk: int = CHUNK,
    ) -> None:
        self.pool = pool
        self.chunk = chunk
        self.pruners = dict(pruners)  # table name -> (pruner, retention in seconds)
        self.clock = clock
        self.pruned = Counter(
            "qm_rows_pruned_total",
            "Rows deleted by housekeeping, past their retention",
            ["table"],
            registry=registry,
        )

    async def run_once(self) -> dict[str, int]:
        now = self.clock()
        done: dict[str, int] = {}
        for table, (prune, retention_s) in self.pruners.items():
            before = now - timedelta(seconds=retention_s)
            total = 0
            while True:
                async with self.pool.acquire() as conn, conn.transaction():
                    deleted = await prune(conn, before, self.chunk)
                total += deleted
                if deleted < self.chunk:
                    break
            done[table] = total
            if total:
                self.pruned.labels(table).inc(total)
                log.info("pruned", table=table, rows=total, older_than=before.isoformat())
        return done

    async def run_forever(self, every_s: float) -> None:
        while True:
            try:
                await self.run_once()
            except (asyncpg.PostgresError, OSError):
                log.warning("housekeeping failed; will retry", exc_info=True)
            await asyncio.sleep(every_s)


def start_housekeeping(
    runtime: Runtime,
    pool: asyncpg.Pool,
    schema: str,
    pruners: Mapping[str, tuple[Pruner, float]] | None = None,
) -> Housekeeping:
    """Prune the service's `processed_events` and whatever else `pruners` name, in the
    background, every `housekeeping_every_s`."""
    settings = runtime.settings
    housekeeping = Housekeeping(
        pool,
        {
            f"{schema}.processed_events": (
                processed_events_pruner(schema),
                settings.processed_retention_s,
            ),
            **(pruners or {}),
        },
        runtime.registry,
    )

    async def housekeeping_loop() -> None:
        await housekeeping.run_forever(settings.housekeeping_every_s)

    runtime.background(housekeeping_loop)
    return housekeeping
