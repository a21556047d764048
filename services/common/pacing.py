"""How often a consumer asks the broker for records: fast while records flow, slowly once its
partitions have been quiet for a while.

Tansu answers a fetch with no data only at its `fetch_max_wait_ms` deadline, so that wait is
a consumer's polling period, and every poll costs the broker, more the more partitions it
names (shared/INFRA.md; docs/performance.md "Idle consumers poll slowly"). A stack of twenty
consumers polling every 10-100 ms kept the broker more than half a core busy with nothing to
do. A pacer lengthens the fetch wait of a consumer that has seen no record for `quiet_s` to
`idle_wait(busy, factor, max)` and restores the short one with the first record it sees: the
first record after a quiet spell waits up to the long wait, the ones after it do not.

Only the fetches are paced. A FastStream batch subscriber's own loop (`getmany` for
`batch_timeout_ms`, then as long a sleep when it got nothing) keeps the busy period: that loop
costs the service little, and a long sleep there would delay the first record again.

Where a quiet consumer's long wait is spent (`at_client`, QM_FETCH_WAIT_AT): a broker that
holds a fetch until data comes (Kafka) should hold it, since it answers the moment a record
arrives. Tansu answers only at the deadline, and holding a fetch costs it CPU for as long as it
holds it: about 2.9 ms of CPU for a fetch held 500 ms, 1.5 ms for 10 ms (docs/performance.md,
"The fetch wait at the client"). With `at_client` every fetch asks the broker to hold it the
busy wait, as a busy consumer's always is, and a quiet consumer's fetch that brought nothing
is followed by the rest of the long wait in the client: records are seen just as late as a
fetch held the whole wait would show them, and the broker does nothing meanwhile. Records or a
wake end a wait under way. (Holding every fetch 1 ms and waiting the rest in the client cut
an idle broker's CPU further, but under load the stack placed less than half of what it was
offered: see the performance notes.)
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


def idle_wait(busy_ms: int, factor: int, max_ms: int) -> int:
    """The wait of a quiet consumer: `factor` times its busy wait, at most `max_ms`, and never
    shorter than the busy wait itself (a factor of 1 turns pacing off)."""
    return max(busy_ms, min(busy_ms * max(factor, 1), max_ms))


class FetchPacer:
    """Keeps one aiokafka consumer's fetch wait at `busy_ms` while records arrive and at the
    idle wait once none has for `quiet_s`. `saw_records` is called with every non-empty
    batch; the consumer is learnt from `attach` or from the batches (the latest one wins: a
    client may be made anew)."""

    def __init__(
        self, busy_ms: int, *, factor: int, max_ms: int, quiet_s: float, at_client: bool = False
    ) -> None:
        self.factor = factor
        self.max_ms = max_ms
        self.quiet_s = quiet_s
        self.busy_ms = busy_ms
        self.idle_ms = idle_wait(busy_ms, factor, max_ms)
        self.quiet = True
        self.at_client = at_client
        self._consumer: Any = None
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._resting: set[asyncio.Future[None]] = set()  # waits at the client under way

    @property
    def attached(self) -> bool:
        """Whether it paces a consumer yet."""
        return self._consumer is not None

    @property
    def wait_ms(self) -> int:
        """The wait the consumer should have now."""
        return self.idle_ms if self.quiet else self.busy_ms

    def attach(self, consumer: Any, *, quiet: bool = True) -> None:
        """Pace `consumer` from now on, starting quiet (or busy, for a reader that must catch
        up at once)."""
        self._consumer = consumer
        self.quiet = True
        if quiet:
            self._apply()
        else:
            self.saw_records()  # busy now; quiet once `quiet_s` passes without records

    def set_busy_ms(self, busy_ms: int, *, wake: bool = False) -> None:
        """A new busy wait (a scheduler replica taking or leaving the lead); with `wake`, busy
        from now on as if records had come (a new leader reads to the end at once), and a
        wait at the client under way ends now."""
        self.busy_ms = busy_ms
        self.idle_ms = idle_wait(busy_ms, self.factor, self.max_ms)
        if wake:
            self.saw_records()
            self._wake_resting()
        else:
            self._arm()
        self._apply()

    def saw_records(self, consumer: Any = None) -> None:
        if consumer is not None and consumer is not self._consumer:
            self._consumer = consumer
            self._apply()
        self._last = asyncio.get_running_loop().time()
        if self.quiet:
            self.quiet = False
            self._apply()
            self._wake_resting()
        self._arm()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake_resting()

    async def rest(self) -> None:
        """Wait at the client for what the current wait adds to the broker's hold (the busy
        wait), or until a shorter one applies."""
        left = self.wait_ms - self.busy_ms
        if left <= 0:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._resting.add(done)
        timer = loop.call_later(left / 1000, _finish, done)
        try:
            await done
        finally:
            timer.cancel()
            self._resting.discard(done)

    def _wake_resting(self) -> None:
        for done in list(self._resting):
            _finish(done)

    def _arm(self) -> None:
        """A busy consumer always has a timer to make it quiet (when there is a slower wait
        to go to)."""
        if not self.quiet and self._timer is None and self.idle_ms > self.busy_ms:
            loop = asyncio.get_running_loop()
            left = max(0.0, self._last + self.quiet_s - loop.time())
            self._timer = loop.call_later(left, self._check)

    def _check(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        left = self._last + self.quiet_s - loop.time()
        if left > 0:  # records came since the timer was set: look again when they would be old
            self._timer = loop.call_later(left, self._check)
            return
        self.quiet = True
        self._apply()

    def _apply(self) -> None:
        # aiokafka reads the wait for every fetch it sends and has no public setter.
        fetcher = getattr(self._consumer, "_fetcher", None)
        if fetcher is None or not hasattr(fetcher, "_fetch_max_wait_ms"):
            return
        if self.at_client and wait_at_client(fetcher, self):
            fetcher._fetch_max_wait_ms = self.busy_ms
        else:
            fetcher._fetch_max_wait_ms = self.wait_ms


def _finish(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def wait_at_client(fetcher: Any, pacer: FetchPacer) -> bool:
    """Make aiokafka's `fetcher` wait at the client, what `pacer`'s wait adds to the broker's
    hold, after each fetch that brought nothing (once per fetcher; a later pacer takes over).
    Returns False, leaving it as it is, when the fetcher is not one this knows.

    aiokafka's fetcher sends one fetch per broker and the next only when the last one's
    `_proc_fetch_request` has returned, which says whether it brought records (or an error
    to hand over); so resting before it returns holds back that broker's next fetch. A fetch
    for an assignment that changed meanwhile does not rest (its partitions are fetched anew
    at once, as before), nor one of a fetcher closing. Cancelled while resting (the fetcher
    closing, or the assignment gone), it returns as aiokafka's own does when cancelled while
    it fetches: the fetcher's close awaits its tasks and would raise otherwise, and the
    consumer's stop would end before closing its connections."""
    fetch = getattr(fetcher, "_proc_fetch_request", None)
    if fetch is None:
        return False
    if getattr(fetcher, "_qm_rests_with", None) is not None:
        fetcher._qm_rests_with = pacer
        return True
    fetcher._qm_rests_with = pacer

    async def fetch_then_rest(assignment: Any, node_id: Any, request: Any) -> Any:
        got = await fetch(assignment, node_id, request)
        if got or not getattr(assignment, "active", False) or getattr(fetcher, "_closed", False):
            return got
        # Cancelled: as aiokafka's fetch does (see above); the task ends here either way.
        with contextlib.suppress(asyncio.CancelledError):
            await fetcher._qm_rests_with.rest()
        return got

    fetcher._proc_fetch_request = fetch_then_rest
    return True
