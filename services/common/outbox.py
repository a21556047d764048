"""Transactional outbox and idempotent consumption on a service's own schema.

A handler writes its state change, the ids of the events it consumed and the events it will
announce in one transaction; the relay then publishes the outbox and deletes what the broker
acknowledged. A crash anywhere leaves either nothing done (the batch is redelivered) or the
outbox rows still there (published on the next flush). Consumers therefore see duplicates,
never gaps, and dedupe by event id.

Each owning schema has (see a service's migrations):
  outbox(id bigserial primary key, topic, key, event_type, value bytea, created_at)
  processed_events(event_id text primary key, processed_at timestamptz)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

import asyncpg
import structlog
from faststream.kafka import KafkaBroker

from schemas import topics
from services.common.deadletter import dead_letter_for_message, platform_alert
from services.common.errors import describe, refused_for_good
from services.common.kafka import OutMessage, send_each
from services.common.tracing import traceparent_in

log = structlog.get_logger()

_NO_ID = 2**63 - 1  # above every bigserial id: nothing in flight

# One message as the relay sends it: topic, key, event type, value, and its trace context
# (services.common.tracing), which rides in the value's envelope and goes out as a header too.
Row = tuple[str, str, str, bytes, str | None]


def row_of(message: OutMessage) -> Row:
    m = message
    return m.topic, m.key, m.envelope.type, m.encode(), m.envelope.traceparent


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


@dataclass(frozen=True)
class Staged:
    """Messages written to the outbox in an open transaction, as written (each encoded once:
    the relay sends the very bytes the row holds), with their row ids."""

    rows: tuple[Row, ...] = ()
    ids: tuple[int, ...] = ()


async def add_to_outbox(
    conn: asyncpg.Connection, schema: str, messages: Iterable[OutMessage]
) -> Staged:
    rows = tuple(row_of(m) for m in messages)
    if not rows:
        return Staged()
    written = await conn.fetch(
        f'INSERT INTO "{schema}".outbox (topic, key, event_type, value) '
        "SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[]) RETURNING id",
        [r[0] for r in rows],
        [r[1] for r in rows],
        [r[2] for r in rows],
        [r[3] for r in rows],
    )
    return Staged(rows, tuple(sorted(r["id"] for r in written)))


class Transaction:
    """One open transaction of a service's batch step: claim the consumed event ids, write
    the step's effects on `conn`, and `emit` the events to announce; they go to the outbox in
    the same transaction (see OutboxRelay.transaction)."""

    def __init__(self, conn: asyncpg.Connection, schema: str) -> None:
        self.conn = conn
        self.schema = schema
        self.out: list[OutMessage] = []

    async def claim(self, event_ids: Sequence[str]) -> set[str]:
        """The ids not seen before; they count as processed once this transaction commits."""
        return await claim_events(self.conn, self.schema, event_ids)

    def emit(self, messages: Iterable[OutMessage]) -> None:
        self.out.extend(messages)


class OutboxRelay:
    """Publishes a schema's outbox, in order, and deletes what the broker acknowledged.

    The fast path: after its transaction commits, a handler hands the staged messages to
    `committed()`; they go out from memory at once (no read back) and their rows are deleted
    afterwards. The slow path scans the table for rows nobody is publishing: at start-up
    (left by a crash) and every `interval_s` for rows older than
    `stale_after_s` (a failed publish or delete).
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        broker: KafkaBroker,
        schema: str,
        batch: int = 2000,
        stale_after_s: float = 2.0,
    ) -> None:
        self._pool = pool
        self._broker = broker
        self._schema = schema
        self._batch = batch
        self._stale_after_s = stale_after_s
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._queue: list[Staged] = []
        self._inflight: set[int] = set()
        # Rows the broker has but whose delete failed (the database went away between the
        # two): the scan deletes them without sending them again. Only a crash in that
        # window sends a row twice (consumers dedupe by event id).
        self._sent: set[int] = set()
        self.unpublishable = 0  # events the broker refused for good (dead-lettered)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        """The one transaction shape every outboxed step uses: effects, processed ids and
        outbox commit together, and the outbox goes out at once after the commit. An error
        inside rolls everything back (the consumer pipeline then retries or isolates).
        READ COMMITTED whatever the server's default: a step that waits on a lock (the queue's
        per-job advisory locks) reads what the previous holder committed in its next statement."""
        async with self._pool.acquire() as conn, conn.transaction(isolation="read_committed"):
            tx = Transaction(conn, self._schema)
            yield tx
            staged = await add_to_outbox(conn, self._schema, tx.out)
        self.committed(staged)

    def committed(self, staged: Staged) -> None:
        """Publish these now; their transaction has committed."""
        if staged.ids:
            self._queue.append(staged)
            self._inflight.update(staged.ids)
            self._wake.set()

    async def _publish(self, messages: Sequence[Row]) -> None:
        """Send `messages` and wait for the broker. A message the broker (or the producer)
        refuses for good, e.g. too large, leaves as a dead letter with an alert, so it cannot
        hold its batch-mates back; any other failure raises (all are tried again later)."""
        outcomes = await self._send(messages)
        refused = [
            (msg, exc)
            for msg, exc in zip(messages, outcomes, strict=True)
            if exc is not None and refused_for_good(exc)
        ]
        retry = [exc for exc in outcomes if exc is not None and not refused_for_good(exc)]
        if refused:
            notices = [n for msg, exc in refused for n in self._unpublishable(msg, exc)]
            failed = [exc for exc in await self._send(notices) if exc is not None]
            if failed:
                raise failed[0]
        if retry:
            raise retry[0]

    async def _send(self, messages: Sequence[Row]) -> list[BaseException | None]:
        """The outcome of each message: None once the broker has it, else the error."""
        return await send_each(
            self._broker,
            [
                (topic, key, value, _headers(kind, trace), None)
                for topic, key, kind, value, trace in messages
            ],
        )

    def _unpublishable(self, message: Row, exc: BaseException) -> list[Row]:
        topic, key, event_type, value, _trace = message
        error = describe(exc)
        producer = f"{self._schema}-outbox"
        log.error(
            "the broker refused an event; dead-lettered",
            topic=topic,
            key=key[:200],
            event_type=event_type,
            size=len(value),
            error=error,
        )
        letter = dead_letter_for_message(topic, key, value, error, producer=producer)
        notice = platform_alert(
            alert_id=f"unpublishable/{letter.envelope.event_id}",
            subject=f"outbox/{self._schema}",
            cause="message_unpublishable",
            action=(
                f"The broker refused a {event_type} of {len(value):,} bytes for {topic} "
                f"({error}); it is on {topics.DEAD_LETTER} (event {letter.envelope.event_id}). "
                "Raise the topic's message size limit or shrink what produced it, then replay."
            ),
            producer=producer,
        )
        self.unpublishable += 1
        return [row_of(m) for m in (letter, notice)]

    async def publish_committed(self) -> int:
        """Send what handlers staged, in commit order, then delete those rows."""
        async with self._lock:
            queued, self._queue = self._queue, []
            if not queued:
                return 0
            ids = [i for st in queued for i in st.ids]
            try:
                await self._publish([row for st in queued for row in st.rows])
                try:
                    await self._pool.execute(
                        f'DELETE FROM "{self._schema}".outbox WHERE id = ANY($1::bigint[])', ids
                    )
                except BaseException:
                    self._sent.update(ids)
                    raise
            finally:
                # Published or not, the rows are the scan's business from here on.
                self._inflight.difference_update(ids)
            return len(ids)

    async def flush(self, *, min_age_s: float = 0.0) -> int:
        """Publish rows from the table until none (older than `min_age_s`) is left."""
        total = 0
        async with self._lock:
            while True:
                sent = await self._flush_once(min_age_s)
                total += sent
                if sent < self._batch:
                    break
        return total

    async def _flush_once(self, min_age_s: float) -> int:
        published: list[int] = []
        try:
            return await self._scan(min_age_s, published)
        except BaseException:
            # Sent, but the delete did not commit (the database went away): not again.
            self._sent.update(published)
            raise

    async def _scan(self, min_age_s: float, published: list[int]) -> int:
        async with self._pool.acquire() as conn, conn.transaction():
            # SKIP LOCKED lets several replicas of a service relay without sending a row twice.
            # Only rows older than the oldest one in flight: an index range, where excluding
            # the in-flight ids one by one cost PostgreSQL rows x in-flight comparisons on
            # every scan under load. A stale row newer than that waits until the backlog in
            # flight has gone out (seconds), then goes.
            below = min(self._inflight, default=_NO_ID)
            rows = await conn.fetch(
                f'DELETE FROM "{self._schema}".outbox WHERE id IN ('
                f'SELECT id FROM "{self._schema}".outbox WHERE id < $2 '
                "AND created_at <= now() - make_interval(secs => $3) "
                "ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED) "
                "RETURNING id, topic, key, event_type, value",
                self._batch,
                below,
                min_age_s,
            )
            if not rows:
                return 0
            rows = sorted(rows, key=lambda r: r["id"])
            # The delete commits only once the broker has every message.
            # Rows left by a crash or a failed publish: the trace context is read back from
            # the stored envelope (no column for it; this path is rare).
            values = {r["id"]: bytes(r["value"]) for r in rows if r["id"] not in self._sent}
            await self._publish(
                [
                    (r["topic"], r["key"], r["event_type"], v, traceparent_in(v))
                    for r in rows
                    if (v := values.get(r["id"])) is not None
                ]
            )
            published += [r["id"] for r in rows]
        self._sent.difference_update(published)
        return len(rows)

    async def run_forever(self, interval_s: float = 1.0) -> None:
        loop = asyncio.get_running_loop()
        last_scan = loop.time()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval_s)
            self._wake.clear()
            try:
                await self.publish_committed()
                # The scan runs every interval even under steady load (when the relay is
                # always woken), so a row whose publish failed is never left behind.
                if loop.time() - last_scan >= interval_s:
                    last_scan = loop.time()
                    await self.flush(min_age_s=self._stale_after_s)
            except Exception:
                log.warning("outbox relay failed; will retry", exc_info=True)
                await asyncio.sleep(0.2)


def _headers(event_type: str, traceparent: str | None) -> tuple[tuple[str, str], ...]:
    if traceparent is None:
        return (("type", event_type),)
    return (("type", event_type), ("traceparent", traceparent))
