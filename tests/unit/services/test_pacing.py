"""The fetch pacer: a consumer polls at its busy wait while records arrive, at the idle wait
once none has for `quiet_s`, and at the busy wait again from the next record on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.common.pacing import FetchPacer, idle_wait


def fake_consumer(wait_ms: int = 0) -> SimpleNamespace:
    return SimpleNamespace(_fetcher=SimpleNamespace(_fetch_max_wait_ms=wait_ms))


def wait_of(consumer: SimpleNamespace) -> int:
    return int(consumer._fetcher._fetch_max_wait_ms)


def pacer_of(busy_ms: int, quiet_s: float = 3600, factor: int = 5) -> FetchPacer:
    """A pacer going 5 times slower (at most every 500 ms) after `quiet_s` without records."""
    return FetchPacer(busy_ms, factor=factor, max_ms=500, quiet_s=quiet_s)


@pytest.mark.parametrize(
    ("busy", "factor", "cap", "expected"),
    [
        (10, 5, 500, 50),
        (100, 5, 500, 500),
        (250, 5, 500, 500),  # capped
        (600, 5, 500, 600),  # never below the busy wait
        (100, 1, 500, 100),  # a factor of 1: no pacing
        (100, 0, 500, 100),  # a nonsense factor behaves as 1
    ],
)
def test_idle_wait(busy: int, factor: int, cap: int, expected: int) -> None:
    assert idle_wait(busy, factor, cap) == expected


async def test_quiet_until_records_then_busy_then_quiet_again() -> None:
    consumer = fake_consumer()
    pacer = pacer_of(10, quiet_s=0.05)
    pacer.attach(consumer)
    assert wait_of(consumer) == 50
    pacer.saw_records()
    assert wait_of(consumer) == 10
    assert not pacer.quiet
    # The timer set at the records fires before a later, longer sleep ends.
    await asyncio.sleep(0.3)
    assert pacer.quiet
    assert wait_of(consumer) == 50
    pacer.saw_records()
    assert wait_of(consumer) == 10
    pacer.close()


async def test_records_keep_it_busy() -> None:
    consumer = fake_consumer()
    pacer = pacer_of(100)
    pacer.attach(consumer, quiet=False)  # a reader with a log to catch up: busy at once
    assert wait_of(consumer) == 100
    for _ in range(3):
        pacer.saw_records()
        await asyncio.sleep(0)
    assert not pacer.quiet
    assert wait_of(consumer) == 100
    pacer.close()


async def test_consumer_learnt_from_the_first_batch() -> None:
    consumer = fake_consumer(500)
    pacer = pacer_of(100)
    assert pacer.wait_ms == 500  # what the subscription starts with
    pacer.saw_records(consumer)
    assert wait_of(consumer) == 100
    pacer.close()


async def test_a_client_made_anew_gets_the_busy_wait_at_its_first_batch() -> None:
    """The old client was busy when the new one came: the new one starts with what it was
    built with (the idle wait) and must be told at once, not at the next change."""
    first, second = fake_consumer(), fake_consumer(500)
    pacer = pacer_of(10)
    pacer.saw_records(first)
    assert wait_of(first) == 10
    pacer.saw_records(second)
    assert wait_of(second) == 10
    pacer.close()


async def test_a_new_busy_wait_applies_at_once_and_moves_the_idle_one() -> None:
    consumer = fake_consumer()
    pacer = pacer_of(250)
    pacer.attach(consumer)
    assert wait_of(consumer) == 500
    pacer.set_busy_ms(10)  # a standby takes the lead
    assert wait_of(consumer) == 50  # still quiet, at the new idle wait
    pacer.saw_records()
    assert wait_of(consumer) == 10
    pacer.set_busy_ms(250)  # and leaves it
    assert wait_of(consumer) == 250
    pacer.close()


async def test_a_wake_makes_a_quiet_consumer_busy_at_once() -> None:
    consumer = fake_consumer()
    pacer = pacer_of(250, quiet_s=0.05)
    pacer.attach(consumer)
    pacer.set_busy_ms(10, wake=True)  # taking the lead: read to the end now
    assert wait_of(consumer) == 10
    await asyncio.sleep(0.3)  # and quiet again once nothing came
    assert wait_of(consumer) == 50
    pacer.close()


async def test_busy_with_nothing_slower_to_go_to_then_a_shorter_wait_still_goes_quiet() -> None:
    """Busy while the idle wait equals the busy one (no timer was needed), then a shorter busy
    wait without a wake: a timer must still bring it to the new idle wait."""
    consumer = fake_consumer()
    pacer = pacer_of(500, quiet_s=0.05)
    pacer.attach(consumer, quiet=False)
    assert pacer._timer is None
    pacer.set_busy_ms(20)
    assert wait_of(consumer) == 20
    await asyncio.sleep(0.3)
    assert wait_of(consumer) == 100
    pacer.close()


async def test_a_factor_of_one_never_changes_the_wait() -> None:
    consumer = fake_consumer()
    pacer = pacer_of(10, quiet_s=0.01, factor=1)
    pacer.attach(consumer)
    pacer.saw_records()
    await asyncio.sleep(0.1)
    assert wait_of(consumer) == 10
    assert pacer._timer is None


async def test_objects_without_the_knobs_are_left_alone() -> None:
    """The in-memory test broker's consumer has no fetcher: pacing it does nothing."""
    pacer = pacer_of(10)
    pacer.attach(object())
    pacer.saw_records()
    assert pacer.wait_ms == 10
    pacer.close()


