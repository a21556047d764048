"""Reading what the platform answered: the answer topics read to their true end, the evidence
for each hostile record (dead letters by source coordinates, rejections by job id or cause,
terminal events by job id), and the verdict per record.

Reads tolerate anything: the answer topics are fuzzed too (a 100,000-deep record breaks
`json.loads` with RecursionError), and our own hostile records there are skipped by their
coordinates, so a ghost `job.finished` never counts as an answer."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.fuzz_records import HostileRecord
from bench.fuzz_wire import Expect
from schemas import topics

Coords = tuple[str, int, int]
ANSWER_TOPICS = (topics.DEAD_LETTER, topics.JOB_REJECTED, topics.JOB_FINISHED, topics.JOB_QUEUED)
# Read too, for the trail of a job that did not end as it should.
TRAIL_TOPICS = (
    topics.PLACEMENT_DECIDED,
    topics.PLACEMENT_REFUSED,
    topics.JOB_STARTED,
    topics.JOB_PREEMPTED,
    topics.JOB_RUN_FAILED,
    topics.SCHEDULING_EXPLAINED,
)


def _parse(value: bytes | None) -> dict[str, Any] | None:
    try:
        doc = json.loads(value or b"")
    except Exception:  # ValueError, UnicodeDecodeError, RecursionError: not an answer
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("payload"), dict) else None


class Tail:
    """Reads topics from the start, incrementally, up to their true end (the high watermark a
    fetch reports: Tansu's ListOffsets stops at the last batch's first record)."""

    def __init__(self, bootstrap: str, names: tuple[str, ...], skip: set[Coords]) -> None:
        self.bootstrap = bootstrap
        self.names = names
        self.skip = skip
        self._consumer: AIOKafkaConsumer | None = None
        # Read but not handed out yet: a read cancelled half way (the fuzz stops its watcher
        # while it reads) leaves them here for the next, since the consumer's position has
        # moved past them and nothing would read them again.
        self._pending: list[tuple[Coords, dict[str, Any]]] = []

    async def __aenter__(self) -> Tail:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            # An audit must see every record. aiokafka's default answers a fetch the broker
            # calls out of range by jumping to the end, past whatever was written in between,
            # silently; from the start again, the records already read are read twice and
            # counted once (the evidence dedupes by event id).
            auto_offset_reset="earliest",
            fetch_max_wait_ms=50,
            max_partition_fetch_bytes=8 << 20,
        )
        await consumer.start()
        await consumer.topics()
        parts = [
            TopicPartition(t, p)
            for t in self.names
            for p in sorted(consumer.partitions_for_topic(t) or ())
        ]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        self._consumer = consumer
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._consumer is not None:
            await self._consumer.stop()

    async def read(self, timeout_s: float = 120.0) -> list[tuple[Coords, dict[str, Any]]]:
        """Everything new up to the end as of now, as (coordinates, envelope); what a read
        that was cancelled or timed out had read comes first."""
        consumer = self._consumer
        assert consumer is not None
        parts = list(consumer.assignment())
        ends = await consumer.end_offsets(parts)
        out = self._pending
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            behind = False
            for tp, end in ends.items():
                high = consumer.highwater(tp)
                if end and (high is None or high < end or await consumer.position(tp) < high):
                    behind = True
            if not behind:
                self._pending = []
                return out
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{self.names} not read to the end within {timeout_s} s")
            batches = await consumer.getmany(timeout_ms=300, max_records=5000)
            for tp, records in batches.items():
                for r in records:
                    coords = (tp.topic, tp.partition, r.offset)
                    if coords in self.skip:
                        continue
                    env = _parse(r.value)
                    if env is not None:
                        out.append((coords, env))


async def locate(
    bootstrap: str,
    topic: str,
    job_ids: set[str],
    skip: set[Coords],
    seen: dict[str, Coords],
    timeout_s: float = 60.0,
) -> dict[str, list[str]]:
    """Where the records about `job_ids` sit in `topic`, read afresh from its start by a new
    reader: the diagnosis of a valid job that did not end as it should. Each line gives the
    record's outcome and says why the audit did not count it, if it did not: its coordinates
    are among our hostile records' (skipped), or its event id was first read elsewhere (taken
    for a redelivery); a job with no line has no record there at all."""
    found: dict[str, list[tuple[Coords, str]]] = {j: [] for j in job_ids}
    async with Tail(bootstrap, (topic,), set()) as tail:
        for coords, env in await tail.read(timeout_s):
            p = env["payload"]
            job_id = p.get("job_id")
            if not isinstance(job_id, str) or job_id not in found:  # hostile ones: any JSON
                continue
            t, partition, offset = coords
            event_id = str(env.get("event_id"))
            first = seen.get(event_id)
            if coords in skip:
                how = "skipped: at our hostile records' coordinates"
            elif first is None:
                how = "never read by the audit"
            elif first == coords:
                how = "read by the audit here"
            else:
                how = f"skipped: its event id was first read at {first[0]}[{first[1]}]@{first[2]}"
            line = f"{t}[{partition}]@{offset} outcome {p.get('outcome')!r} event {event_id}: {how}"
            found[job_id].append((coords, line))
    return {j: [line for _, line in sorted(lines)] for j, lines in found.items()}


@dataclass
class Evidence:
    """What the answer topics say, indexed the ways the verdicts look things up."""

    dead: dict[Coords, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    rejected_job: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    rejected_cause: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    queued_first: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    trail: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    # Event id -> where it was first read; a later record with the same id is skipped (a
    # redelivery).
    seen: dict[str, Coords] = field(default_factory=dict)

    def add(self, located: list[tuple[Coords, dict[str, Any]]]) -> None:
        for coords, env in located:
            topic = coords[0]
            event_id = str(env.get("event_id"))
            if event_id in self.seen:  # at-least-once: the same event may appear twice
                continue
            self.seen[event_id] = coords
            p = env["payload"]
            if isinstance(p.get("job_id"), str) and topic != topics.DEAD_LETTER:
                self.trail[p["job_id"]].append(_step(topic, p, env))
            if topic == topics.DEAD_LETTER:
                where = (p.get("source_topic"), p.get("partition"), p.get("offset"))
                self.dead[where].append(p)
            elif topic == topics.JOB_REJECTED:
                code = str(p.get("reason_code"))
                if p.get("job_id"):
                    self.rejected_job[str(p["job_id"])].append(code)
                if env.get("causation_id"):
                    self.rejected_cause[str(env["causation_id"])].append(code)
            elif topic == topics.JOB_FINISHED and p.get("job_id"):
                self.finished[str(p["job_id"])].append(str(p.get("outcome")))
            elif topic == topics.JOB_QUEUED and p.get("job_id") and not p.get("attempt"):
                self.queued_first[str(p["job_id"])].add(event_id)

    def terminal(self, job_id: str) -> str | None:
        """The job's end (an outcome, or `rejected:<code>`), or None while it has none."""
        if self.finished.get(job_id):
            return self.finished[job_id][0]
        if self.rejected_job.get(job_id):
            return f"rejected:{self.rejected_job[job_id][0]}"
        return None


