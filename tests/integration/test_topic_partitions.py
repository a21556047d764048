"""How many partitions the topics get on a real broker: the registry's counts, or one each
under the dev stack's cap (docs/dev-stack.md)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.fuzz_health import partition_counts
from cli import infra
from schemas import topics
from services.common.topics import ensure_topics

pytestmark = pytest.mark.integration

NAMES = tuple(t.name for t in topics.TOPICS)


@contextmanager
def fresh_broker(workdir: Path) -> Iterator[str]:
    """A broker with no topics yet, whatever QM_KAFKA_BOOTSTRAP says (these tests create the
    topics; on a shared broker they would exist already, at whatever count)."""
    server = infra.start_kafka(workdir)
    try:
        yield server.url
    finally:
        infra.stop(server)


async def test_capped_topics_get_at_most_the_cap_and_existing_ones_are_left_alone(
    tmp_path: Path,
) -> None:
    with fresh_broker(tmp_path / "kafka") as url:
        created = await ensure_topics(url, max_partitions=1)
        assert sorted(created) == sorted(t.name for t in topics.TOPICS)
        assert set((await partition_counts(url, NAMES)).values()) == {1}
        # A later start without the cap finds them all and changes nothing.
        assert await ensure_topics(url) == []
        assert set((await partition_counts(url, NAMES)).values()) == {1}


async def test_without_a_cap_each_topic_gets_the_registry_count(tmp_path: Path) -> None:
    with fresh_broker(tmp_path / "kafka") as url:
        await ensure_topics(url)
        counts = await partition_counts(url, NAMES)
    assert counts == {t.name: t.partitions for t in topics.TOPICS}
    assert counts[topics.JOB_SUBMITTED] == 4  # so the capped test above could fail