class FakeFetcher:
    """aiokafka's fetcher as the wait at the client sees it: a wait it sends, and one fetch
    per call that brings records or not."""

    def __init__(self, brings: bool = False) -> None:
        self._fetch_max_wait_ms = 500
        self._closed = False
        self.brings = brings
        self.fetches = 0

    async def _proc_fetch_request(self, assignment: object, node_id: int, request: object) -> bool:
        self.fetches += 1
        return self.brings


ACTIVE = SimpleNamespace(active=True)


def long_quiet() -> FetchPacer:
    """Busy every 10 ms; quiet (from the start), every 60 s: far longer than a test."""
    return FetchPacer(10, factor=6000, max_ms=60_000, quiet_s=3600, at_client=True)


async def test_at_the_client_the_broker_holds_the_busy_wait_and_the_rest_is_spent_here() -> None:
    fetcher = FakeFetcher()
    pacer = long_quiet()
    pacer.attach(SimpleNamespace(_fetcher=fetcher))
    assert fetcher._fetch_max_wait_ms == 10  # the busy wait, quiet or not
    fetch = asyncio.ensure_future(fetcher._proc_fetch_request(ACTIVE, 0, None))
    await asyncio.sleep(0.05)
    assert fetcher.fetches == 1 and not fetch.done()  # it brought nothing: it rests
    pacer.saw_records()  # records (here from elsewhere): busy, and the rest ends
    assert await asyncio.wait_for(fetch, 5) is False
    assert fetcher._fetch_max_wait_ms == 10
    # Busy, an empty fetch does not rest: the broker held it the whole busy wait.
    assert await asyncio.wait_for(fetcher._proc_fetch_request(ACTIVE, 0, None), 5) is False
    pacer.close()


async def test_a_fetch_that_brings_records_or_whose_assignment_ended_does_not_rest() -> None:
    fetcher = FakeFetcher(brings=True)
    pacer = long_quiet()
    pacer.attach(SimpleNamespace(_fetcher=fetcher))
    assert await asyncio.wait_for(fetcher._proc_fetch_request(ACTIVE, 0, None), 5) is True
    fetcher.brings = False
    ended = SimpleNamespace(active=False)
    assert await asyncio.wait_for(fetcher._proc_fetch_request(ended, 0, None), 5) is False
    pacer.close()


async def test_a_wake_or_close_ends_a_rest_and_a_later_pacer_takes_the_fetcher_over() -> None:
    fetcher = FakeFetcher()
    first = long_quiet()
    first.attach(SimpleNamespace(_fetcher=fetcher))
    wrapped = fetcher._proc_fetch_request
    fetch = asyncio.ensure_future(fetcher._proc_fetch_request(ACTIVE, 0, None))
    await asyncio.sleep(0.05)
    assert not fetch.done()
    first.set_busy_ms(5, wake=True)  # a scheduler replica taking the lead
    assert await asyncio.wait_for(fetch, 5) is False
    assert fetcher._fetch_max_wait_ms == 5
    # Another pacer (a client made anew is paced by the latest): wrapped once, its waits.
    second = long_quiet()
    second.attach(SimpleNamespace(_fetcher=fetcher))
    assert fetcher._proc_fetch_request is wrapped
    fetch = asyncio.ensure_future(fetcher._proc_fetch_request(ACTIVE, 0, None))
    await asyncio.sleep(0.05)
    assert not fetch.done()
    second.close()  # shutting down: nothing waits on
    assert await asyncio.wait_for(fetch, 5) is False
    first.close()


async def test_a_cancelled_rest_ends_the_fetch_as_aiokafka_does_and_closing_never_rests() -> None:
    """aiokafka closes a fetcher by cancelling each fetch task and awaiting it: its own fetch
    returns False when cancelled, and so must a rest, or the close raises and the consumer's
    connections stay open. A fetcher that is closing does not rest at all."""
    fetcher = FakeFetcher()
    pacer = long_quiet()
    pacer.attach(SimpleNamespace(_fetcher=fetcher))
    task = asyncio.ensure_future(fetcher._proc_fetch_request(ACTIVE, 0, None))
    await asyncio.sleep(0.05)
    assert not task.done()
    task.cancel()
    assert await asyncio.wait_for(task, 5) is False  # no CancelledError out of it
    fetcher._closed = True
    assert await asyncio.wait_for(fetcher._proc_fetch_request(ACTIVE, 0, None), 5) is False
    pacer.close()


async def test_at_the_broker_the_fetcher_is_left_as_it_is() -> None:
    fetcher = FakeFetcher()
    original = fetcher._proc_fetch_request
    pacer = FetchPacer(10, factor=5, max_ms=500, quiet_s=3600)
    pacer.attach(SimpleNamespace(_fetcher=fetcher))
    assert fetcher._fetch_max_wait_ms == 50
    assert fetcher._proc_fetch_request == original
    pacer.close()
