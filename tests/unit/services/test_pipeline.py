"""The consumer pipeline's failure classes: a record that can never be applied is isolated and
dead-lettered while its neighbours are applied in order; an outage is retried in place with
backoff, logged, counted and alerted, and nothing is given up during it."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Sequence
from typing import Any

import asyncpg
import pytest
from aiokafka import ConsumerRecord
from faststream.kafka import KafkaBroker
from prometheus_client import CollectorRegistry

from schemas import topics
from services.common.consumer import Consumers, Group
from services.common.errors import Failure, PermanentError, classify
from services.common.kafka import OutMessage
from services.common.settings import ServiceSettings


def record(value: bytes, offset: int, partition: int = 0) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topic=topics.JOB_SUBMITTED,
        partition=partition,
        offset=offset,
        timestamp=0,
        timestamp_type=0,
        key=b"k",
        value=value,
        checksum=None,
        serialized_key_size=1,
        serialized_value_size=len(value),
        headers=[],
    )


class Harness:
    """A group whose step 'stores' records unless they are poison, with a fake publisher."""

    def __init__(self, *, probe_fails: bool = False, alert_after_s: float = 60.0) -> None:
        self.registry = CollectorRegistry()
        self.consumers = Consumers(
            KafkaBroker(),
            ServiceSettings(),
            service="queue",
            registry=self.registry,
            stall_alert_after_s=alert_after_s,
            backoff_max_s=0.02,
        )
        self.published: list[OutMessage] = []
        self.consumers.publish = self._publish
        self.stored: list[int] = []
        self.calls = 0
        self.outage = 0  # how many more calls fail as if the database were restarting
        if probe_fails:
            self.consumers.probe = self._probe_fails

    async def _publish(self, messages: Sequence[OutMessage]) -> None:
        self.published.extend(messages)

    @staticmethod
    async def _probe_fails() -> None:
        raise ConnectionRefusedError("database is away")

    async def step(self, records: tuple[ConsumerRecord[Any, Any], ...]) -> None:
        self.calls += 1
        if self.outage:
            self.outage -= 1
            raise asyncpg.CannotConnectNowError("the database system is starting up")
        staged = []
        for r in records:
            if b"\x00" in (r.value or b""):
                # What PostgreSQL answers a NUL in a text value (class 22: data exception).
                raise asyncpg.UntranslatableCharacterError("unsupported Unicode escape sequence")
            if r.value == b"bug":
                raise KeyError("missing")
            staged.append(r.offset)
        self.stored.extend(staged)  # the transaction commits only if every record passed

    def group(self) -> Group:
        return self.consumers.group("queue", self.step, give_up=self.give_up)

    @staticmethod
    def give_up(r: ConsumerRecord[Any, Any], error: str) -> list[OutMessage]:
        from services.queue.intake import answer_given_up

        return answer_given_up(r, error)

    def sample(self, name: str) -> float:
        return self.registry.get_sample_value(name, {"group": "queue"}) or 0.0

    def of_topic(self, topic: str) -> list[dict[str, Any]]:
        return [json.loads(m.encode()) for m in self.published if m.topic == topic]


def test_which_failures_give_a_record_up() -> None:
    assert classify(asyncpg.UntranslatableCharacterError("nul")) is Failure.PERMANENT
    assert classify(asyncpg.UniqueViolationError("dup")) is Failure.PERMANENT
    assert classify(asyncpg.CannotConnectNowError("starting")) is Failure.RETRYABLE
    assert classify(asyncpg.SerializationError("conflict")) is Failure.RETRYABLE
    assert classify(asyncpg.InterfaceError("pool is closing")) is Failure.RETRYABLE
    assert classify(ConnectionRefusedError()) is Failure.RETRYABLE
    assert classify(TimeoutError()) is Failure.RETRYABLE
    assert classify(PermanentError("no")) is Failure.PERMANENT
    assert classify(KeyError("x")) is Failure.UNKNOWN


async def test_a_bad_record_is_isolated_and_its_neighbours_are_applied_in_order() -> None:
    h = Harness()
    batch = tuple(record(b'{"ok": %d}' % i, i) for i in range(8))
    poison = record(b'{"tenant": "a\x00b"}', 8)
    tail = tuple(record(b'{"ok": %d}' % i, i) for i in range(9, 12))
    await h.group().run((*batch, poison, *tail))

    assert h.stored == [*range(8), *range(9, 12)]
    [dead] = h.of_topic(topics.DEAD_LETTER)
    assert dead["payload"]["offset"] == 8
    assert dead["payload"]["reason"] == "unprocessable"
    assert "UntranslatableCharacterError" in dead["payload"]["error"]
    assert base64.b64decode(dead["payload"]["value_base64"]) == poison.value
    assert "\x00" not in dead["payload"]["value"]  # shown escaped, storable anywhere
    [rejected] = h.of_topic(topics.JOB_REJECTED)
    assert rejected["payload"]["reason_code"] == "unprocessable"
    assert h.sample("qm_consumer_dead_letters_total") == 1
    assert h.sample("qm_consumer_split_batches_total") >= 1


async def test_an_outage_is_retried_in_place_and_nothing_is_given_up() -> None:
    h = Harness()
    h.outage = 4
    await h.group().run(tuple(record(b"{}", i) for i in range(3)))
    assert h.stored == [0, 1, 2]
    assert h.calls == 5
    assert h.published == []
    assert h.sample("qm_consumer_retries_total") == 4
    assert h.sample("qm_consumer_stalled_seconds") == 0  # back to 0 once it passed


async def test_an_unknown_error_is_retried_while_the_stores_are_away() -> None:
    h = Harness(probe_fails=True)
    group = h.group()
    task = asyncio.create_task(group.run((record(b"bug", 0),)))
    async with asyncio.timeout(30):  # a failure to report, never a hang
        while h.calls < 3 and not task.done():  # noqa: ASYNC110 (polling a plain counter)
            await asyncio.sleep(0.01)
    assert not task.done(), task  # a bug during an outage is not taken for a bad record
    assert h.published == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):  # a lost cancellation fails here instead of hanging
            await task


async def test_a_shutdown_while_the_probe_fails_is_not_lost() -> None:
    """The cancellation (a shutdown) arrives just as the probe fails: asyncio.wait_for on
    Python 3.11 returned the probe's error instead, and the retry loop never ended."""
    h = Harness()
    group = h.group()
    task: asyncio.Task[None] | None = None

    async def probe_fails_as_shutdown_comes() -> None:
        assert task is not None
        task.cancel()
        raise ConnectionRefusedError("database is away")

    h.consumers.probe = probe_fails_as_shutdown_comes
    task = asyncio.create_task(group.run((record(b"bug", 0),)))
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10):
            await task
    assert h.published == []


