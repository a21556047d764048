"""Transactional outbox and idempotent consumption on a service's own schema.

A handler writes its state change, the ids of the events it consumed and the events it will
announce in one transaction; the relay then publishes the outbox and deletes what the broker
acknowledged. A crash anywhere leaves either nothing done (the batch is redelivered) or the
outbox rows still there (published on the next flush). Consumers therefore see duplicates,
never gaps, and dedupe by event id.

Each owning schema has:
  outbox(id bigserial primary key, topic text, key text, value bytea, event_type text)
  processed_events(event_id text primary key, processed_at timestamptz)
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import asyncpg
import structlog
from faststream.kafka import KafkaBroker

from services.common.kafka import OutMessage

log = structlog.get_logger()

OUTBOX_DDL = """
CREATE TABLE IF NOT EXISTS outbox (
    id bigserial PRIMARY KEY,
    topic text NOT NULL,
    key text NOT NULL,
    event_type text NOT NULL,
    value bytea NOT NULL
);
CREATE TABLE IF NOT EXISTS processed_events (
    event_id text PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);
"""


async def claim_events(conn: asyncpg.Connection, schema: str, event_ids: Sequence[str]) -> set[str]:
    """Record these event ids as processed; return the ones not seen before (inside the txn)."""
    if not event_ids:
        return set()
    rows = await conn.fetch(
        f'INSERT INTO "{schema}".processed_events (event_id) SELECT unnest($1::text[]) '
        "ON CONFLICT DO NOTHING RETURNING event_id",
        list(event_ids),
    )
    return {r["event_id"] for r in rows}


async def add_to_outbox(
    conn: asyncpg.Connection, schema: str, messages: Iterable[OutMessage]
) -> int:
    rows = [(m.topic, m.key, m.envelope.type, m.encode()) for m in messages]
    if rows:
        await conn.copy_records_to_table(
            "outbox",
            schema_name=schema,
            records=rows,
            columns=["topic", "key", "event_type", "value"],
        )
    return len(rows)


class OutboxRelay:
    """Publishes a schema's outbox in id order. One flush at a time per process."""

    def __init__(
        self, pool: asyncpg.Pool, broker: KafkaBroker, schema: str, batch: int = 2000
    ) -> None:
        self._pool = pool
        self._broker = broker
        self._schema = schema
        self._batch = batch
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self.published = 0
        # Published rows are deleted, but their index entries linger until vacuum: starting
        # each kicked scan after the last id we sent keeps a busy outbox from rescanning them.
        # Ids are drawn before commit, so a slower transaction can commit a lower id later;
        # the periodic full scan (from 0) publishes those.
        self._after_id = 0

    def kick(self) -> None:
        """Ask the relay loop to flush now. Handlers call this after their transaction commits
        instead of awaiting the broker themselves, so the next batch is not held up by it."""
        self._wake.set()

    async def flush(self, *, full: bool = True) -> int:
        """Publish until the outbox is empty; returns how many messages went out. `full`
        scans from the first row, otherwise from after the last one published."""
        total = 0
        async with self._lock:
            if full:
                self._after_id = 0
            while True:
                sent = await self._flush_once()
                total += sent
                if sent < self._batch:
                    break
        self.published += total
        return total

    async def _flush_once(self) -> int:
        async with self._pool.acquire() as conn, conn.transaction():
            # SKIP LOCKED lets several replicas of a service relay without sending a row twice.
            rows = await conn.fetch(
                f'DELETE FROM "{self._schema}".outbox WHERE id IN ('
                f'SELECT id FROM "{self._schema}".outbox WHERE id > $2 ORDER BY id LIMIT $1 '
                "FOR UPDATE SKIP LOCKED) RETURNING id, topic, key, event_type, value",
                self._batch,
                self._after_id,
            )
            if not rows:
                return 0
            rows = sorted(rows, key=lambda r: r["id"])
            futures = []
            for r in rows:
                fut = await self._broker.publish(
                    bytes(r["value"]),
                    r["topic"],
                    key=r["key"].encode(),
                    headers={"type": r["event_type"]},
                    no_confirm=True,
                )
                futures.append(fut)
            # The delete commits only once the broker has every message.
            await asyncio.gather(*futures)  # type: ignore[arg-type]
        self._after_id = rows[-1]["id"]
        return len(rows)

    async def run_forever(self, interval_s: float = 1.0) -> None:
        """Flush whenever kicked, and every `interval_s` anyway (rows left by a crash or a
        failed flush)."""
        while True:
            kicked = True
            try:
                await asyncio.wait_for(self._wake.wait(), interval_s)
            except TimeoutError:
                kicked = False
            self._wake.clear()
            try:
                await self.flush(full=not kicked)
            except Exception:
                log.warning("outbox flush failed; will retry", exc_info=True)
                await asyncio.sleep(0.2)
