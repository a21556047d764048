"""Projecting the job topics into the read model and the live event feed for `qm watch`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

import asyncpg
import structlog
from aiokafka import ConsumerRecord
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    JobCancelRequested,
    JobCheckpointRequested,
    JobFinished,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobStarted,
    PlacementHead,
    PlacementRefused,
    PreemptionCanceled,
    RunFailed,
)
from services.common.deadletter import Received, decode_payloads
from services.common.kafka import OutMessage
from services.gateway import store
from services.gateway.projection import EventLine, JobView, project

log = structlog.get_logger()

# The events that give a job its view (the others are about a job the gateway knows).
CREATING = (JobQueued, JobRejected)

PROJECTED: dict[str, type[BaseModel]] = {
    topics.JOB_QUEUED: JobQueued,
    topics.JOB_REJECTED: JobRejected,
    topics.PLACEMENT_DECIDED: PlacementHead,
    topics.PLACEMENT_REFUSED: PlacementRefused,
    topics.JOB_STARTED: JobStarted,
    topics.JOB_FINISHED: JobFinished,
    topics.JOB_PREEMPTED: JobPreempted,
    topics.JOB_RUN_FAILED: RunFailed,
    topics.JOB_CANCEL_REQUESTED: JobCancelRequested,
    topics.JOB_CHECKPOINT_REQUESTED: JobCheckpointRequested,
    topics.PREEMPTION_CANCELED: PreemptionCanceled,
}


# Topics whose bad records only the gateway reads with a store behind it: it dead-letters
# those; on the others the queue or another outboxed consumer already does.
GATEWAY_DEAD_LETTERS = frozenset(
    {
        topics.JOB_QUEUED,
        topics.JOB_REJECTED,
        topics.PREEMPTION_CANCELED,
        topics.SCHEDULING_EXPLAINED,
        topics.USAGE_TICK,
    }
)


def owed_dead_letters(dead: list[OutMessage]) -> list[OutMessage]:
    return [d for d in dead if d.key in GATEWAY_DEAD_LETTERS]  # keyed by source topic


def feed_channel(job_id: str) -> str:
    return f"qm:job-events:{job_id}"


# How long a watcher waits for Redis to confirm its subscription before it gives up.
SUBSCRIBE_CONFIRM_S = 5.0


async def subscribe_confirmed(
    pubsub: PubSub, channel: str, timeout_s: float = SUBSCRIBE_CONFIRM_S
) -> None:
    """Subscribe to `channel` and return once Redis has confirmed it (redis-py's `subscribe`
    only sends the command). A watcher reads the job's history after this: then a line the
    projection counted no subscriber for (Projector._announce) was committed before the
    history was read, and is in it. Raises redis' TimeoutError when no confirmation comes."""
    await pubsub.subscribe(channel)
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                # A fresh connection's first reply to SUBSCRIBE is its confirmation: Redis
                # sends nothing published on the channel before it.
                msg = await pubsub.get_message(ignore_subscribe_messages=False, timeout=timeout_s)
                if msg is not None and msg["type"] == "subscribe":
                    return
    except TimeoutError:
        raise RedisTimeoutError(f"Redis did not confirm the subscription to {channel}") from None


# One message per projected batch naming the jobs whose row changed (the dashboard's live
# views follow it): [[job_id, tenant, state], ...].
CHANGES_CHANNEL = "qm:jobs-changed"


def changes_message(views: Iterable[JobView]) -> str:
    return json.dumps([[v.job_id, v.tenant, v.state.value] for v in views])


# Events kept about jobs not heard of yet are at most this many rows and bytes (the newest are
# kept): a producer writing lifecycle events about made-up job ids must not fill the database
# within the day they are kept. The caps are enforced after every `EARLY_TRIM_EVERY` rows or
# `EARLY_TRIM_BYTES` kept, whichever comes first.
EARLY_EVENTS_MAX = 100_000
EARLY_EVENTS_MAX_BYTES = 256 << 20
EARLY_TRIM_EVERY = 1_000
EARLY_TRIM_BYTES = 8 << 20


