"""Creating the registry's topics with their partition counts (Tansu auto-creates with 4)."""

from __future__ import annotations

import asyncio

from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from schemas.topics import TOPICS, Topic


def partitions(topic: Topic, max_partitions: int | None = None) -> int:
    """How many partitions `topic` gets when created: the registry's count (what a deployment
    that runs replicas of a service needs to share its work), or fewer when capped."""
    if max_partitions is None:
        return topic.partitions
    if max_partitions < 1:
        raise ValueError(f"max_partitions must be at least 1, got {max_partitions}")
    return min(topic.partitions, max_partitions)


async def ensure_topics(
    bootstrap: str, timeout_s: float = 30.0, *, max_partitions: int | None = None
) -> list[str]:
    """Create every registry topic that does not exist yet; return the names created.

    `max_partitions` caps every topic's partition count (the dev stack's single broker and
    single instance of each service: docs/dev-stack.md); topics that exist are left as they
    are, and every reader takes the partitions a topic has from the broker's metadata."""
    count = {t.name: partitions(t, max_partitions) for t in TOPICS}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        try:
            await admin.start()
            existing = set(await admin.list_topics())
            missing = [t for t in TOPICS if t.name not in existing]
            if missing:
                await admin.create_topics(
                    [
                        NewTopic(
                            t.name,
                            num_partitions=count[t.name],
                            replication_factor=1,
                            topic_configs={"retention.ms": str(t.retention_ms)},
                        )
                        for t in missing
                    ]
                )
            return [t.name for t in missing]
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.5)
        finally:
            await admin.close()
