"""Live updates for the dashboard over server-sent events, batched a few times a second.

The projector announces every batch's changed jobs on one Redis channel (handlers.
CHANGES_CHANNEL). Each open page holds one stream that listens to it and sends, at most every
BATCH_S:
- the jobs table: the changed cells of rows already on the page (rows keep their place), and
  a count of other matching jobs that changed, for a "N changes, apply" banner;
- a job's page: its new history lines and its header;
- every other view: a `changed` event, on which the view reloads itself.
A stream whose Redis goes away ends; the page's EventSource reconnects by itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from jinja2 import Environment

from services.gateway import store
from services.gateway.context import Gateway
from services.gateway.dashboard import queries
from services.gateway.dashboard.queries import JobQuery
from services.gateway.handlers import CHANGES_CHANNEL, feed_channel

BATCH_S = 0.3  # at most ~3 updates a second per page
KEEP_ALIVE_S = 15.0
MAX_IDS_PER_BATCH = 500  # a burst beyond this is counted, not looked up row by row


def sse(event: str, data: str) -> str:
    lines = "".join(f"data: {line}\n" for line in data.splitlines() or [""])
    return f"event: {event}\n{lines}\n"


def sse_response(stream: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        stream,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _batches(
    gw: Gateway,
    request: Request,
    channels: Iterable[str],
    prime: bool = False,
    idle_s: float = KEEP_ALIVE_S,
) -> AsyncIterator[list[Any] | None]:
    """Messages from these channels gathered over BATCH_S after the first arrives; None
    after every `idle_s` of silence. Ends when the client goes away. With `prime`, an empty
    batch first, once subscribed (to catch up on what happened before)."""
    pubsub = gw.redis.pubsub()
    await pubsub.subscribe(*channels)
    try:
        if prime:
            yield []
        quiet_since = time.monotonic()
        while not await request.is_disconnected():
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if msg is None:
                if time.monotonic() - quiet_since >= idle_s:
                    quiet_since = time.monotonic()
                    yield None
                continue
            batch = [msg]
            deadline = time.monotonic() + BATCH_S
            while (left := deadline - time.monotonic()) > 0:
                more = await pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
                if more is not None:
                    batch.append(more)
            quiet_since = time.monotonic()
            yield batch
    finally:
        await pubsub.unsubscribe()
        await pubsub.aclose()


def _changed_jobs(batch: list[Any], tenant: str | None) -> dict[str, str]:
    """job_id -> state of the jobs a batch of change messages names, for one tenant or all."""
    out: dict[str, str] = {}
    for msg in batch:
        try:
            items = json.loads(msg["data"])
        except (TypeError, ValueError):
            continue
        for item in items if isinstance(items, list) else ():
            if isinstance(item, list) and len(item) == 3 and (tenant is None or item[1] == tenant):
                out[str(item[0])] = str(item[2])
    return out


async def jobs_stream(
    gw: Gateway, request: Request, q: JobQuery, shown: list[str], env: Environment
) -> AsyncIterator[str]:
    """The jobs table: cells of shown rows as they change; a count of the rest."""
    on_page = set(shown)
    tenant = q.filters.get("tenant", (None,))[0] if len(q.filters.get("tenant", ())) == 1 else None
    pending: set[str] = set()
    cells = env.get_template("_job_cells.html")
    banner = env.get_template("_banner.html")
    yield ": connected\n\n"
    async for batch in _batches(gw, request, [CHANGES_CHANNEL]):
        if batch is None:
            yield ": keep-alive\n\n"
            continue
        changed = _changed_jobs(batch, tenant)
        if not changed:
            continue
        mine = [j for j in changed if j in on_page]
        others = [j for j in changed if j not in on_page and j not in pending]
        parts = []
        if mine:
            rows = await queries.rows_by_id(gw.pool, q, mine)
            parts += [cells.render(row=r) for r in rows]
        if others:
            if len(others) > MAX_IDS_PER_BATCH:
                pending.update(others)  # too many to check: count them all
            else:
                matching = await queries.rows_by_id(gw.pool, q, others)
                pending.update(r["job_id"] for r in matching)
            parts.append(banner.render(count=len(pending)))
        if parts:
            yield sse("rows", "".join(parts))


async def changes_stream(
    gw: Gateway, request: Request, tenant: str | None, every_s: float | None = None
) -> AsyncIterator[str]:
    """A `changed` event whenever a job this viewer may see changed (at most every BATCH_S;
    views reload at most every couple of seconds on their side). With `every_s`, also after
    that long without one: views of what jobs do not announce (node health) stay current."""
    yield ": connected\n\n"
    idle = every_s if every_s is not None else KEEP_ALIVE_S
    async for batch in _batches(gw, request, [CHANGES_CHANNEL], idle_s=idle):
        if batch is None:
            yield sse("changed", str(int(time.time()))) if every_s else ": keep-alive\n\n"
        elif _changed_jobs(batch, tenant):
            yield sse("changed", str(int(time.time())))


async def job_stream(
    gw: Gateway, request: Request, job_id: str, seen: set[str], env: Environment
) -> AsyncIterator[str]:
    """One job's page: each history line not on the page yet, and its header after it."""
    line_t = env.get_template("_timeline_line.html")
    head_t = env.get_template("_job_head.html")
    yield ": connected\n\n"
    async for batch in _batches(gw, request, [feed_channel(job_id)], prime=True):
        if batch is None:
            yield ": keep-alive\n\n"
            continue
        lines = [r for r in await store.history(gw.pool, job_id) if r["event_id"] not in seen]
        if not lines:
            continue
        seen.update(r["event_id"] for r in lines)
        html = "".join(line_t.render(line=dict(r)) for r in lines)
        row = await store.get_job(gw.pool, job_id)
        if row is not None:
            html += head_t.render(job=dict(row), oob=True)
        yield sse("line", html)
