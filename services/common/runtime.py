"""The process shell every service shares: an HTTP app with /healthz and /metrics whose
lifespan starts the service's stores, broker and background loops, served by uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.errors import Failure, classify, describe
from services.common.logging import configure_logging
from services.common.settings import ServiceSettings
from services.common.singleton import Singleton
from services.common.tracing import Tracing

log = structlog.get_logger()

Hook = Callable[[], Awaitable[None]]


@dataclass
class Runtime:
    """What a service registers to run between start and stop."""

    name: str
    settings: ServiceSettings
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    ready: bool = False
    startup: list[Hook] = field(default_factory=list)
    shutdown: list[Hook] = field(default_factory=list)
    loops: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # Set for a service that must run as one instance (services.common.singleton): start-up
    # then waits for the lease, in the background, while /healthz already answers.
    singleton: Singleton | None = None
    # A singleton whose start-up failed starts afresh after this pause.
    start_retry_s: float = 2.0
    # The process's traces (services.common.tracing), None when tracing is off.
    tracing: Tracing | None = field(init=False, default=None)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _started: bool = False
    # Shutdown steps cut off while still running (they may ignore their cancellation).
    _abandoned: list[asyncio.Future[object]] = field(default_factory=list)
    # When the lifespan's shutdown must be over (loop time), once it has begun.
    _deadline: float | None = None

    def __post_init__(self) -> None:
        self.tracing = Tracing.configure(self.name, self.settings)

    def on_startup(self, hook: Hook) -> Hook:
        self.startup.append(hook)
        return hook

    def on_shutdown(self, hook: Hook) -> Hook:
        self.shutdown.append(hook)
        return hook

    def background(self, loop: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        self.loops.append(loop)
        return loop

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        if self.singleton is None:
            await self._start()
        elif await self.singleton.try_acquire():
            # Free: start as any service does, then keep renewing in the background.
            try:
                await self._start()
            except Exception:
                await self._give_up_start(self.singleton)
            else:
                self._tasks.append(asyncio.create_task(self.singleton.hold(), name="lease"))
        else:
            self._tasks.append(asyncio.create_task(self._lead(self.singleton), name="lead"))
        self.ready = True
        loop_module = type(asyncio.get_running_loop()).__module__
        log.info("service started", port=self.settings.http_port, loop=loop_module.split(".")[0])
        try:
            yield
        finally:
            self.ready = False
            loop = asyncio.get_running_loop()
            self._deadline = loop.time() + self.settings.shutdown_deadline_s
            for task in self._tasks:
                task.cancel()
            tasks = list(self._tasks)
            await self._bounded(
                lambda: asyncio.gather(*tasks, return_exceptions=True), "stop the loops"
            )
            if self._started:
                for hook in reversed(self.shutdown):
                    await self._bounded(hook, _name_of(hook))
            if self.singleton is not None:
                await self._bounded(self.singleton.release, "release the lease")
            if (tracing := self.tracing) is not None:
                # Writes what is queued (to a collector that may not answer): in a thread of
                # its own that a process may exit without, not the loop's executor, whose
                # close at exit would wait for it.
                await self._bounded(lambda: in_daemon_thread(tracing.shutdown), "write the traces")
            log.info("service stopped")
            self._exit_if_stuck()

    async def _bounded(self, step: Callable[[], Awaitable[object]], name: str) -> None:
        """One shutdown step, cut off after `shutdown_step_s`: a step that hangs must not keep
        the service (or a test) from stopping, nor the steps after it from running. A step
        that also ignores its cancellation is left behind; the process still exits, but an
        event loop that is closed afterwards (asyncio.run's) waits for it."""
        limit = self._limit()
        try:
            running = asyncio.ensure_future(step())
        except Exception:
            log.warning("shutdown step failed", step=name, exc_info=True)
            return
        try:
            await asyncio.wait({running}, timeout=limit)
        except asyncio.CancelledError:
            running.cancel()  # the shutdown itself was cancelled: so is its step
            raise
        if not running.done():
            running.cancel()  # not waited on: it may ignore its cancellation as well
            running.add_done_callback(_retrieve)
            self._abandoned.append(running)
            log.error("shutdown step did not finish; cut off", step=name, limit_s=limit)
        elif running.cancelled():
            log.warning("shutdown step was cancelled", step=name)
        elif (exc := running.exception()) is not None:
            log.warning("shutdown step failed", step=name, exc_info=exc)

    def _limit(self) -> float:
        """A step's time: `shutdown_step_s`, and no more than what is left of the shutdown's
        `shutdown_deadline_s` (a step past it still gets a tenth of a second to do what it
        does at once, e.g. release a lease)."""
        limit = self.settings.shutdown_step_s
        if self._deadline is not None:
            left = self._deadline - asyncio.get_running_loop().time()
            limit = min(limit, max(0.1, left))
        return limit

    def _exit_if_stuck(self) -> None:
        """The last resort of a service's own process: a cut-off step that ignored its
        cancellation would keep the event loop's close (asyncio.Runner cancels and waits for
        every task left) from ever returning, so the process ends itself one more step's time
        later, exit code 1, unless it has ended by then."""
        stuck = [step for step in self._abandoned if not step.done()]
        if not stuck or not _own_process:
            return
        limit = max(1.0, self._limit())
        log.error("a cut-off shutdown step is still running; exiting", steps=len(stuck), in_s=limit)
        timer = threading.Timer(limit, _exit_now)
        timer.daemon = True
        timer.start()

    async def _start(self) -> None:
        if _own_process:  # only a service's own process: a test's collector is left alone
            gc.set_threshold(self.settings.gc_young_threshold, *gc.get_threshold()[1:])
        for hook in self.startup:
            await hook()
        if self.settings.gc_freeze and _own_process:
            began = time.perf_counter()
            frozen = freeze_heap()
            took_ms = round((time.perf_counter() - began) * 1000, 1)
            log.info("heap frozen", objects=frozen, took_ms=took_ms)
        for loop in self.loops:
            self._tasks.append(asyncio.create_task(self._guard(loop), name=loop.__name__))
        self._started = True

    async def _lead(self, singleton: Singleton) -> None:
        await singleton.acquire()
        try:
            await self._start()
        except Exception:
            await self._give_up_start(singleton)
            return
        await singleton.hold()

    async def _give_up_start(self, singleton: Singleton) -> None:
        """A store still away when the lease came (Redis back before PostgreSQL, say): let
        the lease go and start afresh as a standby after a pause, as a supervisor would,
        rather than end the only instance; hooks that ran half-way are not run twice in one
        process. Called from an except block."""
        log.exception("start-up failed; starting afresh", pause_s=self.start_retry_s)
        await singleton.release()

        async def afresh() -> None:
            await asyncio.sleep(self.start_retry_s)
            singleton.on_deposed()  # replaces the process (returns only outside a service)

        self._tasks.append(asyncio.create_task(afresh(), name="afresh"))

    async def _guard(self, loop: Callable[[], Awaitable[None]]) -> None:
        """A background loop that dies is restarted after a pause, never silently lost. A
        store or the broker being away is no crash: one warning, then backoff (to 10 s)."""
        pause = 0.5
        while True:
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if classify(exc) is Failure.RETRYABLE:
                    log.warning(
                        "background loop waiting for a dependency",
                        loop=loop.__name__,
                        error=describe(exc),
                        retry_in_s=pause,
                    )
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, 10.0)
                    continue
                log.exception("background loop crashed; restarting", loop=loop.__name__)
                pause = 0.5
                await asyncio.sleep(1.0)


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "unmatched"  # no route took the request (a 404 for an unknown path)


