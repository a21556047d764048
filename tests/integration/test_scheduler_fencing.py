"""The scheduler leader's fences on a real broker and Redis: a new leader writes its epoch to
every partition of the topics it decides on before its first decision, and a leader that reads
a newer leader's fence stands down at once (it takes over afresh if the lease is free).

A private broker: a scheduler here would otherwise place the other tests' queued jobs."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from redis.asyncio import Redis

from bench.fuzz_health import partition_counts
from schemas import topics
from schemas.envelope import Envelope
from services.common.topics import ensure_topics
from services.scheduler.app import create_app
from services.scheduler.settings import SchedulerSettings
from tests.conftest import private_kafka
from tests.integration.conftest import running
from tests.integration.kafka_tools import START_S, STOP_S, LogReader, bounded
from tests.unit.services.builders import T0, spec
from tests.unit.services.test_scheduler_state import capacity

Found = tuple[str, int, int, dict[str, Any]]  # topic, partition, offset, envelope


@pytest.fixture
async def own_kafka(tmp_path: Path) -> AsyncIterator[str]:
    with private_kafka(tmp_path / "kafka") as url:
        await ensure_topics(url)
        yield url


async def produce(bootstrap: str, topic: str, env: Envelope, partition: int | None = None) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await bounded(producer.start(), START_S, "the test producer's start")
    try:
        key = None if partition is not None else b"k"
        await producer.send_and_wait(
            topic, env.model_dump_json().encode(), key=key, partition=partition
        )
    finally:
        await bounded(producer.stop(), STOP_S, "the test producer's stop")


async def read_until(bootstrap: str, wanted: Any, timeout_s: float = 60.0) -> list[Found]:
    """Everything on the fenced topics, read from the start until `wanted(found)` holds."""
    async with LogReader(bootstrap, topics.FENCED_TOPICS) as log:
        async with asyncio.timeout(timeout_s):
            while not wanted(log.located):
                await log.read_to_end(timeout_s)
                await asyncio.sleep(0.05)
        return log.located


def fences(found: list[Found]) -> dict[tuple[str, int], int]:
    """(topic, partition) -> offset of the first fence on it."""
    out: dict[tuple[str, int], int] = {}
    for topic, partition, offset, env in found:
        if env["type"] == topics.LEADER_FENCE:
            out.setdefault((topic, partition), offset)
    return out


async def fenced_partitions(bootstrap: str) -> set[tuple[str, int]]:
    """Every partition of the fenced topics, as the broker has them (a `qm up` broker's
    topics have one partition each, a fresh one's the registry's counts)."""
    counts = await partition_counts(bootstrap, tuple(topics.FENCED_TOPICS))
    return {(t, p) for t, n in counts.items() for p in range(n)}


async def test_a_new_leader_fences_every_partition_before_its_first_placement(
    own_kafka: str, service_env: dict[str, Any]
) -> None:
    job_id = f"fenced-{uuid.uuid4().hex[:8]}"
    queued = {
        "job_id": job_id,
        "spec": spec(job_id=job_id).model_dump(mode="json"),
        "submitted_at": T0.isoformat(),
    }
    await produce(
        own_kafka,
        topics.CLUSTER_CAPACITY,
        Envelope(type="ClusterCapacity", payload=capacity(2).model_dump(mode="json")),
    )
    await produce(own_kafka, topics.JOB_QUEUED, Envelope(type="JobQueued", payload=queued))
    settings = SchedulerSettings(
        **{**service_env, "kafka_bootstrap": own_kafka}, lease_name=f"qm:test:{job_id}"
    )

    def placed(found: list[Found]) -> bool:
        return any(env["payload"].get("job_id") == job_id for *_, env in found)

    async with running(create_app(settings)):
        found = await read_until(own_kafka, placed)
    fenced = fences(found)
    partitions = await fenced_partitions(own_kafka)
    assert len(partitions) >= len(topics.FENCED_TOPICS)
    assert set(fenced) == partitions
    topic, partition, offset, env = next(
        f for f in found if f[3]["payload"].get("job_id") == job_id
    )
    assert fenced[(topic, partition)] < offset  # the fence came first on its partition
    assert {f[3]["payload"]["epoch"] for f in found if f[3]["type"] == topics.LEADER_FENCE} == {
        env["payload"]["epoch"]
    }


async def test_a_leader_that_reads_a_newer_fence_stands_down(
    own_kafka: str, service_env: dict[str, Any]
) -> None:
    lease = f"qm:test:{uuid.uuid4().hex[:8]}"
    settings = SchedulerSettings(**{**service_env, "kafka_bootstrap": own_kafka}, lease_name=lease)
    partitions = await fenced_partitions(own_kafka)
    async with running(create_app(settings)):
        first = await read_until(own_kafka, lambda found: set(fences(found)) == partitions)
        assert all(f[3]["payload"]["leader"] != "other" for f in first)
        # Another leader took over: it drew the next epoch (as RedisLease does) and fenced
        # one partition. The lease key itself still names our scheduler.
        redis = Redis.from_url(service_env["redis_url"])
        successor = int(await redis.incr(f"{lease}:epoch"))
        await redis.aclose()
        intruder = Envelope(
            type=topics.LEADER_FENCE, payload={"epoch": successor, "leader": "other"}
        )
        await produce(own_kafka, topics.PLACEMENT_DECIDED, intruder, partition=0)

        def retaken(found: list[Found]) -> bool:
            # The lease it gave up is free (no other process holds it), so it takes over again:
            # a fresh epoch, fenced everywhere once more.
            again = [
                f
                for f in found
                if f[3]["type"] == topics.LEADER_FENCE
                and f[3]["payload"]["leader"] != "other"
                and f[3]["payload"]["epoch"] > successor
            ]
            return {(t, p) for t, p, *_ in again} == partitions

        await read_until(own_kafka, retaken)
