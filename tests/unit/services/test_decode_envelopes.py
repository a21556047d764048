"""Decoding a batch: a scheduler leader's fence is no event and no poison. A consumer that
fences epochs gets it; every other consumer skips it; bad input still goes to dead.letter."""

from __future__ import annotations

from aiokafka import ConsumerRecord

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import LeaderFence
from services.common.deadletter import decode_envelopes


def record(value: bytes, offset: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topic=topics.PLACEMENT_DECIDED,
        partition=0,
        offset=offset,
        timestamp=0,
        timestamp_type=0,
        key=None,
        value=value,
        checksum=None,
        serialized_key_size=0,
        serialized_value_size=len(value),
        headers=[],
    )


FENCE = Envelope(type=topics.LEADER_FENCE, payload={"epoch": 7, "leader": "s2"})
OTHER = Envelope(type="PlacementDecided", payload={"job_id": "j1"})
BATCH = (
    record(FENCE.model_dump_json().encode(), 0),
    record(OTHER.model_dump_json().encode(), 1),
    record(b"not json", 2),
)


def test_a_fence_goes_to_the_consumers_that_fence_and_nowhere_else() -> None:
    fences: list[LeaderFence] = []
    received, dead = decode_envelopes(BATCH, consumer="executor/c1", fences=fences)
    assert fences == [LeaderFence(epoch=7, leader="s2")]
    assert [r.envelope.type for r in received] == ["PlacementDecided"]
    assert len(dead) == 1

    received, dead = decode_envelopes(BATCH, consumer="queue")
    assert [r.envelope.type for r in received] == ["PlacementDecided"]
    assert len(dead) == 1  # only the bad record: the fence is skipped, not dead-lettered