class HttpMetrics:
    """Request latency by route template and status class: an ASGI middleware, so the cost
    per request is one clock read at each end and one histogram observation. The time runs
    to the response's start (its status and headers), so a stream (server-sent events)
    counts the time to its first byte, not how long it stays open."""

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                self._observe(scope, status, time.perf_counter() - started)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            if not status:  # answered 500 by the server's error handler, outside this one
                self._observe(scope, 500, time.perf_counter() - started)
            raise

    def _observe(self, scope: Scope, status: int, seconds: float) -> None:
        method = scope.get("method", "")
        self.histogram.labels(
            method if method in HTTP_METHODS else "other",
            route_template(scope),
            status_class(status),
        ).observe(seconds)


# Set by `serve`: this process is the service's own. A runtime started inside another process
# (a test's) never freezes that process's heap.
_own_process = False


def _name_of(hook: Hook) -> str:
    # Most services' hooks are all called `close`: the module says whose it is.
    module = getattr(hook, "__module__", None) or "?"
    return f"{module}.{getattr(hook, '__qualname__', None) or repr(hook)}"


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


def in_daemon_thread(work: Callable[[], object]) -> asyncio.Future[None]:
    """`work` run in a daemon thread of its own; the future is done when it returns (or with
    its error). Unlike `asyncio.to_thread`, a thread that never returns keeps neither the
    event loop's close nor the interpreter's exit waiting."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(exc: BaseException | None) -> None:
        if done.done():
            return  # given up on (cut off)
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)

    def run() -> None:
        outcome: BaseException | None = None
        try:
            work()
        except BaseException as exc:  # handed to the awaiting side
            outcome = exc
        with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
            loop.call_soon_threadsafe(settle, outcome)

    name = f"qm-{getattr(work, '__name__', 'work')}"
    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def _retrieve(task: asyncio.Future[object]) -> None:
    # A step that failed after it was cut off: its error was no longer awaited by anyone.
    if not task.cancelled():
        task.exception()


def freeze_heap() -> int:
    """Collect once, then move every object alive into the collector's permanent generation:
    never scanned again, so a full collection costs what the service made since rather than
    everything it imported (tens of thousands of objects, pydantic's validators among them).
    Objects frozen here that later become unreachable are still freed by reference counting;
    only cycles among them stay, which start-up state does not make. Returns how many were
    frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def route_template(scope: Scope) -> str:
    """The path template of the route that took the request (`/v1/jobs/{job_id}`), never the
    path itself: ids in paths would make every job a label value."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else UNMATCHED


def status_class(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status < 600 else "other"


def http_latency(registry: CollectorRegistry) -> Histogram:
    return Histogram(
        "qm_http_request_duration_seconds",
        "HTTP requests: time to the response's start, by method, route template and status class",
        ["method", "route", "status_class"],
        registry=registry,
    )


def create_http_app(runtime: Runtime, **fastapi_kwargs: Any) -> FastAPI:
    app = FastAPI(
        title=f"quartermaster-{runtime.name}", lifespan=runtime.lifespan, **fastapi_kwargs
    )
    app.add_middleware(HttpMetrics, histogram=http_latency(runtime.registry))

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> Response:
        status = 200 if runtime.ready else 503
        # The process answering, so whoever started it can tell when its port is another's
        # (cli/stack.py PID_HEADER reads it).
        return Response(
            content="ok" if runtime.ready else "starting",
            status_code=status,
            headers={"x-qm-pid": str(os.getpid())},
        )

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(runtime.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(app: FastAPI, settings: ServiceSettings, name: str) -> None:
    """Run until SIGINT/SIGTERM; uvicorn drives the lifespan so shutdown is orderly."""
    global _own_process
    _own_process = True
    configure_logging(name, settings.log_format, settings.log_level)
    config = uvicorn.Config(
        app,
        host=settings.http_host,
        port=settings.http_port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        # Open connections (an SSE stream of `qm watch`, the dashboard's) get this long to end
        # before the lifespan's shutdown runs; uvicorn would otherwise wait for them forever.
        timeout_graceful_shutdown=max(1, round(settings.shutdown_step_s)),
        loop=settings.event_loop,
    )
    uvicorn.Server(config).run()
