"""A service that must run as one instance (health, meter) holds a lease in Redis while it
works; a second instance stands by, healthy, and takes over when the lease lapses.

Why these two: the health service judges silence from what it has heard, so a second replica
would declare the first one's nodes dark (and requeue every gang on them); the meter keeps
open runs in memory and bills them by its clock. Both are safe to run twice only in the
sense that their writes are idempotent, not in what they decide, so they take turns.

The lease is `qm:singleton:<service>` (SET NX PX, renewed every ttl/3 by an atomic
check-and-extend, services.common.lease). The holder keeps working while Redis is away as long
as its own clock says the lease cannot have lapsed; past the TTL it cannot prove it still
holds it and steps down. After a Redis restart (the key is gone) the holder takes the lease
again. A holder that finds another holder in its place was deposed. Stepping down restarts
the process in place (`restart_as_standby`: exec of the same command, so no supervisor is
needed and the pid, port and log stay), and the new process stands by until it can lead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.common.lease import RedisLease

log = structlog.get_logger()


def restart_as_standby() -> None:
    """Start this process afresh, in place: same pid, port and log, nothing kept in memory.
    The new process stands by until it can take the lease. Nothing is lost: offsets not yet
    committed are redelivered and consumers are idempotent; outbox rows are sent at start."""
    argv = sys.orig_argv
    if not any(arg.startswith("services.") for arg in argv[1:3]):
        # Not a service process (an app run inside a test, say): exec would replace it.
        log.error("deposed outside a service process; not restarting it", argv=argv[:3])
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.execv(sys.executable, argv)


class Singleton:
    def __init__(
        self,
        redis: Redis,
        service: str,
        *,
        ttl_s: float = 10.0,
        holder: str | None = None,
        on_deposed: Callable[[], None] = restart_as_standby,
    ) -> None:
        self.service = service
        self.ttl_s = ttl_s
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lease = RedisLease(redis, f"qm:singleton:{service}", self.holder, int(ttl_s * 1000))
        self.on_deposed = on_deposed
        self.leading = False
        self.deposed = False
        self._renewed_at = 0.0

    @property
    def every_s(self) -> float:
        return self.ttl_s / 3

    async def try_acquire(self) -> bool:
        """Take the lease if it is free (False also when Redis cannot be reached)."""
        try:
            taken = await self.lease.try_acquire()
        except RedisError:
            return False
        if taken:
            self._took()
        return taken

    def _took(self) -> None:
        self.leading = True
        self._renewed_at = time.monotonic()
        log.info("leading", service=self.service, holder=self.holder)

    async def acquire(self) -> None:
        """Return once this instance holds the lease; stand by (healthy) until then."""
        said = False
        while True:
            try:
                if await self.lease.try_acquire():
                    break
                if not said:
                    holder = await self.lease.current_holder()
                    log.info(
                        "standing by: another instance leads", service=self.service, leader=holder
                    )
                    said = True
            except RedisError as exc:
                if not said:
                    log.warning("standing by: Redis is unreachable", error=str(exc))
                    said = True
            await asyncio.sleep(self.every_s)
        self._took()

    def holds(self) -> bool:
        """Leading, with the lease renewed within its time to live: a process that was frozen
        longer may have lost it without knowing yet, and must not act as the leader."""
        return self.leading and time.monotonic() - self._renewed_at < self.ttl_s

    async def hold(self) -> None:
        """Renew until deposed (then `on_deposed`); returns only when deposed."""
        away_since: float | None = None
        while True:
            await asyncio.sleep(self.every_s)
            try:
                held = await self._renew_or_retake()
            except RedisError as exc:
                now = time.monotonic()
                if away_since is None:
                    away_since = now
                    log.warning("cannot renew the lease: Redis is unreachable", error=str(exc))
                if now - self._renewed_at < self.ttl_s:
                    continue  # it cannot have lapsed yet: keep working
                held = False
            if held:
                if away_since is not None:
                    log.info("lease renewed again", after_s=round(time.monotonic() - away_since, 1))
                away_since = None
                self._renewed_at = time.monotonic()
                continue
            self.leading = False
            self.deposed = True
            log.error("lost the singleton lease; stepping down", service=self.service)
            self.on_deposed()
            return

    async def _renew_or_retake(self) -> bool:
        if await self.lease.renew():
            return True
        # Not ours any more: gone (Redis restarted empty, or it lapsed while Redis was away
        # and nobody took it) means we take it again; someone else's means we were deposed.
        if await self.lease.current_holder() is None:
            return await self.lease.try_acquire()
        return False

    async def release(self) -> None:
        if self.leading:
            with contextlib.suppress(RedisError):  # it lapses by itself
                await self.lease.release()
        self.leading = False


def singleton_for(redis_url: str, service: str, ttl_s: float) -> Singleton:
    """The lease of `service` on the Redis at `redis_url` (a client of its own)."""
    return Singleton(Redis.from_url(redis_url), service, ttl_s=ttl_s)
