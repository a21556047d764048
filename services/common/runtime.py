"""The process shell every service shares: an HTTP app with /healthz and /metrics whose
lifespan starts the service's stores, broker and background loops, served by uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.common.logging import configure_logging
from services.common.settings import ServiceSettings

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
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

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
        for hook in self.startup:
            await hook()
        for loop in self.loops:
            self._tasks.append(asyncio.create_task(self._guard(loop), name=loop.__name__))
        self.ready = True
        log.info("service started", port=self.settings.http_port)
        try:
            yield
        finally:
            self.ready = False
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for hook in reversed(self.shutdown):
                try:
                    await hook()
                except Exception:
                    log.warning("shutdown hook failed", hook=hook.__name__, exc_info=True)
            log.info("service stopped")

    async def _guard(self, loop: Callable[[], Awaitable[None]]) -> None:
        """A background loop that dies is restarted after a pause, never silently lost."""
        while True:
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background loop crashed; restarting", loop=loop.__name__)
                await asyncio.sleep(1.0)


def create_http_app(runtime: Runtime, **fastapi_kwargs: Any) -> FastAPI:
    app = FastAPI(
        title=f"quartermaster-{runtime.name}", lifespan=runtime.lifespan, **fastapi_kwargs
    )

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> Response:
        status = 200 if runtime.ready else 503
        return Response(content="ok" if runtime.ready else "starting", status_code=status)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(runtime.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(app: FastAPI, settings: ServiceSettings, name: str) -> None:
    """Run until SIGINT/SIGTERM; uvicorn drives the lifespan so shutdown is orderly."""
    configure_logging(name, settings.log_format, settings.log_level)
    config = uvicorn.Config(
        app,
        host=settings.http_host,
        port=settings.http_port,
        log_level="warning",
        access_log=False,
        lifespan="on",
    )
    uvicorn.Server(config).run()