async def test_an_unknown_error_gives_the_record_up_when_the_stores_answer() -> None:
    h = Harness()
    await h.group().run((record(b"{}", 0), record(b"bug", 1)))
    assert h.stored == [0]
    [dead] = h.of_topic(topics.DEAD_LETTER)
    assert dead["payload"]["offset"] == 1 and "KeyError" in dead["payload"]["error"]


async def test_a_stall_raises_one_alert() -> None:
    h = Harness(alert_after_s=0.05)
    h.outage = 12
    await h.group().run((record(b"{}", 0),))
    alerts = h.of_topic(topics.ALERT_RAISED)
    assert len(alerts) == 1
    assert alerts[0]["payload"]["cause"] == "consumer_stalled"
    assert "job.submitted[0]" in alerts[0]["payload"]["suggested_action"]
    assert h.sample("qm_consumer_alerts_total") == 1
    assert h.stored == [0]


async def test_a_dead_letter_is_retried_until_the_broker_takes_it() -> None:
    h = Harness()
    failures = 3

    async def flaky(messages: Sequence[OutMessage]) -> None:
        nonlocal failures
        if failures:
            failures -= 1
            raise ConnectionResetError("broker away")
        h.published.extend(messages)

    h.consumers.publish = flaky
    await h.group().run((record(b"bug", 0),))
    assert len(h.of_topic(topics.DEAD_LETTER)) == 1
    assert h.sample("qm_consumer_retries_total") == 3
