"""A leader lease in Redis with a fencing epoch.

Whoever holds `<name>:holder` leads. Each new acquisition increments `<name>:epoch`, and every
decision carries that epoch, so consumers can ignore a deposed leader's late decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

# Take the lease if it is free and draw the next epoch, in one step (a process stalled between
# the two would otherwise hold an epoch without the lease). The epoch never falls to or below
# `floor`, the newest epoch the caller has seen in the log: if Redis lost the counter (a
# restart without persistence), new epochs would otherwise be older than the executors' fence
# and every placement would be refused.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local epoch = redis.call('INCR', KEYS[2])
  local floor = tonumber(ARGV[3])
  if epoch <= floor then
    epoch = floor + 1
    redis.call('SET', KEYS[2], epoch)
  end
  return epoch
end
return 0
"""
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

    async def try_acquire(self, floor: int = 0) -> bool:
        """Take the lease if it is free; on success a fresh epoch above `floor` is drawn."""
        epoch = await self.redis.eval(
            _ACQUIRE,
            2,
            f"{self.name}:holder",
            f"{self.name}:epoch",
            self.holder,
            self.ttl_ms,
            floor,
        )
        if not epoch:
            return False
        self.epoch = int(epoch)
        return True

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
