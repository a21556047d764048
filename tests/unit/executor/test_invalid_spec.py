"""A placement for this cluster whose spec does not validate is refused besides its dead letter
(`invalid_spec`, or `stale_epoch` below the executor's epoch): it never raises the epoch,
books nothing, and a redelivered copy is not refused twice."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

from aiokafka import ConsumerRecord
from prometheus_client import CollectorRegistry

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import PlacementDecided, ReplicaAssignment
from schemas.job import JobSpec
from services.common.kafka import OutMessage
from services.executor.handlers import Executor
from services.executor.metrics import ExecutorMetrics
from services.executor.nodes import NodeBook

CLUSTER = "c1"


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
    spec = JobSpec(tenant="vision", job_id=job_id)
    p = PlacementDecided(
        job_id=job_id,
        attempt=1,
        epoch=epoch,
        leader="forged",
        cluster=CLUSTER,
        accelerator_type="H100",
        spec=spec,
        replicas=[ReplicaAssignment(replica=0, node_id="n0", accelerators=1, cpu=1, memory_gb=1)],
    )
    env = json.loads(
        Envelope(type="PlacementDecided", payload=p.model_dump(mode="json")).model_dump_json()
    )
    env["payload"]["spec"]["kind"] = "no-such-kind"
    body = json.dumps(env).encode()
    return ConsumerRecord(
        topics.PLACEMENT_DECIDED, 0, offset, 0, 0, job_id.encode(), body, None, 0, len(body), []
    )


def fields(m: OutMessage) -> dict[str, Any]:
    payload = m.envelope.payload
    return payload if isinstance(payload, dict) else payload.model_dump()


def answers(relay: Relay) -> list[tuple[str, str | None]]:
    return [(m.topic, fields(m).get("reason_code") or fields(m).get("reason")) for m in relay.sent]


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
    refused = [fields(m) for m in relay.sent if m.topic == topics.PLACEMENT_REFUSED]
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
