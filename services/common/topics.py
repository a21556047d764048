"""Creating the registry's topics with their partition counts (Tansu auto-creates with 4)."""

from __future__ import annotations

import asyncio

from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from schemas.topics import TOPICS


async def ensure_topics(bootstrap: str, timeout_s: float = 30.0) -> list[str]:
    """Create every registry topic that does not exist yet; return the names created."""
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
                            num_partitions=t.partitions,
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
