"""Every refusal the gateway gives carries its reason, and nothing a client sends makes a 500.

- A body over the submission limit is a 413 naming the limit, checked while it arrives (a
  missing or lying Content-Length changes nothing).
- A JSON body that is not strict JSON (not UTF-8, NaN/Infinity anywhere, nested too deeply, a
  NUL or a lone surrogate in any string) is a 422 with the reason, before any route sees it:
  the same rules as for records on Kafka (schemas.bounds.parse_json).
- A body that does not validate is FastAPI's 422, whose `detail` lists each field and why.
- PostgreSQL or Redis unreachable is a 503 with `Retry-After`, not a 500.
"""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from schemas.bounds import MAX_SUBMISSION_BYTES, WireError, parse_json

log = structlog.get_logger()

RETRY_AFTER_S = 2
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})

# Documented on the routes that take a body (OpenAPI `responses=`).
BODY_ANSWERS: dict[int | str, dict[str, Any]] = {
    413: {"description": f"The body is over {MAX_SUBMISSION_BYTES:,} bytes."},
    422: {
        "description": "The body is not strict JSON (the reason says why), or a field is "
        "invalid (`detail` lists each field and its reason)."
    },
    503: {"description": "A store is unavailable; retry after `Retry-After` seconds."},
}


class StrictBody:
    """ASGI middleware: reads a request body whole (bounded), checks it, and hands the same
    bytes on to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_SUBMISSION_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _WITH_BODY:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _answer(
                    send,
                    413,
                    f"the body is over {self.max_bytes:,} bytes; the limit is "
                    f"{self.max_bytes:,} bytes",
                )
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body.strip() and _is_json(scope):
            try:
                parse_json(body, max_bytes=self.max_bytes)
            except WireError as exc:
                await _answer(send, 413 if exc.reason == "too_large" else 422, str(exc))
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return b"json" in value.lower()
    return True  # no content type: FastAPI reads the body as JSON anyway


async def _answer(send: Send, status: int, reason: str) -> None:
    body = json.dumps({"detail": reason}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


_UNAVAILABLE = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.InterfaceError,
    RedisConnectionError,
    RedisTimeoutError,
)


async def _store_unavailable(request: Request, exc: Exception) -> JSONResponse:
    log.warning(
        "a store is unavailable", path=request.url.path, error=f"{type(exc).__name__}: {exc}"
    )
    return JSONResponse(
        {"detail": "a store the gateway needs is unavailable; retry shortly"},
        status_code=503,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def install(app: FastAPI) -> None:
    app.add_middleware(StrictBody)
    for kind in _UNAVAILABLE:
        app.add_exception_handler(kind, _store_unavailable)
