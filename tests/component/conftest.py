"""One harness, two brokers: FastStream's in-memory TestKafkaBroker and the real one.

STYLE.md: the same test case runs against both, which keeps the fast tests honest. The
in-memory run needs no broker; both use a real PostgreSQL database of their own.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from fastapi import FastAPI
from faststream.kafka import KafkaBroker, TestKafkaBroker
from faststream.kafka.annotations import KafkaMessage

from services.common.topics import ensure_topics
from tests.integration.kafka_tools import collect, produce

Envelope = dict[str, Any]


class Harness:
    """Publishes raw bytes to the running service and waits for what it emits."""

    def __init__(self, kind: str, bootstrap: str | None) -> None:
        self.kind = kind
        self.bootstrap = bootstrap
        self.seen: list[tuple[str, Envelope]] = []
        self._test_broker: Any = None

    def capture(self, broker: KafkaBroker, *topics: str) -> None:
        """In memory: register capturing subscribers before the broker starts."""
        if self.kind != "memory":
            return
        for topic in topics:
            broker.subscriber(topic)(self._keeper(topic))

    def _keeper(self, topic: str) -> Callable[..., Any]:
        async def keep(message: KafkaMessage) -> None:
            self.seen.append((topic, json.loads(message.body)))

        return keep

    async def publish(self, topic: str, messages: list[tuple[str | None, bytes]]) -> None:
        if self.kind == "memory":
            for key, value in messages:
                await self._test_broker.publish(value, topic, key=key.encode() if key else None)
        else:
            assert self.bootstrap is not None
            await produce(self.bootstrap, topic, messages)

    async def wait_for(
        self,
        topics: tuple[str, ...],
        keep: Callable[[str, Envelope], bool],
        count: int,
        timeout_s: float = 30,
    ) -> list[tuple[str, Envelope]]:
        if self.kind == "memory":
            deadline = asyncio.get_running_loop().time() + timeout_s
            while asyncio.get_running_loop().time() < deadline:
                found = [(t, e) for t, e in self.seen if t in topics and keep(t, e)]
                if len(found) >= count:
                    return found
                await asyncio.sleep(0.02)
            return [(t, e) for t, e in self.seen if t in topics and keep(t, e)]
        assert self.bootstrap is not None
        return await collect(self.bootstrap, topics, keep, count, timeout_s)

    @asynccontextmanager
    async def running(self, app: FastAPI) -> AsyncIterator[FastAPI]:
        broker: KafkaBroker = app.state.broker
        if self.kind == "memory":
            async with TestKafkaBroker(broker) as test_broker:
                self._test_broker = test_broker
                async with app.router.lifespan_context(app):
                    yield app
        else:
            async with app.router.lifespan_context(app):
                yield app


@pytest.fixture(params=["memory", "kafka"])
async def harness(request: pytest.FixtureRequest) -> Harness:
    if request.param == "memory":
        return Harness("memory", None)
    bootstrap = request.getfixturevalue("kafka_bootstrap")
    await ensure_topics(bootstrap)
    return Harness("kafka", bootstrap)
