"""Publishing the meter's outbox in batches. Through FastStream's broker, or even aiokafka's
`send`, each message costs tens of microseconds, which at tens of thousands of ticks a second
was most of the meter's CPU. This publisher takes a relay's whole batch (`send_many`, or
`publish` calls gathered until the relay yields) and sends it as aiokafka batches, one per
partition, keyed exactly as aiokafka's default partitioner would (murmur2 of the key,
services.common.partitioner), so per-tenant order and partitioning are unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError

from services.common.errors import refused_for_good
from services.common.kafka import MAX_PRODUCER_BATCH, Outcome, Wire
from services.common.partitioner import KeyPartitioner, partition_of

Pending = tuple[bytes, bytes, Sequence[tuple[str, bytes]], asyncio.Future[Any]]
# A message of `send_many`: its index in the call, key, value and encoded headers.
Item = tuple[int, bytes, bytes, Sequence[tuple[str, bytes]]]
MAX_KEYS = 10_000  # partitions and encoded headers kept per publisher
MAX_REQUEST = 4 * MAX_PRODUCER_BATCH  # the producer's max_request_size (relay_producer)


def relay_producer(bootstrap: str, client_id: str) -> AIOKafkaProducer:
    """A producer with the settings of the broker factory (large batches, acks=all)."""
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        client_id=client_id,
        max_batch_size=MAX_PRODUCER_BATCH,
        max_request_size=MAX_REQUEST,
        linger_ms=1,
        acks="all",
        partitioner=KeyPartitioner(),
    )


class BatchPublisher:
    """What OutboxRelay needs of a broker: `publish(value, topic, key=, headers=)` returning a
    future that completes when the broker has the message, and `send_many(wires)`, which
    `services.common.kafka.send_each` prefers: every message of a relay's batch handed over at
    once, with an outcome per message and no future or coroutine per message."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self._partitions: dict[str, list[int]] = {}
        self._keyed: dict[tuple[str, bytes], int] = {}
        self._headers: dict[tuple[tuple[str, str], ...], list[tuple[str, bytes]]] = {}
        self._pending: dict[tuple[str, int], list[Pending]] = {}
        self._scheduled = False

    async def _partition(self, topic: str, key: bytes) -> int:
        """The partition aiokafka's default partitioner picks (murmur2 of the key), kept per
        key: the hash is Python, and a tick's key is its tenant."""
        found = self._keyed.get((topic, key))
        if found is not None:
            return found
        partitions = self._partitions.get(topic)
        if partitions is None:
            partitions = self._partitions[topic] = sorted(await self.producer.partitions_for(topic))
        if len(self._keyed) >= MAX_KEYS:
            self._keyed.clear()
        chosen = partition_of(key, partitions)
        self._keyed[(topic, key)] = chosen
        return chosen

    def _encoded(self, headers: Sequence[tuple[str, str]]) -> list[tuple[str, bytes]]:
        key = tuple(headers)
        found = self._headers.get(key)
        if found is None:
            if len(self._headers) >= MAX_KEYS:
                self._headers.clear()
            found = self._headers[key] = [(k, v.encode()) for k, v in headers]
        return found

    async def send_many(self, messages: Sequence[Wire]) -> list[Outcome]:
        """Send every message, one batch per partition (or more when one is full), and wait
        for the broker; the outcome of each, in order (None once the broker has it). It never
        raises for a message: every failure is that message's outcome. (`send_each`'s `stop`
        does not apply: the batches of one partition stop at a failure by themselves.)"""
        outcomes: list[Outcome] = [None] * len(messages)
        groups: dict[tuple[str, int], list[Item]] = {}
        for i, (topic, key, value, headers, partition) in enumerate(messages):
            raw = key.encode()
            try:
                if partition is None:
                    partition = await self._partition(topic, raw)
                encoded = self._encoded(headers)
            except Exception as exc:  # no metadata for the topic, a header that is no text
                outcomes[i] = exc
                continue
            groups.setdefault((topic, partition), []).append((i, raw, value, encoded))
        await asyncio.gather(
            *(
                self._send_group(topic, part, items, outcomes)
                for (topic, part), items in groups.items()
            )
        )
        return outcomes

    async def publish(
        self,
        value: bytes,
        topic: str,
        *,
        key: bytes,
        headers: dict[str, str],
        no_confirm: bool = True,
    ) -> asyncio.Future[Any]:
        partition = await self._partition(topic, key)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        hdrs = self._encoded(tuple(headers.items()))
        self._pending.setdefault((topic, partition), []).append((key, value, hdrs, done))
        if not self._scheduled:
            # Runs once the relay awaits its futures: everything published so far goes together.
            self._scheduled = True
            loop.call_soon(self._flush)
        if not no_confirm:
            await done
        return done

    def _flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, {}
        for (topic, partition), items in pending.items():
            asyncio.get_running_loop().create_task(self._send(topic, partition, items))

    async def _send(self, topic: str, partition: int, items: list[Pending]) -> None:
        outcomes: list[Outcome] = [None] * len(items)
        try:
            await self._send_group(
                topic,
                partition,
                [(i, key, value, hdrs) for i, (key, value, hdrs, _) in enumerate(items)],
                outcomes,
            )
        except BaseException:  # cancelled: nobody may wait for ever on these futures
            for *_, done in items:
                if not done.done():
                    done.cancel()
            raise
        for (*_, done), outcome in zip(items, outcomes, strict=True):
            if done.done():
                continue
            if outcome is None:
                done.set_result(None)
            else:
                done.set_exception(outcome)

    async def _send_group(
        self, topic: str, partition: int, items: list[Item], outcomes: list[Outcome]
    ) -> None:
        """Send `items` to one partition, in order, in as few batches as hold them; each one's
        outcome goes to `outcomes[its index]`. A message larger than a request is refused on
        its own (as aiokafka's `send` would); one larger than a batch goes in a batch of its
        own; a batch the broker refuses for good is sent again one message at a time, so only
        the messages it refuses fail. Any other failure (the broker away) fails that batch and
        every message after it, which keeps them in order for the relay's next try."""
        start = 0
        try:
            while start < len(items):
                index, key, value, hdrs = items[start]
                if _size(key, value, hdrs) > MAX_REQUEST:
                    outcomes[index] = MessageSizeTooLargeError(
                        f"a message of {len(value):,} bytes for {topic} exceeds the request limit"
                    )
                    start += 1
                    continue
                batch = self.producer.create_batch()
                end = start
                while end < len(items):
                    _, key, value, hdrs = items[end]
                    if end > start and _size(key, value, hdrs) > MAX_REQUEST:
                        break  # refused on its own at the top of the loop
                    if batch.append(key=key, value=value, timestamp=None, headers=hdrs) is None:
                        break  # full: the rest go in the next batch (the first always fits)
                    end += 1
                try:
                    await (await self.producer.send_batch(batch, topic, partition=partition))
                except Exception as exc:
                    if not refused_for_good(exc):
                        raise
                    if end - start == 1:
                        outcomes[items[start][0]] = exc
                        start = end
                        continue
                    # Again one at a time: only the messages the broker refuses fail.
                    for item in items[start:end]:
                        await self._send_group(topic, partition, [item], outcomes)
                        start += 1
                        failed = outcomes[item[0]]
                        if failed is not None and not refused_for_good(failed):
                            raise failed from None  # the broker away: the rest wait
                    continue
                start = end
        except Exception as exc:
            for i, *_ in items[start:]:
                if outcomes[i] is None:
                    outcomes[i] = exc


def _size(key: bytes, value: bytes, headers: Sequence[tuple[str, bytes]]) -> int:
    """A message's size in a request, with room for the record's and its batch's framing."""
    framing = 128 + 8 * len(headers)
    return framing + len(key) + len(value) + sum(len(k) + len(v) for k, v in headers)
