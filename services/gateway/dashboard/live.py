"""Live updates for the dashboard over server-sent events, batched a few times a second.

The projector announces every batch's changed jobs on one Redis channel (handlers.
CHANGES_CHANNEL). A gateway process holds one subscription to it (ChangeHub) and hands each
message to every open page's stream, which sends, at most every BATCH_S:
- the jobs table: the changed cells of rows already on the page (rows keep their place), and
  a count of other matching jobs that changed, for a "N changes, apply" banner;
- a job's page (its own Redis channel, as `qm watch`): its new history lines and its header;
- every other view: a `changed` event, on which the view reloads itself.
Redis going away ends the hub's subscription until it answers again (the pages see nothing
meanwhile; a reload shows the truth); a page's EventSource reconnects by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import structlog
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from jinja2 import Environment
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.gateway import store
from services.gateway.context import Gateway
from services.gateway.dashboard import queries
from services.gateway.dashboard.queries import JobQuery
from services.gateway.dashboard.session import Viewer
from services.gateway.handlers import CHANGES_CHANNEL, feed_channel, subscribe_confirmed

log = structlog.get_logger()

BATCH_S = 0.3  # at most ~3 updates a second per page
KEEP_ALIVE_S = 15.0
MAX_IDS_PER_BATCH = 500  # a burst beyond this is counted, not looked up row by row
QUEUE_LIMIT = 256  # messages a slow page may fall behind before the oldest are dropped
RETRY_S = 2.0
SUBSCRIBE_WAIT_S = 2.0  # how long a new stream waits for the hub's subscription
MAX_STREAMS = 1000  # open live streams per gateway process (each job page holds a Redis link)

Next = Callable[[float], Awaitable[Any | None]]  # the next message within a timeout, or None


def sse(event: str, data: str) -> str:
    lines = "".join(f"data: {line}\n" for line in data.splitlines() or [""])
    return f"event: {event}\n{lines}\n"


_open_streams = 0


def sse_response(stream: AsyncIterator[str]) -> Response:
    """The stream as server-sent events; a 503 beyond MAX_STREAMS open in this process (so
    that open pages cannot exhaust Redis's connections; the page's EventSource retries)."""
    if _open_streams >= MAX_STREAMS:
        return Response(
            "too many live views are open on this gateway; retrying shortly",
            status_code=503,
            headers={"Retry-After": "5"},
        )

    async def counted() -> AsyncIterator[str]:
        global _open_streams
        _open_streams += 1
        try:
            async for part in stream:
                yield part
        finally:
            _open_streams -= 1

    return StreamingResponse(
        counted(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class ChangeHub:
    """One subscription to the changes channel per gateway process, fanned out to the open
    pages (each has a bounded queue: a page that cannot keep up loses its oldest messages,
    never holds the others back). Subscribes while some page listens."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.queues: set[asyncio.Queue[Any]] = set()
        self.task: asyncio.Task[None] | None = None
        self.dropped = 0
        self.subscribed = asyncio.Event()  # set while the subscription stands

    @contextlib.contextmanager
    def listen(self) -> Iterator[asyncio.Queue[Any]]:
        queue: asyncio.Queue[Any] = asyncio.Queue(QUEUE_LIMIT)
        self.queues.add(queue)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())
        try:
            yield queue
        finally:
            self.queues.discard(queue)

    def deliver(self, data: Any) -> None:
        for queue in self.queues:
            if queue.full():
                queue.get_nowait()
                self.dropped += 1
            queue.put_nowait(data)

    async def _run(self) -> None:
        while self.queues:
            try:
                await self._follow()
            except (RedisError, OSError) as exc:
                log.warning("dashboard live feed: Redis unavailable", error=str(exc))
                await asyncio.sleep(RETRY_S)

    async def _follow(self) -> None:
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(CHANGES_CHANNEL)
            self.subscribed.set()
            while self.queues:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is not None:
                    self.deliver(msg["data"])
        finally:
            self.subscribed.clear()
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]


def hub(request: Request, gw: Gateway) -> ChangeHub:
    """The gateway process's hub (made on first use)."""
    state = request.app.state
    if getattr(state, "change_hub", None) is None:
        state.change_hub = ChangeHub(gw.redis)
    return state.change_hub  # type: ignore[no-any-return]


async def _batches(
    request: Request, next_message: Next, prime: bool = False, idle_s: float = KEEP_ALIVE_S
) -> AsyncIterator[list[Any] | None]:
    """Messages gathered over BATCH_S after the first arrives; None after every `idle_s` of
    silence. Ends when the client goes away. With `prime`, an empty batch first (to catch up
    on what happened before the subscription)."""
    if prime:
        yield []
    quiet_since = time.monotonic()
    while not await request.is_disconnected():
        msg = await next_message(1.0)
        if msg is None:
            if time.monotonic() - quiet_since >= idle_s:
                quiet_since = time.monotonic()
                yield None
            continue
        batch = [msg]
        deadline = time.monotonic() + BATCH_S
        while (left := deadline - time.monotonic()) > 0:
            more = await next_message(left)
            if more is not None:
                batch.append(more)
        quiet_since = time.monotonic()
        yield batch


@contextlib.asynccontextmanager
async def _changes(request: Request, gw: Gateway) -> AsyncIterator[Next]:
    with hub(request, gw).listen() as queue:

        async def next_message(wait_s: float) -> Any | None:
            try:
                return await asyncio.wait_for(queue.get(), wait_s)
            except TimeoutError:
                return None

        yield next_message


