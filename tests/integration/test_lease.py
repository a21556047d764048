"""The scheduler's leader lease on a real Redis: one holder, fresh epochs, no stale renewals."""

from __future__ import annotations

import asyncio
import uuid

from redis.asyncio import Redis

from services.common.lease import RedisLease


async def test_one_leader_and_a_new_epoch_after_expiry(redis_url: str) -> None:
    redis = Redis.from_url(redis_url)
    name = f"qm:test:{uuid.uuid4().hex[:8]}"
    a = RedisLease(redis, name, "a", ttl_ms=300)
    b = RedisLease(redis, name, "b", ttl_ms=300)
    try:
        assert await a.try_acquire() and a.epoch == 1
        assert not await b.try_acquire()
        assert await a.renew()
        await asyncio.sleep(0.4)  # a stalls past its lease
        assert await b.try_acquire() and b.epoch == 2
        assert not await a.renew() and not a.held  # a deposed leader learns it
        await b.release()
        assert await b.current_holder() is None
    finally:
        await redis.delete(f"{name}:holder", f"{name}:epoch")
        await redis.aclose()


async def test_an_epoch_is_never_at_or_below_the_newest_seen(redis_url: str) -> None:
    """Redis lost its counter (a restart without persistence) while the log holds epoch 41:
    the next leader's epoch must be above it, or executors would refuse all it decides."""
    redis = Redis.from_url(redis_url)
    name = f"qm:test:{uuid.uuid4().hex[:8]}"
    a = RedisLease(redis, name, "a", ttl_ms=300)
    try:
        assert await a.try_acquire(floor=41) and a.epoch == 42
        await a.release()
        assert await a.try_acquire(floor=10) and a.epoch == 43  # a low floor changes nothing
    finally:
        await redis.delete(f"{name}:holder", f"{name}:epoch")
        await redis.aclose()
