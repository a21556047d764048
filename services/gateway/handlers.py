"""Projecting the job topics into the read model and the live event feed for `qm watch`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import asyncpg
import structlog
from aiokafka import ConsumerRecord
from pydantic import BaseModel
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from schemas import topics
from schemas.events import (
    JobCancelRequested,
    JobCheckpointRequested,
    JobFinished,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobStarted,
    PlacementDecided,
    PlacementRefused,
    PreemptionCanceled,
    RunFailed,
)
from services.common.deadletter import Received, decode_payloads
from services.common.kafka import OutMessage
from services.gateway import store
from services.gateway.projection import EventLine, JobView, project

log = structlog.get_logger()

PROJECTED: dict[str, type[BaseModel]] = {
    topics.JOB_QUEUED: JobQueued,
    topics.JOB_REJECTED: JobRejected,
    topics.PLACEMENT_DECIDED: PlacementDecided,
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


# One message per projected batch naming the jobs whose row changed (the dashboard's live
# views follow it): [[job_id, tenant, state], ...].
CHANGES_CHANNEL = "qm:jobs-changed"


def changes_message(views: Iterable[JobView]) -> str:
    return json.dumps([[v.job_id, v.tenant, v.state.value] for v in views])


class Projector:
    def __init__(self, pool: asyncpg.Pool, redis: Redis) -> None:
        self.pool = pool
        self.redis = redis
        self.skipped = 0
        self.feed_dropped = 0  # live feed lines lost to Redis outages

    async def _fold_early(
        self,
        conn: asyncpg.Connection,
        born: set[str],
        early: list[tuple[Received, Any]],
        views: dict[str, JobView | None],
        changed: dict[str, JobView],
    ) -> list[tuple[Received, Any]]:
        """Fold into the views created in this batch the events about them read before (kept
        in the store by an earlier batch, or earlier in this one), oldest first; returns the
        early events still about jobs not heard of."""
        pending = [(env, payload) for env, payload in await store.take_early(conn, born, PROJECTED)]
        pending += [(got.envelope, p) for got, p in early if str(p.job_id) in born]
        pending.sort(key=lambda item: item[0].occurred_at)
        for env, payload in pending:
            job_id = str(payload.job_id)
            new, _line = project(views.get(job_id), env, payload)  # its line is stored already
            if new is not None and new != views.get(job_id):
                changed[job_id] = new
            views[job_id] = new
        return [(got, p) for got, p in early if str(p.job_id) not in born]

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
            views: dict[str, JobView | None] = dict(
                await store.lock_views(conn, {str(p.job_id) for _, p in items})
            )
            unknown = {str(p.job_id) for _, p in items} - views.keys()
            if unknown:
                # Another replica may be creating one of them, or keeping early events for it.
                views.update(await store.lock_unknown(conn, unknown))
                unknown -= views.keys()
            changed: dict[str, JobView] = {}
            early: list[tuple[Received, Any]] = []
            for got, payload in items:
                job_id = str(payload.job_id)
                new, line = project(views.get(job_id), got.envelope, payload)
                lines.append(line)
                if new is None:
                    early.append((got, payload))  # about a job not heard of yet: kept for later
                elif new != views.get(job_id):
                    changed[job_id] = new
                views[job_id] = new
            born = {j for j in unknown if views.get(j) is not None}
            if born:
                early = await self._fold_early(conn, born, early, views, changed)
            if early:
                await store.keep_early(conn, early)
            fresh = await store.claim_lines(conn, lines)
            # Replaying an event changes nothing, but only fresh ones are announced.
            await store.upsert_views(conn, list(changed.values()))
        lines = [ln for ln in lines if ln.event_id in fresh]
        if lines or changed:
            # The live feeds (`qm watch`, the dashboard) are best effort: the read model is
            # already committed, and a Redis outage must not hold the projection back.
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for ln in lines:
                        pipe.publish(feed_channel(ln.job_id), json.dumps(ln.as_json()))
                    if changed:
                        pipe.publish(CHANGES_CHANNEL, changes_message(changed.values()))
                    await pipe.execute()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                self.feed_dropped += len(lines)
                log.warning("live feed not published: Redis is unreachable", error=str(exc))
        return owed