@contextlib.asynccontextmanager
async def _channel(gw: Gateway, channel: str) -> AsyncIterator[Next]:
    pubsub = gw.redis.pubsub()
    try:
        # Confirmed before the caller reads the history (job_stream's first batch).
        await subscribe_confirmed(pubsub, channel)

        async def next_message(wait_s: float) -> Any | None:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait_s)
            return None if msg is None else msg["data"]

        yield next_message
    finally:
        with contextlib.suppress(RedisError, OSError):
            await pubsub.unsubscribe()
            await pubsub.aclose()  # type: ignore[no-untyped-call]


def _changed_jobs(batch: list[Any], tenant: str | None) -> dict[str, str]:
    """job_id -> state of the jobs a batch of change messages names, for one tenant or all."""
    out: dict[str, str] = {}
    for data in batch:
        try:
            items = json.loads(data)
        except (TypeError, ValueError):
            continue
        for item in items if isinstance(items, list) else ():
            if isinstance(item, list) and len(item) == 3 and (tenant is None or item[1] == tenant):
                out[str(item[0])] = str(item[2])
    return out


async def jobs_stream(
    gw: Gateway, request: Request, q: JobQuery, shown: list[str], env: Environment
) -> AsyncIterator[str]:
    """The jobs table: cells of shown rows as they change; a count of the rest. Once the
    subscription stands, the shown rows are sent once (what changed between the page's render
    and the subscription), then `ready`."""
    table = _Table(gw, q, set(shown), env)
    yield ": connected\n\n"
    async with _changes(request, gw) as next_message:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(hub(request, gw).subscribed.wait(), SUBSCRIBE_WAIT_S)
        if (event := await table.refresh_shown()) is not None:
            yield event
        yield sse("ready", "1")
        async for batch in _batches(request, next_message):
            if batch is None:
                yield ": keep-alive\n\n"
            elif (event := await table.update(batch)) is not None:
                yield event


class _Table:
    """What one open jobs table shows, and what has changed beside it."""

    def __init__(self, gw: Gateway, q: JobQuery, on_page: set[str], env: Environment) -> None:
        self.gw = gw
        self.q = q
        self.on_page = on_page
        tenants = q.filters.get("tenant", ())
        self.tenant = tenants[0] if len(tenants) == 1 else None
        self.scope = JobQuery({"tenant": tenants} if tenants else {})
        self.pending: set[str] = set()  # matching jobs not on the page that changed
        self.cells = env.get_template("_job_cells.html")
        self.banner = env.get_template("_banner.html")

    async def refresh_shown(self) -> str | None:
        rows = await queries.rows_by_id(self.gw.pool, self.scope, sorted(self.on_page))
        return sse("rows", "".join(self.cells.render(row=r) for r in rows)) if rows else None

    async def update(self, batch: list[Any]) -> str | None:
        changed = _changed_jobs(batch, self.tenant)
        mine = [j for j in changed if j in self.on_page]
        others = [j for j in changed if j not in self.on_page and j not in self.pending]
        parts = []
        if mine:
            # A shown row is updated even when it no longer matches the filter (a queued job
            # on `?state=pending` that got placed says so in place); only the scope applies.
            rows = await queries.rows_by_id(self.gw.pool, self.scope, mine)
            parts += [self.cells.render(row=r) for r in rows]
        if others:
            if len(others) > MAX_IDS_PER_BATCH:
                self.pending.update(others)  # too many to look up: count them all
            else:
                matching = await queries.rows_by_id(self.gw.pool, self.q, others)
                self.pending.update(r["job_id"] for r in matching)
            parts.append(self.banner.render(count=len(self.pending)))
        return sse("rows", "".join(parts)) if parts else None


async def changes_stream(
    gw: Gateway, request: Request, tenant: str | None, every_s: float | None = None
) -> AsyncIterator[str]:
    """A `changed` event whenever a job this viewer may see changed (at most every BATCH_S;
    views reload at most every couple of seconds on their side). With `every_s`, also after
    that long without one: views of what jobs do not announce (node health) stay current."""
    yield ": connected\n\n"
    idle = every_s if every_s is not None else KEEP_ALIVE_S
    async with _changes(request, gw) as next_message:
        async for batch in _batches(request, next_message, idle_s=idle):
            if batch is None:
                yield sse("changed", str(int(time.time()))) if every_s else ": keep-alive\n\n"
            elif _changed_jobs(batch, tenant):
                yield sse("changed", str(int(time.time())))


async def job_stream(
    gw: Gateway, request: Request, job_id: str, seen: set[str], env: Environment, who: Viewer
) -> AsyncIterator[str]:
    """One job's page: each history line not on the page yet, and its header after it."""
    line_t = env.get_template("_timeline_line.html")
    head_t = env.get_template("_job_head.html")
    yield ": connected\n\n"
    async with _channel(gw, feed_channel(job_id)) as next_message:
        async for batch in _batches(request, next_message, prime=True):
            if batch is None:
                yield ": keep-alive\n\n"
                continue
            history = await store.history(gw.pool, job_id, who.principal.can_read)
            lines = [r for r in history if r["event_id"] not in seen]
            if not lines:
                continue
            seen.update(r["event_id"] for r in lines)
            html = "".join(line_t.render(line=r) for r in lines)
            row = await store.get_job(gw.pool, job_id)
            if row is not None:
                html += head_t.render(job=dict(row), oob=True)
            yield sse("line", html)