def early_dropped_counter(registry: CollectorRegistry | None = None) -> Counter:
    return Counter(
        "qm_gateway_early_events_dropped_total",
        "Lifecycle events kept for jobs not heard of yet, dropped over the row or byte cap",
        registry=registry or CollectorRegistry(),
    )


class Projector:
    def __init__(
        self,
        pool: asyncpg.Pool,
        redis: Redis,
        *,
        early_max: int = EARLY_EVENTS_MAX,
        early_max_bytes: int = EARLY_EVENTS_MAX_BYTES,
        early_trim_every: int = EARLY_TRIM_EVERY,
        early_dropped: Counter | None = None,
    ) -> None:
        self.pool = pool
        self.redis = redis
        self.skipped = 0
        self.feed_dropped = 0  # live feed lines lost to Redis outages
        self.early_max = early_max
        self.early_max_bytes = early_max_bytes
        self.early_trim_every = max(1, early_trim_every)
        self.early_dropped = early_dropped or early_dropped_counter()
        self._kept_since_trim = 0
        self._bytes_since_trim = 0

    async def _first_heard(
        self,
        conn: asyncpg.Connection,
        about: dict[str, list[tuple[Received, Any]]],
        views: dict[str, JobView | None],
        changed: dict[str, JobView],
        lines: list[EventLine],
    ) -> list[tuple[Received, Any]]:
        """This batch's events about jobs with no view yet. A job whose job.queued (or
        job.rejected) is among them gets its view from the earliest such event, then every
        other event about it, of this batch and kept from earlier ones, oldest first (so an
        early placement is not folded after the preemption that ended it). Returns the events
        about jobs still not heard of, to keep."""
        born = {j for j, got in about.items() if any(isinstance(p, CREATING) for _, p in got)}
        kept: dict[str, list[tuple[Envelope, Any, bool]]] = {}
        if born:
            taken, dropped = await store.take_early(conn, born, PROJECTED)
            self.skipped += dropped
            for env, payload in taken:
                kept.setdefault(str(payload.job_id), []).append((env, payload, False))
        still: list[tuple[Received, Any]] = []
        for job_id in sorted(about):
            if job_id not in born:
                for got, payload in about[job_id]:
                    lines.append(project(None, got.envelope, payload)[1])
                    still.append((got, payload))  # kept until the job is heard of
                continue
            events = [(got.envelope, p, True) for got, p in about[job_id]]
            first = min(
                (e for e in events if isinstance(e[1], CREATING)), key=lambda e: e[0].occurred_at
            )
            rest = [e for e in events if e is not first] + kept.get(job_id, [])
            rest.sort(key=lambda e: e[0].occurred_at)
            for env, payload, fresh in [first, *rest]:
                new, line = project(views.get(job_id), env, payload)
                if fresh:
                    lines.append(line)  # a kept event's line was stored when it was read
                if new is not None and new != views.get(job_id):
                    changed[job_id] = new
                views[job_id] = new
        return still

    async def _cap_early(self, conn: asyncpg.Connection, kept: int, size: int) -> None:
        """Now and then, drop the oldest kept events beyond `early_max` rows or
        `early_max_bytes` (with a warning: a flood of events about unknown jobs, or a job
        topic read far ahead of job.queued)."""
        self._kept_since_trim += kept
        self._bytes_since_trim += size
        if self._kept_since_trim < self.early_trim_every and self._bytes_since_trim < min(
            EARLY_TRIM_BYTES, self.early_max_bytes
        ):
            return
        self._kept_since_trim = self._bytes_since_trim = 0
        dropped = await store.trim_early(conn, self.early_max, self.early_max_bytes)
        if dropped:
            self.early_dropped.inc(dropped)
            log.warning(
                "early events over the cap dropped; their jobs' views will miss them",
                dropped=dropped,
                max_rows=self.early_max,
                max_bytes=self.early_max_bytes,
            )

    async def process(self, records: tuple[ConsumerRecord[Any, Any], ...]) -> list[OutMessage]:
        """Project the records; returns the dead letters the gateway owes (for the topics no
        other service dead-letters, GATEWAY_DEAD_LETTERS); what it cannot read it skips."""
        received, dead = decode_payloads(records, PROJECTED, consumer="gateway")
        self.skipped += len(dead)
        items = [(got, payload) for got, payload in received if getattr(payload, "job_id", None)]
        owed = owed_dead_letters(dead)
        if not items:
            return owed
        lines: list[EventLine] = []
        async with self.pool.acquire() as conn, conn.transaction():
            ids = {str(p.job_id) for _, p in items}
            views: dict[str, JobView | None] = dict(await store.lock_views(conn, ids))
            unknown = ids - views.keys()
            if unknown:
                # Another replica may be creating one of them, or keeping early events for it.
                views.update(await store.lock_unknown(conn, unknown))
                unknown -= views.keys()
            changed: dict[str, JobView] = {}
            first_heard: dict[str, list[tuple[Received, Any]]] = {}
            for got, payload in items:
                job_id = str(payload.job_id)
                if job_id in unknown:
                    first_heard.setdefault(job_id, []).append((got, payload))
                    continue
                new, line = project(views.get(job_id), got.envelope, payload)
                lines.append(line)
                if new is not None and new != views.get(job_id):
                    changed[job_id] = new
                views[job_id] = new
            if first_heard:
                early = await self._first_heard(conn, first_heard, views, changed, lines)
                if early:
                    size = await store.keep_early(conn, early)
                    await self._cap_early(conn, len(early), size)
            fresh = await store.claim_lines(conn, lines)
            # Replaying an event changes nothing, but only fresh ones are announced.
            await store.upsert_views(conn, list(changed.values()))
        lines = [ln for ln in lines if ln.event_id in fresh]
        if lines or changed:
            # The live feeds (`qm watch`, the dashboard) are best effort: the read model is
            # already committed, and a Redis outage must not hold the projection back.
            try:
                await self._announce(lines, changed)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                self.feed_dropped += len(lines)
                log.warning("live feed not published: Redis is unreachable", error=str(exc))
        return owed

    async def _announce(self, lines: list[EventLine], changed: dict[str, JobView]) -> None:
        """Publish the batch's change message, and each line to its job's channel if anyone
        is subscribed to that channel now: most jobs are never watched, and a publish per
        line cost the gateway and Redis more than the batch's other work with Redis.

        Nothing falls between the count and a new watcher: a watcher subscribes, and waits
        for Redis to confirm it (subscribe_confirmed), before it reads the job's history. If
        Redis saw its SUBSCRIBE before our count, the line is
        published to it; if after, it reads the history after our commit (the count comes
        after it), so the line is there. Pattern subscriptions are not counted: a client
        that wants every job's lines follows CHANGES_CHANNEL and reads the history."""
        on = [(feed_channel(ln.job_id), ln) for ln in lines]
        channels = list(dict.fromkeys(channel for channel, _ in on))
        async with self.redis.pipeline(transaction=False) as pipe:
            if channels:
                pipe.pubsub_numsub(*channels)
            if changed:
                pipe.publish(CHANGES_CHANNEL, changes_message(changed.values()))
            replies = await pipe.execute()
        if not channels:
            return
        # NUMSUB answers in the order it was asked: matched by position, not by name.
        watched = {c for c, (_, n) in zip(channels, replies[0], strict=True) if n}
        wanted = [(channel, ln) for channel, ln in on if channel in watched]
        if wanted:
            async with self.redis.pipeline(transaction=False) as pipe:
                for channel, ln in wanted:
                    pipe.publish(channel, json.dumps(ln.as_json()))
                await pipe.execute()
