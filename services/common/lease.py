"""A leader lease in Redis with a fencing epoch.

Whoever holds `<name>:holder` leads. Each new acquisition increments `<name>:epoch`, and every
decision carries that epoch, so consumers can ignore a deposed leader's late decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

# Renew only if we still hold it: a check-and-extend must be atomic.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass
class RedisLease:
    redis: Redis
    name: str
    holder: str
    ttl_ms: int = 3000
    epoch: int | None = None

    @property
    def held(self) -> bool:
        return self.epoch is not None

    async def try_acquire(self) -> bool:
        """Take the lease if it is free; on success a fresh epoch is drawn."""
        if await self.redis.set(f"{self.name}:holder", self.holder, nx=True, px=self.ttl_ms):
            self.epoch = int(await self.redis.incr(f"{self.name}:epoch"))
            return True
        return False

    async def renew(self) -> bool:
        ok = await self.redis.eval(_RENEW, 1, f"{self.name}:holder", self.holder, self.ttl_ms)
        if not ok:
            self.epoch = None
        return bool(ok)

    async def release(self) -> None:
        if self.epoch is not None:
            await self.redis.eval(_RELEASE, 1, f"{self.name}:holder", self.holder)
        self.epoch = None

    async def current_holder(self) -> str | None:
        value = await self.redis.get(f"{self.name}:holder")
        return value.decode() if isinstance(value, bytes) else value
