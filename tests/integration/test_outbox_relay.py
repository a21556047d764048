"""The outbox relay against the real broker and PostgreSQL: an event the broker refuses for
good leaves the outbox as a dead letter with an alert, and its batch-mates are delivered."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest

from schemas import topics
from services.common.kafka import MAX_PRODUCER_BATCH, OutMessage, envelope_for, make_broker
from services.common.outbox import OutboxRelay, add_to_outbox
from services.common.settings import ServiceSettings
from tests.integration.kafka_tools import collect, every_record

pytestmark = pytest.mark.integration


async def create_outbox(db: asyncpg.Pool | asyncpg.Connection, schema: str) -> None:
    """A schema with an outbox table as every outboxed service has (common/outbox.py)."""
    await db.execute(
        f"CREATE SCHEMA {schema}; CREATE TABLE {schema}.outbox (id bigserial PRIMARY KEY, "
        "topic text NOT NULL, key text NOT NULL, event_type text NOT NULL, value bytea NOT NULL,"
        " created_at timestamptz NOT NULL DEFAULT now())"
    )


def cancels(run: str, reason: str, kind: type[OutMessage] = OutMessage) -> list[OutMessage]:
    """Three cancel requests for jobs `run`-0..2, keyed by their job ids."""
    return [
        kind(
            topics.JOB_CANCEL_REQUESTED,
            f"{run}-{i}",
            envelope_for(
                "JobCancelRequested",
                {"job_id": f"{run}-{i}", "requested_by": "relay-test", "reason": reason},
                producer="relay-test",
            ),
        )
        for i in range(3)
    ]


async def test_a_message_the_broker_refuses_is_dead_lettered_and_its_neighbours_go_out(
    topics_ready: str, fresh_database_url: str
) -> None:
    schema = "relay_test"
    pool = await asyncpg.create_pool(fresh_database_url, min_size=1, max_size=2)
    assert pool is not None
    await create_outbox(pool, schema)
    broker = make_broker(ServiceSettings(kafka_bootstrap=topics_ready), "relay-test")
    await broker.connect()
    run = uuid.uuid4().hex[:8]

    def cancel(job: str, reason: str) -> OutMessage:
        # A plain payload: the wire types would refuse a reason this long before any relay.
        event = {"job_id": job, "requested_by": "relay-test", "reason": reason}
        return OutMessage(
            topics.JOB_CANCEL_REQUESTED,
            job,
            envelope_for("JobCancelRequested", event, producer="relay-test"),
        )

    # Larger than the producer's max request: refused whatever is retried.
    huge = cancel(f"{run}-huge", "x" * (5 * MAX_PRODUCER_BATCH))
    small = [cancel(f"{run}-{i}", "fine") for i in range(3)]
    try:
        relay = OutboxRelay(pool, broker, schema)
        async with pool.acquire() as conn:
            staged = await add_to_outbox(conn, schema, [small[0], huge, *small[1:]])
        relay.committed(staged)
        assert await relay.publish_committed() == 4
        assert await pool.fetchval(f"SELECT count(*) FROM {schema}.outbox") == 0
        assert relay.unpublishable == 1

        def ours(topic: str, env: dict[str, Any]) -> bool:
            if topic == topics.ALERT_RAISED:
                return env["payload"].get("subject") == f"outbox/{schema}"
            return run in json.dumps(env)

        got = await collect(
            topics_ready,
            (topics.JOB_CANCEL_REQUESTED, topics.DEAD_LETTER, topics.ALERT_RAISED),
            ours,
            count=5,
            timeout_s=30,
        )
        by_topic: dict[str, list[dict[str, Any]]] = {}
        for topic, env in got:
            by_topic.setdefault(topic, []).append(env)
        delivered = {e["payload"]["job_id"] for e in by_topic[topics.JOB_CANCEL_REQUESTED]}
        assert delivered == {f"{run}-{i}" for i in range(3)}
        [letter] = by_topic[topics.DEAD_LETTER]
        assert letter["payload"]["reason"] == "unpublishable"
        assert letter["payload"]["source_topic"] == topics.JOB_CANCEL_REQUESTED
        assert letter["payload"]["size"] > 5 * MAX_PRODUCER_BATCH
        assert "MessageSizeTooLarge" in letter["payload"]["error"]
        [alert] = by_topic[topics.ALERT_RAISED]
        assert alert["payload"]["cause"] == "message_unpublishable"
        assert letter["event_id"] in alert["payload"]["suggested_action"]
    finally:
        await broker.stop()
        await pool.close()


async def test_rows_the_broker_has_are_not_sent_again_when_their_delete_failed(
    topics_ready: str, fresh_database_url: str
) -> None:
    """The database goes away between the broker's acknowledgement and the delete (here: the
    delete times out behind a lock): the rows stay, and the scan that finds them later deletes
    them without sending them a second time."""
    schema = "relay_resend"
    admin = await asyncpg.connect(fresh_database_url)
    await create_outbox(admin, schema)
    # A short statement timeout makes the delete fail (not hang) while the table is locked.
    pool = await asyncpg.create_pool(
        fresh_database_url, min_size=1, max_size=2, server_settings={"statement_timeout": "300"}
    )
    assert pool is not None
    broker = make_broker(ServiceSettings(kafka_bootstrap=topics_ready), "relay-test")
    await broker.connect()
    run = uuid.uuid4().hex[:8]
    messages = cancels(run, "r")
    try:
        relay = OutboxRelay(pool, broker, schema)
        async with pool.acquire() as conn:
            staged = await add_to_outbox(conn, schema, messages)
        relay.committed(staged)
        locker = admin.transaction()
        await locker.start()
        await admin.execute(f"LOCK TABLE {schema}.outbox IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(asyncpg.QueryCanceledError):
            await relay.publish_committed()
        await locker.rollback()
        assert await pool.fetchval(f"SELECT count(*) FROM {schema}.outbox") == 3
        assert await relay.flush(min_age_s=0) == 3  # found, deleted, not sent
        assert await pool.fetchval(f"SELECT count(*) FROM {schema}.outbox") == 0

        # Every record on the topic, duplicates included (collect() skips repeated ids).
        ids = sorted(
            env["payload"]["job_id"]
            for env in await every_record(topics_ready, topics.JOB_CANCEL_REQUESTED)
            if run in json.dumps(env)
        )
        assert ids == [f"{run}-{i}" for i in range(3)], ids
    finally:
        await broker.stop()
        await pool.close()
        await admin.close()


ENCODED: list[str] = []


@dataclass(frozen=True)
class CountedMessage(OutMessage):
    """An OutMessage that notes each time it is encoded."""

    def encode(self) -> bytes:
        ENCODED.append(self.key)
        return super().encode()


async def test_a_message_is_encoded_once_and_sent_as_its_row_holds_it(
    topics_ready: str, fresh_database_url: str
) -> None:
    """Encoding an event (pydantic's dump of the envelope and its payload) is a large part of
    what a service spends per event it announces: the relay sends the bytes written to the
    outbox row, it does not encode the message again."""
    schema = "relay_once"
    pool = await asyncpg.create_pool(fresh_database_url, min_size=1, max_size=2)
    assert pool is not None
    await create_outbox(pool, schema)
    broker = make_broker(ServiceSettings(kafka_bootstrap=topics_ready), "relay-test")
    await broker.connect()
    run = uuid.uuid4().hex[:8]
    messages = cancels(run, "once", CountedMessage)
    ENCODED.clear()
    try:
        relay = OutboxRelay(pool, broker, schema)
        async with pool.acquire() as conn, conn.transaction():
            staged = await add_to_outbox(conn, schema, messages)
            stored = {
                r["key"]: json.loads(r["value"])
                for r in await conn.fetch(f"SELECT key, value FROM {schema}.outbox")
            }
        relay.committed(staged)
        assert await relay.publish_committed() == 3
        sent = {
            env["payload"]["job_id"]: env
            for env in await every_record(topics_ready, topics.JOB_CANCEL_REQUESTED)
            if env.get("payload", {}).get("job_id", "").startswith(run)
        }
    finally:
        await broker.stop()
        await pool.close()
    assert sorted(ENCODED) == sorted(m.key for m in messages)
    assert sent == stored
