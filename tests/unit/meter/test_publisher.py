"""The meter's batch publisher when the broker refuses or goes away, against a producer that
does what aiokafka's does with batches (a batch takes messages until it is full, the first
always) and fails as scripted. The real broker's path is tests/integration/
test_meter_publisher.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, RecordListTooLargeError

from services.common.kafka import Wire, send_each
from services.meter.publisher import BatchPublisher

TOPIC = "usage.tick"


class Batch:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.values: list[bytes] = []
        self.size = 0

    def append(self, *, key: bytes, value: bytes, timestamp: Any, headers: Any) -> object | None:
        if not isinstance(value, bytes):
            raise TypeError("value must be bytes")
        if self.values and self.size + len(value) > self.limit:
            return None
        self.values.append(value)
        self.size += len(value)
        return object()


class Producer:
    """Sends batches; a batch holding `refused` is refused for good, and every batch after
    the `away_after`-th fails as if the broker were gone."""

    def __init__(self, *, limit: int = 100, refused: bytes = b"", away_after: int = -1) -> None:
        self.limit = limit
        self.refused = refused
        self.away_after = away_after
        self.sent: list[tuple[int, list[bytes]]] = []
        self.batches = 0

    async def partitions_for(self, topic: str) -> set[int]:
        if topic != TOPIC:
            raise KafkaTimeoutError(f"no metadata for {topic}")
        return {0, 1, 2}

    def create_batch(self) -> Batch:
        return Batch(self.limit)

    async def send_batch(self, batch: Batch, topic: str, partition: int) -> asyncio.Future[Any]:
        self.batches += 1
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if 0 <= self.away_after < self.batches:
            done.set_exception(KafkaConnectionError("broker away"))
        elif self.refused and self.refused in batch.values:
            done.set_exception(RecordListTooLargeError("refused"))
        else:
            self.sent.append((partition, list(batch.values)))
            done.set_result(None)
        return done


def wires(values: list[bytes], key: str = "vision", topic: str = TOPIC) -> list[Wire]:
    return [(topic, key, v, (("type", "UsageTick"),), None) for v in values]


def delivered(producer: Producer) -> list[bytes]:
    return [v for _, values in producer.sent for v in values]


async def test_a_refused_batch_is_sent_again_one_by_one_and_only_the_culprit_fails() -> None:
    producer = Producer(limit=30, refused=b"poison")
    values = [f"v{i:02d}".encode() for i in range(20)]
    values.insert(7, b"poison")
    outcomes = await send_each(BatchPublisher(producer), wires(values))  # type: ignore[arg-type]
    assert isinstance(outcomes[7], RecordListTooLargeError)
    assert [o for i, o in enumerate(outcomes) if i != 7] == [None] * 20
    assert delivered(producer) == [v for v in values if v != b"poison"]  # in order


async def test_the_broker_away_fails_that_batch_and_the_rest_of_its_partition_only() -> None:
    producer = Producer(limit=20, away_after=1)
    values = [f"value-{i:04d}".encode() for i in range(10)]  # 10 bytes each: two a batch
    outcomes = await send_each(BatchPublisher(producer), wires(values))  # type: ignore[arg-type]
    assert outcomes[:2] == [None, None]  # the first batch was acknowledged
    assert all(isinstance(o, KafkaConnectionError) for o in outcomes[2:])
    assert delivered(producer) == values[:2]


async def test_a_topic_without_metadata_fails_its_messages_not_the_call() -> None:
    producer = Producer()
    batch = wires([b"a", b"b"]) + wires([b"c"], topic="no.such.topic") + wires([b"d"])
    outcomes = await send_each(BatchPublisher(producer), batch)  # type: ignore[arg-type]
    assert outcomes[0] is None and outcomes[1] is None and outcomes[3] is None
    assert isinstance(outcomes[2], KafkaTimeoutError)
    assert delivered(producer) == [b"a", b"b", b"d"]


async def test_publish_futures_never_hang_when_a_batch_cannot_be_built() -> None:
    """A batch that cannot be built fails its messages (none was sent); none is left
    waiting, and messages of other partitions go out."""
    producer = Producer()
    publisher = BatchPublisher(producer)  # type: ignore[arg-type]
    keys = {await publisher._partition(TOPIC, k.encode()): k for k in ("a", "b", "c", "d", "e")}
    bad_key, good_key = list(keys.values())[:2]
    bad = await publisher.publish("text", TOPIC, key=bad_key.encode(), headers={"type": "X"})  # type: ignore[arg-type]
    good = await publisher.publish(b"fine", TOPIC, key=good_key.encode(), headers={"type": "X"})
    results = await asyncio.wait_for(asyncio.gather(bad, good, return_exceptions=True), 5)
    assert isinstance(results[0], TypeError)
    assert results[1] is None
    assert delivered(producer) == [b"fine"]


@pytest.mark.parametrize("size", [10, 1000])
async def test_every_message_of_a_partition_arrives_once_in_order(size: int) -> None:
    producer = Producer(limit=size)
    values = [f"m{i:03d}".encode() for i in range(200)]
    outcomes = await send_each(BatchPublisher(producer), wires(values))  # type: ignore[arg-type]
    assert outcomes == [None] * 200
    assert delivered(producer) == values
