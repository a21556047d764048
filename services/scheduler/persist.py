"""Start from the latest snapshot, and take snapshots as the feed moves on (see snapshot.py).

Every replica takes them, leader and standbys alike, and the store keeps whichever covers the
most of the log. A leader leaves the work to a standby when another replica's snapshot is recent
(capturing stops its loop for the time it takes: tens of milliseconds per 10,000 jobs held), and
takes them itself when it runs alone. Without a usable snapshot (PostgreSQL away, none taken
yet, one of another log) a start replays the topics only while the log is whole, and waits
otherwise (see `load`); a snapshot that failed to save is tried again at the next interval.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import fields
from datetime import UTC, datetime

import structlog
from pydantic import ValidationError

from services.common.db import create_pool
from services.scheduler.feed import Feed, Mark, truncated, verify_marks
from services.scheduler.handlers import SchedulerMetrics
from services.scheduler.snapshot import capture_in_slices, decode, marks_of, restore
from services.scheduler.state import SchedulerState
from services.scheduler.store import SnapshotStore

log = structlog.get_logger()
CONNECT_TIMEOUT_S = 5.0


class Snapshots:
    def __init__(
        self,
        *,
        database_url: str,
        name: str,
        bootstrap: str,
        state: SchedulerState,
        feed: Feed,
        metrics: SchedulerMetrics,
        holder: str,
        every_s: float,
        min_records: int,
        leading: Callable[[], bool],
        topics: tuple[str, ...],
        replay_truncated: bool = False,
    ) -> None:
        self.database_url = database_url
        self.name = name
        self.bootstrap = bootstrap
        self.state = state
        self.feed = feed
        self.metrics = metrics
        self.holder = holder
        self.every_s = every_s
        self.min_records = min_records
        self.leading = leading
        self.topics = topics
        self.replay_truncated = replay_truncated
        self._store: SnapshotStore | None = None
        self._taken_at_records = 0
        # When the stored snapshot this process found unusable was taken: its next one
        # replaces it even if that one claims to cover more (it counted another log).
        self._unusable: datetime | None = None

    async def store(self) -> SnapshotStore:
        if self._store is None:
            pool = await asyncio.wait_for(create_pool(self.database_url, 2), CONNECT_TIMEOUT_S)
            store = SnapshotStore(pool, self.name)
            try:
                await store.migrate()
            except BaseException:
                await pool.close()
                raise
            self._store = store
        return self._store

    async def close(self) -> None:
        if self._store is not None:
            await self._store.pool.close()

    async def load(self) -> dict[tuple[str, int], Mark] | None:
        """Restores the latest usable snapshot into the state and returns the marks the feed
        resumes from; or None: read every topic from the beginning, which rebuilds the whole
        state only while the log is whole (no partition truncated by retention). Without a
        usable snapshot and with a truncated log it waits, retrying, rather than decide on a
        state that misses old jobs and placements (`QM_REPLAY_TRUNCATED_LOG` overrides)."""
        pause = 1.0
        while True:
            outcome = await self._try_load()
            if not isinstance(outcome, str):
                return outcome
            missing = await self._truncated()
            if not missing:
                if outcome:
                    log.warning("replaying the topics: the log is whole", why=outcome)
                return None
            if self.replay_truncated:
                log.error(
                    "replaying a truncated log (QM_REPLAY_TRUNCATED_LOG): records before these "
                    "offsets are unknown to the scheduler",
                    why=outcome,
                    truncated=missing[:10],
                )
                return None
            log.error(
                "no usable snapshot and the log is truncated: waiting for one",
                why=outcome,
                truncated=missing[:10],
                retry_in_s=pause,
            )
            await asyncio.sleep(pause)
            pause = min(pause * 2, 30.0)

    async def _truncated(self) -> list[str]:
        try:
            return await truncated(self.bootstrap, self.topics)
        except Exception as exc:
            return [f"unknown: {exc!r}"[:200]]  # cannot tell: as unsafe as truncated

    async def _try_load(self) -> dict[tuple[str, int], Mark] | str:
        """The marks of a restored snapshot, or why none was restored ("" when there is
        none)."""
        started = time.perf_counter()
        try:
            stored = await (await self.store()).latest()
        except Exception as exc:
            return f"snapshots unavailable: {exc!r}"[:300]
        if stored is None:
            return ""
        try:
            snap = decode(stored.body)
        except (ValidationError, ValueError) as exc:
            self._unusable = stored.taken_at
            return "a snapshot this version cannot read: " + str(exc).splitlines()[0][:300]
        verdict = await verify_marks(self.bootstrap, marks_of(snap))
        if verdict.matches is None:
            return f"the snapshot could not be checked against the log: {verdict.why}"
        if not verdict.matches:
            self._unusable = stored.taken_at
            return f"the snapshot is not of this log: {verdict.why}"
        # Filled apart and moved over whole, so a failure half-way leaves the state empty.
        fresh = SchedulerState(time_scale=self.state.time_scale)
        try:
            marks = restore(fresh, snap)
        except (KeyError, ValueError) as exc:
            self._unusable = stored.taken_at
            return f"the snapshot does not restore: {exc!r}"
        for f in fields(SchedulerState):
            setattr(self.state, f.name, getattr(fresh, f.name))
        self._unusable = None
        self.metrics.resumed.set(1)
        log.info(
            "resumed from a snapshot",
            taken_at=stored.taken_at.isoformat(),
            taken_by=stored.taken_by,
            bytes=len(stored.body),
            jobs=len(fresh.queued),
            seconds=round(time.perf_counter() - started, 3),
        )
        return marks

    async def run(self) -> None:
        # The first snapshot comes one interval after catching up when the start read at least
        # `min_records` (a start that replayed the log, or a long tail after the snapshot).
        await self.feed.caught_up.wait()
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.take()
            except Exception as exc:
                self.metrics.snapshots.labels("failed").inc()
                log.warning("snapshot not taken", error=repr(exc)[:300])

    async def take(self, force: bool = False) -> bool:
        """One snapshot, unless little was read since the last or (on a leader) another
        replica's is recent; whether one was stored."""
        if not force and self.feed.records - self._taken_at_records < self.min_records:
            return False
        store = await self.store()
        if not force and self.leading():
            latest = await store.latest_meta()
            if latest is not None:
                taken_at, taken_by = latest
                age = (datetime.now(UTC) - taken_at).total_seconds()
                if taken_by != self.holder and age < 1.5 * self.every_s:
                    return False
        started = time.perf_counter()
        marks = self.feed.marks()
        # The state is taken before the first await: it and the marks agree.
        body = await capture_in_slices(self.state, marks)
        self.metrics.snapshot_capture.observe(time.perf_counter() - started)
        progress = sum(mark[0] for mark in marks.values())
        records = self.feed.records
        saved = await store.save(body, progress, self.holder, self._unusable)
        self._taken_at_records = records
        if saved:
            self._unusable = None
        self.metrics.snapshots.labels("saved" if saved else "superseded").inc()
        self.metrics.snapshot_bytes.set(len(body))
        return saved
