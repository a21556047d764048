"""Plain aiokafka producers and collectors, as another platform would use them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer


async def produce(bootstrap: str, topic: str, messages: Iterable[tuple[str | None, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_batch_size=1 << 20)
    await producer.start()
    try:
        futures = [
            await producer.send(topic, value, key=key.encode() if key else None)
            for key, value in messages
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


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
    await consumer.start()
    found: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()  # at-least-once: the same event may be on a topic twice
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
        await consumer.stop()
    return found
