"""Reading raw records into the meter's facts: ends from executors are measurements, the
queue's zero-second bookkeeping is not, job.preempted and job.run.failed end a run, bad input
is dead-lettered."""

from __future__ import annotations

from typing import Any

from aiokafka import ConsumerRecord

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import ClusterCapacity, RunFailed
from services.meter.intake import TOPICS, read_batch
from services.meter.runs import Finished
from tests.unit.meter.builders import capacity
from tests.unit.meter.scenario import RunSpec, envelope, finished, preempted


def record(topic: str, value: bytes, offset: int = 0) -> ConsumerRecord[Any, Any]:
    return ConsumerRecord(topic, 0, offset, 0, 0, None, value, None, 0, len(value), ())


RUN = RunSpec("j", "vision", "p", "onprem-h100", "H100", 1, 8, "42.5", reason_code="node_failure")


def test_ends_become_facts_and_only_measured_ones_can_close_a_run() -> None:
    records = (
        record(topics.JOB_FINISHED, finished(RUN).model_dump_json().encode(), 0),
        record(
            topics.JOB_FINISHED,
            finished(RUN, producer="queue", ran_s="0").model_dump_json().encode(),
            1,
        ),
        record(topics.JOB_PREEMPTED, preempted(RUN).model_dump_json().encode(), 2),
    )
    facts, dead = read_batch(records)
    assert dead == []
    ends = [f for _, f in facts]
    assert ends == [
        Finished("j", 1, 42_500_000, "succeeded", True),
        Finished("j", 1, 0, "succeeded", False),
        Finished("j", 1, 42_500_000, "preempted", True),
    ]


def test_unreadable_records_are_dead_lettered_with_the_reason() -> None:
    facts, dead = read_batch(
        (
            record(topics.JOB_STARTED, b"{not json"),
            record(topics.JOB_FINISHED, b'{"type": "JobFinished", "payload": {"job_id": 1}}'),
        )
    )
    assert facts == []
    assert [d.envelope.payload["consumer"] for d in dead] == ["meter", "meter"]
    assert "outcome" in dead[1].envelope.payload["error"]


def test_a_failed_run_ends_its_metering_whether_or_not_the_job_is_retried() -> None:
    """job.run.failed closes the run like job.preempted does, with outcome failed; the
    retry (if any) is another attempt, metered on its own."""
    failure = RunFailed(
        job_id="j",
        attempt=2,
        cluster="onprem-h100",
        reason_code="out_of_memory",
        message="OOM-killed",
        ran_s=42.5,
    )
    unmeasured = failure.model_copy(update={"ran_s": 0.0})
    records = (
        record(
            topics.JOB_RUN_FAILED,
            envelope("RunFailed", failure, "executor/onprem-h100", "vision")
            .model_dump_json()
            .encode(),
            0,
        ),
        record(
            topics.JOB_RUN_FAILED,
            envelope("RunFailed", unmeasured, "replayer", "vision").model_dump_json().encode(),
            1,
        ),
    )
    facts, dead = read_batch(records)
    assert topics.JOB_RUN_FAILED in TOPICS and dead == []
    assert [f for _, f in facts] == [
        Finished("j", 2, 42_500_000, "failed", True),
        Finished("j", 2, 0, "failed", False),
    ]


def test_an_inventory_priced_out_of_bounds_is_dead_lettered_not_billed() -> None:
    """A price per accelerator-hour above schemas.bounds.MAX_PRICE would overflow the
    ledger's 64-bit amounts (the batch would fail for ever) and a negative one would credit
    the tenants: either way the inventory is refused, with the field named."""
    good = capacity("onprem-h100")

    def priced(price: str) -> bytes:
        raw = envelope_of(good).replace(b'"reserved":2.1', b'"reserved":' + price.encode())
        assert price.encode() in raw
        return raw

    facts, dead = read_batch(
        (
            record(topics.CLUSTER_CAPACITY, priced("1e300"), 0),
            record(topics.CLUSTER_CAPACITY, priced("-5"), 1),
            record(topics.CLUSTER_CAPACITY, envelope_of(good), 2),
        )
    )
    assert [type(f).__name__ for _, f in facts] == ["Capacity"]
    assert len(dead) == 2
    for letter in dead:
        assert "prices.H100.reserved" in letter.envelope.payload["error"]


def envelope_of(payload: ClusterCapacity) -> bytes:
    env = Envelope(type="ClusterCapacity", producer="executor", payload=payload.model_dump())
    return env.model_dump_json().encode()