def _step(topic: str, p: dict[str, Any], env: dict[str, Any]) -> str:
    detail = (
        p.get("outcome")
        or p.get("reason_code")
        or p.get("codes")
        or p.get("cluster")
        or p.get("attempt", "")
    )
    return f"{str(env.get('occurred_at'))[11:23]} {topic} {detail}"


@dataclass(frozen=True)
class Verdict:
    record: HostileRecord
    coords: Coords
    how: str  # dead_lettered | rejected | answered | ignored
    problem: str | None  # None when the record got what it must

    @property
    def ok(self) -> bool:
        return self.problem is None


def judge(record: HostileRecord, coords: Coords, ev: Evidence) -> Verdict:
    dead = ev.dead.get(coords, [])
    codes = [*ev.rejected_cause.get(record.event_id or "", [])]
    if record.topic == topics.JOB_SUBMITTED and record.job_id:
        codes += ev.rejected_job.get(record.job_id, [])
    end = ev.terminal(record.job_id) if record.job_id else None
    queued = len(ev.queued_first.get(record.job_id or "", ()))
    how = "dead_lettered" if dead else "rejected" if codes else "answered" if end else "ignored"

    def verdict(problem: str | None) -> Verdict:
        return Verdict(record, coords, how, problem)

    if record.expect is Expect.REFUSED:
        if record.reasons and codes and not set(codes) & set(record.reasons):
            return verdict(f"rejected as {codes}, expected one of {list(record.reasons)}")
        if queued and record.topic == topics.JOB_SUBMITTED:
            return verdict(f"accepted and queued (ended: {end or 'not yet'})")
        if not dead and not codes:
            return verdict("neither dead-lettered nor rejected")
        return verdict(None)
    if record.expect is Expect.ANSWERED:
        if end is None:
            return verdict("its job never reached a terminal state")
        if record.outcome and end != record.outcome:
            return verdict(f"its job ended {end}, expected {record.outcome}")
        if queued > 1:
            return verdict(f"its job was queued {queued} times (run twice?)")
        return verdict(None)
    if record.expect is Expect.NOT_RUN and queued:
        return verdict(f"an unknown event type was acted on: job queued (ended: {end})")
    return verdict(None)


def dead_letter_consumers(ev: Evidence, coords: Coords) -> list[str]:
    return sorted({str(p.get("consumer")) for p in ev.dead.get(coords, [])})
