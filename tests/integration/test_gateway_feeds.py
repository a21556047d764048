"""The gateway's live feeds on the real Redis: every projected batch announces the jobs whose
view changed, and a job's history lines go to its own channel only while someone is
subscribed to it. A watcher that subscribes later finds the lines in the history."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import pytest
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.gateway import store
from services.gateway.handlers import (
    CHANGES_CHANNEL,
    Projector,
    feed_channel,
    subscribe_confirmed,
)
from tests.integration import test_gateway_early_events as early
from tests.integration.test_gateway_early_events import placed, queued

pytestmark = pytest.mark.integration

rig = early.rig  # the fixture: the gateway's stores, migrated

SENTINEL = feed_channel("sentinel")


async def until_sentinel(pubsub: PubSub, redis: Redis) -> list[dict[str, Any]]:
    """Every message the subscription got before a sentinel published after the batch: Redis
    delivers one connection's publishes in order, so this waits on an event, not on time."""
    await redis.publish(SENTINEL, "end")
    got: list[dict[str, Any]] = []
    async with asyncio.timeout(30):  # a guard against a hang, not a condition of the test
        async for msg in pubsub.listen():
            if msg["type"] not in ("message", "pmessage"):
                continue  # the confirmations of our own subscriptions
            if msg["channel"] == SENTINEL.encode():
                return got
            got.append(msg)
    raise AssertionError(f"the subscription ended before the sentinel; got {got}")


async def test_lines_go_only_to_watched_jobs_and_every_change_is_announced(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    pool, redis = rig
    watcher = redis.pubsub()
    everything = redis.pubsub()  # a pattern: sees every publish, counted by none
    try:
        await watcher.subscribe(feed_channel("j-watched"), CHANGES_CHANNEL, SENTINEL)
        await everything.psubscribe(feed_channel("*"))

        await Projector(pool, redis).process(
            (queued("j-watched"), queued("j-alone"), placed("j-watched"))  # type: ignore[arg-type]
        )

        to_watcher = await until_sentinel(watcher, redis)
        lines = [json.loads(m["data"]) for m in to_watcher if m["channel"] != b"qm:jobs-changed"]
        assert [(ln["job_id"], ln["type"]) for ln in lines] == [
            ("j-watched", "JobQueued"),
            ("j-watched", "PlacementDecided"),
        ]
        (changes,) = [m for m in to_watcher if m["channel"] == CHANGES_CHANNEL.encode()]
        assert sorted(row[0] for row in json.loads(changes["data"])) == ["j-alone", "j-watched"]

        published = await until_sentinel(everything, redis)
        assert {m["channel"] for m in published} == {feed_channel("j-watched").encode()}
        assert len(published) == 2  # j-alone had no subscriber: nothing was published for it
    finally:
        await watcher.aclose()
        await everything.aclose()


async def test_a_job_watched_after_its_batch_finds_the_lines_in_its_history(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    pool, redis = rig
    await Projector(pool, redis).process((queued("j-later"),))  # type: ignore[arg-type]
    # What the watch does: subscribe, then read the history. The line was not published (no
    # one listened), and the history, read after the batch committed, holds it.
    watcher = redis.pubsub()
    try:
        await watcher.subscribe(SENTINEL)
        await subscribe_confirmed(watcher, feed_channel("j-later"))
        history = await store.history(pool, "j-later", lambda _tenant: True)
        assert [r["type"] for r in history] == ["JobQueued"]
        assert await until_sentinel(watcher, redis) == []

        # Now watched: the next line of that job is published to it.
        await Projector(pool, redis).process((placed("j-later"),))  # type: ignore[arg-type]
        got = await until_sentinel(watcher, redis)
        assert [json.loads(m["data"])["type"] for m in got] == ["PlacementDecided"]
    finally:
        await watcher.aclose()


async def test_a_confirmed_subscription_is_counted_when_it_returns(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    """What the argument for skipping unwatched channels needs: once subscribe_confirmed
    returns, Redis counts the watcher, so a batch that commits after the watcher read the
    history publishes to it."""
    _, redis = rig
    watcher = redis.pubsub()
    try:
        await subscribe_confirmed(watcher, feed_channel("j-now"))
        assert await redis.pubsub_numsub(feed_channel("j-now")) == [
            (feed_channel("j-now").encode(), 1)
        ]
    finally:
        await watcher.aclose()


async def test_no_confirmation_is_a_redis_timeout() -> None:
    class Silent:
        async def subscribe(self, *channels: str) -> None:
            pass

        async def get_message(self, **_: Any) -> None:
            await asyncio.sleep(0.01)

    with pytest.raises(RedisTimeoutError):
        await subscribe_confirmed(Silent(), "qm:job-events:x", timeout_s=0.05)  # type: ignore[arg-type]
