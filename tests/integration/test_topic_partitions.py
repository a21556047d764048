"""How many partitions the topics get on a real broker: the registry's counts, or one each
under the dev stack's cap (docs/dev-stack.md, "Topics")."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer

from schemas import topics
from services.common.topics import ensure_topics
from tests.conftest import private_kafka

pytestmark = pytest.mark.integration


async def partition_counts(bootstrap: str) -> dict[str, int]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        await consumer.topics()
        return {t.name: len(consumer.partitions_for_topic(t.name) or ()) for t in topics.TOPICS}
    finally:
        await consumer.stop()


async def test_capped_topics_get_at_most_the_cap_and_existing_ones_are_left_alone(
    tmp_path: Path,
) -> None:
    with private_kafka(tmp_path / "kafka") as url:
        created = await ensure_topics(url, max_partitions=1)
        assert sorted(created) == sorted(t.name for t in topics.TOPICS)
        assert set((await partition_counts(url)).values()) == {1}
        # A later start without the cap finds them all and changes nothing.
        assert await ensure_topics(url) == []
        assert set((await partition_counts(url)).values()) == {1}


async def test_without_a_cap_each_topic_gets_the_registry_count(tmp_path: Path) -> None:
    with private_kafka(tmp_path / "kafka") as url:
        await ensure_topics(url)
        counts = await partition_counts(url)
    assert counts == {t.name: t.partitions for t in topics.TOPICS}
    assert counts[topics.JOB_SUBMITTED] == 4  # so the capped test above could fail
