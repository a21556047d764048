"""The singleton lease against a real Redis: one holder works, a second stands by and takes
over when the first stops, a holder whose lease is taken is deposed, and a holder takes its
lease again after Redis lost every key (a restart without persistence)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis

from services.common.singleton import Singleton

pytestmark = pytest.mark.integration


async def until(check: Callable[[], Awaitable[bool] | bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        got = check()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


class Instance:
    def __init__(self, redis: Redis, service: str, name: str) -> None:
        self.deposed = 0
        self.singleton = Singleton(redis, service, ttl_s=0.6, holder=name, on_deposed=self._deposed)
        self.task: asyncio.Task[None] | None = None

    def _deposed(self) -> None:
        self.deposed += 1

    async def _run(self) -> None:
        await self.singleton.acquire()
        await self.singleton.hold()

    def start(self) -> Instance:
        self.task = asyncio.create_task(self._run())
        return self

    async def stop(self, *, release: bool = True) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        if release:
            await self.singleton.release()


async def test_one_leads_the_other_stands_by_then_takes_over(redis_url: str) -> None:
    redis = Redis.from_url(redis_url)
    service = f"svc-{uuid.uuid4().hex[:6]}"
    a = Instance(redis, service, "a").start()
    await until(lambda: a.singleton.leading)
    b = Instance(redis, service, "b").start()
    await asyncio.sleep(1.5)  # several renewals: b must still be standing by
    assert a.singleton.leading and not b.singleton.leading
    # a dies without releasing (kill -9): b takes over once the lease lapses.
    await a.stop(release=False)
    await until(lambda: b.singleton.leading)
    assert await redis.get(f"qm:singleton:{service}:holder") == b"b"
    await b.stop()
    await redis.aclose()


async def test_a_holder_whose_lease_is_taken_is_deposed(redis_url: str) -> None:
    redis = Redis.from_url(redis_url)
    service = f"svc-{uuid.uuid4().hex[:6]}"
    a = Instance(redis, service, "a").start()
    await until(lambda: a.singleton.leading)
    await redis.set(f"qm:singleton:{service}:holder", "intruder", px=60_000)
    await until(lambda: a.deposed == 1)
    assert not a.singleton.leading and a.singleton.deposed
    await a.stop()
    await redis.delete(f"qm:singleton:{service}:holder")
    await redis.aclose()


async def test_after_redis_lost_every_key_the_holder_takes_its_lease_again(
    redis_url: str,
) -> None:
    redis = Redis.from_url(redis_url)
    service = f"svc-{uuid.uuid4().hex[:6]}"
    a = Instance(redis, service, "a").start()
    await until(lambda: a.singleton.leading)
    # What a restart without persistence leaves (only our keys: the server is shared).
    await redis.delete(f"qm:singleton:{service}:holder", f"qm:singleton:{service}:epoch")

    async def held_again() -> bool:
        return await redis.get(f"qm:singleton:{service}:holder") == b"a"

    await until(held_again)
    assert a.deposed == 0 and a.singleton.leading
    await a.stop()
    await redis.aclose()


async def test_a_holder_keeps_working_while_redis_is_briefly_away() -> None:
    # A client pointed at a port nobody listens on stands for Redis being down.
    a = Singleton(Redis.from_url("redis://127.0.0.1:9"), "svc-away", ttl_s=3.0)
    deposed: list[bool] = []
    a.on_deposed = lambda: deposed.append(True)
    a._took()  # as if it had taken the lease just before Redis went away
    task = asyncio.create_task(a.hold())
    await asyncio.sleep(1.5)  # a renewal failed, but within the TTL by our own clock
    assert a.leading and not deposed
    await until(lambda: bool(deposed), timeout_s=10)  # past the TTL it steps down
    assert not a.leading
    await task


async def test_a_start_up_that_fails_after_the_lease_starts_afresh_as_a_standby(
    redis_url: str,
) -> None:
    """The lease came back before a store did (Redis before PostgreSQL): the instance neither
    ends the service nor keeps the lease; it lets go and starts afresh (`on_deposed`)."""
    from fastapi import FastAPI

    from services.common.runtime import Runtime
    from services.common.settings import ServiceSettings

    redis = Redis.from_url(redis_url)
    service = f"test-{uuid.uuid4().hex[:8]}"
    other = Instance(redis, service, "other").start()
    await until(lambda: other.singleton.leading)
    restarted: list[bool] = []
    singleton = Singleton(
        redis, service, ttl_s=0.6, holder="me", on_deposed=lambda: restarted.append(True)
    )
    runtime = Runtime(service, ServiceSettings(), singleton=singleton)

    @runtime.on_startup
    async def store_away() -> None:
        raise ConnectionRefusedError("PostgreSQL is still away")

    async with runtime.lifespan(FastAPI()):
        await other.stop()  # the lease is free: "me" takes it, and its start-up fails
        await until(lambda: restarted == [True])
        assert not singleton.leading
        assert await singleton.lease.current_holder() is None  # let go at once
    await redis.aclose()


async def test_a_start_up_that_fails_with_the_lease_free_also_starts_afresh(
    redis_url: str,
) -> None:
    """The same when the lease was free at start (no other instance), not only after waiting."""
    from fastapi import FastAPI

    from services.common.runtime import Runtime
    from services.common.settings import ServiceSettings

    redis = Redis.from_url(redis_url)
    service = f"test-{uuid.uuid4().hex[:8]}"
    restarted: list[bool] = []
    singleton = Singleton(
        redis, service, ttl_s=0.6, holder="me", on_deposed=lambda: restarted.append(True)
    )
    runtime = Runtime(service, ServiceSettings(), singleton=singleton, start_retry_s=0.0)

    @runtime.on_startup
    async def store_away() -> None:
        raise ConnectionRefusedError("PostgreSQL is still away")

    async with runtime.lifespan(FastAPI()):
        await until(lambda: restarted == [True])
        assert not singleton.leading
        assert await singleton.lease.current_holder() is None
    await redis.aclose()
