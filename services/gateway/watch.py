"""Server-sent events for one job: its history so far, then each new event as it happens."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable

from redis.exceptions import RedisError

from schemas.job import JobState
from services.gateway import store
from services.gateway.context import Gateway
from services.gateway.handlers import feed_channel, subscribe_confirmed

TERMINAL = {s.value for s in JobState if s.terminal}
KEEP_ALIVE_EVERY_S = 15


def _sse(item: dict[str, object]) -> str:
    return f"data: {json.dumps(item, default=str)}\n\n"


async def event_stream(
    gw: Gateway, job_id: str, can_read: Callable[[str], bool]
) -> AsyncIterator[str]:
    pubsub = gw.redis.pubsub()
    try:
        # Subscribed (confirmed) before the history is read, so nothing falls between the two.
        await subscribe_confirmed(pubsub, feed_channel(job_id))
        seen: set[str] = set()
        for row in await store.history(gw.pool, job_id, can_read):
            item = {
                k: row[k] for k in ("event_id", "job_id", "type", "state", "reason_code", "message")
            } | {"at": row["at"].isoformat()}
            seen.add(row["event_id"])
            yield _sse(item)
            if row["state"] in TERMINAL:
                return
        idle = 0.0
        while idle < gw.settings.watch_idle_timeout_s:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is None:
                idle += 1.0
                if idle % KEEP_ALIVE_EVERY_S == 0:  # proxies close silent streams
                    yield ": keep-alive\n\n"
                continue
            idle = 0.0
            item = json.loads(msg["data"])
            if item["event_id"] in seen:
                continue
            seen.add(item["event_id"])
            (item,) = await store.redact(gw.pool, [item], can_read)
            item.pop("for_job", None)
            yield _sse(item)
            if item.get("state") in TERMINAL:
                return
    finally:
        with contextlib.suppress(RedisError, OSError):  # Redis may be what failed
            await pubsub.unsubscribe()
        await pubsub.aclose()  # type: ignore[no-untyped-call]
