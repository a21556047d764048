"""Plain aiokafka producers and collectors, as another platform would use them."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

# A client's start and stop get a bound: one that hangs (a broker that never answers) fails
# its test with what hung, where it would otherwise wait for the suite's phase timeout.
START_S = 60.0
STOP_S = 30.0


async def bounded(step: Awaitable[object], seconds: float, what: str) -> None:
    try:
        async with asyncio.timeout(seconds):
            await step
    except TimeoutError as exc:
        raise TimeoutError(f"{what} did not finish within {seconds:.0f} s") from exc


def topic_name(prefix: str) -> str:
    """A topic name no other test uses: `prefix-<random>`."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def create_topic(bootstrap: str, name: str, partitions: int = 2) -> str:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()
    return name


async def fresh_topic(bootstrap: str, prefix: str, partitions: int = 2) -> str:
    """A topic of its own for one test, named `prefix-<random>`."""
    return await create_topic(bootstrap, topic_name(prefix), partitions)


async def eventually(check: Callable[[], Any], timeout_s: float = 30.0) -> None:
    """Wait until `check()` holds; fails the test after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def produce(bootstrap: str, topic: str, messages: Iterable[tuple[str | None, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_batch_size=1 << 20)
    await bounded(producer.start(), START_S, "a test producer's start")
    try:
        futures = [
            await producer.send(topic, value, key=key.encode() if key else None)
            for key, value in messages
        ]
        await asyncio.gather(*futures)
    finally:
        await bounded(producer.stop(), STOP_S, "a test producer's stop")


async def collect(
    bootstrap: str,
    topics: tuple[str, ...],
    keep: Callable[[str, dict[str, Any]], bool],
    count: int,
    timeout_s: float = 60.0,
) -> list[tuple[str, dict[str, Any]]]:
    """Read the topics from the start until `count` distinct kept envelopes arrived (or time
    is up)."""
    consumer = AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        fetch_max_wait_ms=20,
    )
    await bounded(consumer.start(), START_S, "a test consumer's start")
    found: list[tuple[str, dict[str, Any]]] = []
    seen: set[Any] = set()  # at-least-once: the same event may be on a topic twice
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(found) < count and asyncio.get_running_loop().time() < deadline:
            batches = await consumer.getmany(timeout_ms=200)
            for records in batches.values():
                for r in records:
                    try:
                        env = json.loads(r.value)
                    except ValueError:
                        continue  # another test's poison message, on a shared broker
                    if not isinstance(env, dict):
                        continue
                    if env.get("event_id") in seen:
                        continue
                    seen.add(env.get("event_id"))
                    if keep(r.topic, env):
                        found.append((r.topic, env))
    finally:
        await bounded(consumer.stop(), STOP_S, "a test consumer's stop")
    return found


class LogReader:
    """Reads whole topics from the start, incrementally, and knows when it has reached the
    end: for audits of a big log, where a time-boxed read would silently miss records."""

    def __init__(self, bootstrap: str, topics: tuple[str, ...]) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.events: list[tuple[str, dict[str, Any]]] = []
        # The same envelopes with where they are: (topic, partition, offset, envelope).
        self.located: list[tuple[str, int, int, dict[str, Any]]] = []
        self._seen: set[str] = set()
        self._consumer: AIOKafkaConsumer | None = None

    async def __aenter__(self) -> LogReader:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            fetch_max_wait_ms=50,
        )
        await bounded(consumer.start(), START_S, "a test consumer's start")
        await consumer.topics()  # fetches the cluster metadata partitions_for_topic reads
        partitions = [
            TopicPartition(t, p)
            for t in self.topics
            for p in sorted(consumer.partitions_for_topic(t) or ())
        ]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        self._consumer = consumer
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._consumer is not None:
            await bounded(self._consumer.stop(), STOP_S, "a test consumer's stop")

    async def read_to_end(self, timeout_s: float = 300.0) -> list[tuple[str, dict[str, Any]]]:
        """Everything up to the end offsets as they are now; new envelopes are appended to
        `events` (deduplicated by event id). Raises TimeoutError if the end is not reached."""
        consumer = self._consumer
        assert consumer is not None
        partitions = list(consumer.assignment())
        ends = await consumer.end_offsets(partitions)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            # Tansu's end offsets stop at the last batch's first record; the high watermark
            # of the fetches is the real end (docs/decisions.md).
            behind = []
            for tp, end in ends.items():
                highwater = consumer.highwater(tp)
                if highwater is None or highwater < end or await consumer.position(tp) < highwater:
                    behind.append(tp)
            if not behind:
                break
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the log was not read to its end within {timeout_s} s")
            batches = await consumer.getmany(timeout_ms=500, max_records=5000)
            for tp, records in batches.items():
                for r in records:
                    try:
                        env = json.loads(r.value)
                    except ValueError:
                        continue
                    if not isinstance(env, dict) or env.get("event_id") in self._seen:
                        continue
                    self._seen.add(env["event_id"])
                    self.events.append((tp.topic, env))
                    self.located.append((tp.topic, tp.partition, r.offset, env))
        return self.events


async def every_record(
    bootstrap: str, topic: str, *, skip_unreadable: bool = False
) -> list[dict[str, Any]]:
    """Every JSON record on `topic` up to its high watermark now, duplicates included; with
    `skip_unreadable`, records that are not a JSON object (other tests' poison on a shared
    broker) are left out instead of failing."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await bounded(consumer.start(), START_S, "a test consumer's start")
    try:
        parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        out: list[dict[str, Any]] = []
        while True:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    try:
                        doc = json.loads(r.value)
                    except ValueError:
                        if not skip_unreadable:
                            raise
                        continue
                    if isinstance(doc, dict) or not skip_unreadable:
                        out.append(doc)
            marks = [(await consumer.position(tp), consumer.highwater(tp)) for tp in parts]
            if all(hw is not None and pos >= hw for pos, hw in marks):
                return out
    finally:
        await bounded(consumer.stop(), STOP_S, "a test consumer's stop")
