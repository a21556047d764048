"""Does a server really answer? Protocol-level checks for Kafka, PostgreSQL and Redis.

An open port is not enough (a half-started broker accepts connections and then hangs), so
each check speaks the server's own protocol: Kafka ApiVersions, a PostgreSQL ``SELECT 1``,
a Redis ``PING``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from cli.errors import ServerTimeout

T = TypeVar("T")

# Kafka ApiVersions request, version 0: the one request every Kafka-API broker must answer.
_API_VERSIONS_KEY = 18
_PROBE_CORRELATION_ID = 0x51_4D  # "QM"


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code, even inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # A loop is running in this thread (an async test, say): give the coroutine its own.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def redact(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def _host_port(bootstrap: str) -> tuple[str, int]:
    first = bootstrap.split(",")[0].strip()
    first = first.removeprefix("tcp://").removeprefix("kafka://")
    host, _, port = first.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port or 9092)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed mid-response")
        data += chunk
    return data


def kafka_answers(bootstrap: str, timeout: float = 1.0) -> bool:
    """True if the first broker in ``bootstrap`` answers an ApiVersions request."""
    client_id = b"qm-probe"
    payload = struct.pack(
        f">hhih{len(client_id)}s",
        _API_VERSIONS_KEY,
        0,
        _PROBE_CORRELATION_ID,
        len(client_id),
        client_id,
    )
    try:
        with socket.create_connection(_host_port(bootstrap), timeout=timeout) as sock:
            sock.sendall(struct.pack(">i", len(payload)) + payload)
            (size,) = struct.unpack(">i", _recv_exactly(sock, 4))
            body = _recv_exactly(sock, size)
    except (OSError, ValueError, struct.error):
        return False
    if len(body) < 6:
        return False
    correlation_id, error_code = struct.unpack(">ih", body[:6])
    return bool(correlation_id == _PROBE_CORRELATION_ID and error_code == 0)


async def _postgres_select_one(url: str, limit_s: float) -> bool:
    import asyncpg  # imported here: `qm submit` and friends never need it

    conn = await asyncpg.connect(url, timeout=limit_s)
    try:
        return bool(await conn.fetchval("SELECT 1") == 1)
    finally:
        await conn.close(timeout=limit_s)


def postgres_answers(url: str, timeout: float = 2.0) -> bool:
    """True if ``url`` accepts a connection and runs ``SELECT 1``."""
    try:
        return run_blocking(_postgres_select_one(url, timeout))
    except Exception:  # any failure (refused, auth, missing database) means "not usable"
        return False


def redis_answers(url: str, timeout: float = 1.0) -> bool:
    """True if ``url`` answers PING."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def log_tail(path: Path | None, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file, or a note that there is none."""
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(log is empty)"


def wait_until(
    check: Callable[[], bool],
    *,
    what: str,
    timeout: float,
    process: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> None:
    """Poll ``check`` until it passes; fail fast if ``process`` exits, clearly on timeout."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        if check():
            return
        if process is not None and process.poll() is not None:
            raise ServerTimeout(
                f"{what} exited with code {process.returncode} before answering; "
                f"last lines of {log}:\n{log_tail(log)}",
                exited=True,
            )
        if time.monotonic() >= deadline:
            raise ServerTimeout(
                f"{what} did not answer within {timeout:.0f}s; last lines of {log}:\n"
                f"{log_tail(log)}"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
