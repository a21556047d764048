"""Lingering on the real broker and the real clients (common/consumer.py, Linger): while records
trickle in, a lingering consumer starts its batches no closer together than its linger; a
backlog is read in full batches one after the other, never held. The assertions are on the
order and spacing of what happened: a slow machine only spaces batches further apart."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from services.common.consumer import Consumers, Records
from services.common.kafka import make_broker
from services.common.settings import ServiceSettings
from tests.integration.kafka_tools import eventually, fresh_topic, produce

pytestmark = pytest.mark.integration


async def consume(
    bootstrap: str, topic: str, *, linger_ms: int, max_records: int
) -> tuple[list[tuple[float, int]], Any]:
    """Start a consumer; returns its batches so far (start time, size) and a stop callable."""
    settings = ServiceSettings(kafka_bootstrap=bootstrap, fetch_max_wait_ms=10)
    broker = make_broker(settings, "linger-test")
    consumers = Consumers(broker, settings, service="linger-test")
    batches: list[tuple[float, int]] = []

    async def handle(records: Records) -> None:
        if records:
            batches.append((time.monotonic(), len(records)))

    consumers.subscribe(
        topic,
        group_id=f"{topic}-g",
        handle=handle,
        linger_ms=linger_ms,
        max_records=max_records,
    )
    await broker.start()
    return batches, broker.stop


async def test_records_that_trickle_in_are_gathered_for_the_linger(topics_ready: str) -> None:
    topic = await fresh_topic(topics_ready, "linger")
    batches, stop = await consume(topics_ready, topic, linger_ms=400, max_records=500)
    try:
        for i in range(30):
            await produce(topics_ready, topic, [(f"k{i % 5}", f"r{i}".encode())])
        await eventually(lambda: sum(n for _, n in batches) >= 30, timeout_s=60)
    finally:
        await stop()
    assert sum(n for _, n in batches) == 30
    starts = [t for t, _ in batches]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # Each batch began at least the linger after the one before (less the few instructions
    # between the pipeline's start of a batch and the handler's).
    assert all(g >= 0.4 - 0.05 for g in gaps), gaps


async def test_a_backlog_is_read_without_lingering(topics_ready: str) -> None:
    topic = await fresh_topic(topics_ready, "linger")
    await produce(topics_ready, topic, [(f"k{i % 7}", f"r{i}".encode()) for i in range(1200)])
    # Had the batches of this backlog lingered, 1,200 records in batches of at most 100 would
    # take a minute to read. (A batch that ends one partition's fetched records before the
    # other partition's answer has come in may linger once: Linger's rule sees only the
    # partitions in the batch.)
    batches, stop = await consume(topics_ready, topic, linger_ms=5_000, max_records=100)
    try:
        await eventually(lambda: sum(n for _, n in batches) >= 1200, timeout_s=120)
    finally:
        await stop()
    starts = [t for t, _ in batches]
    lingered = [b - a for a, b in itertools.pairwise(starts) if b - a >= 5]
    assert len(batches) >= 12
    assert len(lingered) <= 1, lingered
