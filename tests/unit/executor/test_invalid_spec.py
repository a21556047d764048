"""A placement for this cluster whose spec does not validate is refused besides its dead letter
(`invalid_spec`, or `stale_epoch` below the executor's epoch): it never raises the epoch,
books nothing, and a redelivered copy is not refused twice."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

from aiokafka import ConsumerRecord
from prometheus_client import CollectorRegistry

from schemas import topics
from services.common.kafka import OutMessage
from services.executor.handlers import Executor
from services.executor.metrics import ExecutorMetrics
from services.executor.nodes import NodeBook
from tests.unit.services.builders import placement_record
from tests.unit.services.test_scheduler_state import placed

CLUSTER = "c1"  # the cluster of test_scheduler_state.placed


class Relay:
    """One transaction at a time; event ids claimed once, as `processed_events` does."""

    def __init__(self) -> None:
        self.claimed: set[str] = set()
        self.sent: list[OutMessage] = []

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        out: list[OutMessage] = []

        async def claim(ids: list[str]) -> set[str]:
            fresh = set(ids) - self.claimed
            self.claimed |= fresh
            return fresh

        yield SimpleNamespace(conn=None, claim=claim, emit=out.extend)
        self.sent.extend(out)


class Store:
    async def write(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    async def load(self) -> tuple[list[Any], int, dict[str, float]]:
        return [], 7, {}


class Backend:
    async def act(self, _acts: Any) -> None:
        return None


def record(job_id: str, epoch: int, offset: int) -> ConsumerRecord[Any, Any]:
    p = placed(job_id, epoch=epoch)
    return placement_record(p, p.spec.model_dump(mode="json") | {"kind": "no-such-kind"}, offset)


def answers(relay: Relay) -> list[tuple[str, str | None]]:
    return [
        (m.topic, m.envelope.payload.get("reason_code") or m.envelope.payload.get("reason"))
        for m in relay.sent
    ]


async def test_an_invalid_spec_is_refused_without_raising_the_epoch_and_only_once() -> None:
    relay = Relay()
    registry = CollectorRegistry()
    executor = Executor(
        CLUSTER,
        NodeBook({}),
        Store(),  # type: ignore[arg-type]
        relay,  # type: ignore[arg-type]
        ExecutorMetrics(registry),
        time_scale=1,
        default_duration_s=60,
        backend=Backend(),  # type: ignore[arg-type]
    )
    await executor.restore()
    assert executor.epoch == 7
    ahead, behind = record("ahead", 9, 0), record("behind", 6, 1)
    await executor.process((ahead, behind))
    assert answers(relay) == [
        (topics.DEAD_LETTER, "unreadable"),
        (topics.DEAD_LETTER, "unreadable"),
        (topics.PLACEMENT_REFUSED, "invalid_spec"),
        (topics.PLACEMENT_REFUSED, "stale_epoch"),
    ]
    assert executor.epoch == 7  # a forged epoch 9 did not move it
    assert not executor.running and executor.book.allocated_accelerators == 0
    refused = [m.envelope.payload for m in relay.sent if m.topic == topics.PLACEMENT_REFUSED]
    assert [(r["job_id"], r["epoch"]) for r in refused] == [("ahead", 9), ("behind", 6)]
    # Redelivered: dead-lettered again (as before), refused no more.
    relay.sent.clear()
    await executor.process((ahead,))
    assert answers(relay) == [(topics.DEAD_LETTER, "unreadable")]
    assert (
        registry.get_sample_value(
            "qm_executor_placements_refused_total", {"reason": "invalid_spec"}
        )
        == 1
    )
