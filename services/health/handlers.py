"""The health service's shell: read a batch (or the clock), decide with services.health.book,
then write state, incidents and the announcing events in one transaction, then relay."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import Any

import asyncpg
import structlog
from aiokafka import ConsumerRecord
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.kafka import OutMessage
from services.common.outbox import OutboxRelay, Transaction
from services.health import store, stragglers
from services.health.book import (
    Changes,
    Draft,
    HealthBook,
    IdFactory,
    check,
    heartbeats_seen,
    inventory_seen,
    probes_seen,
)
from services.health.emit import messages_for
from services.health.intake import read_batch
from services.health.machine import NodeState
from services.health.rules import STRAGGLER, HealthRules

Clock = Callable[[], datetime]

log = structlog.get_logger()


class HealthMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.unhealthy = Counter(
            "qm_health_nodes_quarantined_total", "Nodes taken out", ["cause"], registry=registry
        )
        self.recovered = Counter(
            "qm_health_nodes_recovered_total", "Nodes put back", registry=registry
        )
        self.alerts = Counter("qm_health_alerts_total", "Alerts raised", registry=registry)
        self.unmatched = Counter(
            "qm_health_probes_unmatched_total", "Probes no rule matched", registry=registry
        )
        self.unknown = Counter(
            "qm_health_unknown_node_signals_total",
            "Heartbeats and probes about nodes no executor's inventory lists (ignored)",
            registry=registry,
        )
        self.dead = Counter(
            "qm_health_dead_letters_total", "Records dead-lettered", registry=registry
        )
        self.states = Gauge("qm_health_nodes", "Known nodes by state", ["state"], registry=registry)
        self.progress = Counter(
            "qm_health_progress_reports_total",
            "Job progress reports, judged or ignored (gang of one, older attempt, redelivery)",
            ["outcome"],
            registry=registry,
        )
        self.stragglers = Counter(
            "qm_health_stragglers_detected_total",
            "Nodes found straggling on a job (slow in n of its last m reports)",
            registry=registry,
        )
        self.straggler_incidents = Counter(
            "qm_health_straggler_incidents_total",
            "Straggler incidents opened (each with its one alert) and closed",
            ["event"],
            registry=registry,
        )
        self.straggling = Gauge(
            "qm_health_straggling_nodes", "Nodes straggling on at least one job", registry=registry
        )
        self.tracked = Gauge(
            "qm_health_progress_jobs",
            "Jobs whose progress the straggler detector follows",
            registry=registry,
        )


class HealthMonitor:
    def __init__(
        self,
        pool: asyncpg.Pool,
        relay: OutboxRelay,
        book: HealthBook,
        rules: HealthRules,
        metrics: HealthMetrics,
        *,
        clock: Clock,
        new_id: IdFactory,
    ) -> None:
        self.pool = pool
        self.relay = relay
        self.book = book
        self.rules = rules
        self.metrics = metrics
        self.clock = clock
        self.new_id = new_id
        # Silence is counted from the first batch consumed, not from start-up: until the
        # consumer has joined its group and caught up, every heartbeat looks old.
        self.watch_from: datetime | None = None
        # Batches and the periodic check both decide over the same book: one at a time.
        self._lock = asyncio.Lock()
        # A transaction failed: its commit may have gone through all the same (a connection
        # lost while committing). The book then lags the store: a redelivered batch would be
        # skipped as processed and the clock would decide its changes again, with new ids. So
        # the book is read back from the store before anything else is decided.
        self._stale = False
        self._count_all()  # what a restart reloaded

    async def _reload_if_stale(self) -> None:
        if self._stale:
            self.book = await store.load_book(self.pool)
            self._stale = False
            self._count_all()
            log.info("health book read back from the store after a failed transaction")

    async def process(self, records: tuple[ConsumerRecord[Any, Any], ...]) -> Changes:
        async with self._lock:
            await self._reload_if_stale()
            now = self.clock()
            if self.watch_from is None:
                self.watch_from = now
            batch = read_batch(records, now)
            probes = {eid: seen for eid, seen in batch.probes}  # a batch may repeat a record
            self._stale = True  # until the transaction is known to have committed
            async with self.relay.transaction() as tx:
                fresh = await tx.claim(list(probes))
                draft = Draft(self.book, self.rules, self.new_id)
                for inv in batch.inventories:
                    inventory_seen(draft, inv.cluster, inv.node_ids, inv.at)
                heartbeats_seen(draft, batch.beats)
                unmatched = probes_seen(
                    draft, [s for eid, s in probes.items() if eid in fresh], now
                )
                ignored = stragglers.progress_seen(draft, batch.progress, now)
                await self._write(tx, draft.changes, batch.dead)
            self._stale = False
            self._committed(draft.changes)
            self.metrics.unmatched.inc(unmatched)
            self.metrics.unknown.inc(draft.unknown_signals)
            self.metrics.progress.labels("judged").inc(len(batch.progress) - ignored)
            self.metrics.progress.labels("ignored").inc(ignored)
            self.metrics.dead.inc(len(batch.dead))
            return draft.changes

    async def check(self) -> Changes:
        """Silence, recovery and stopped progress reports: decided on the clock."""
        async with self._lock:
            await self._reload_if_stale()
            draft = Draft(self.book, self.rules, self.new_id)
            now = self.clock()
            check(draft, now, self.watch_from)
            stragglers.expired(draft, now, self.watch_from)
            if draft.changes:
                self._stale = True  # until the transaction is known to have committed
                async with self.relay.transaction() as tx:
                    await self._write(tx, draft.changes, [])
                self._stale = False
                self._committed(draft.changes)
            return draft.changes

    async def _write(self, tx: Transaction, changes: Changes, dead: list[OutMessage]) -> None:
        await store.save(tx.conn, changes)
        tx.emit([*dead, *messages_for(changes)])

    def _committed(self, changes: Changes) -> None:
        # Memory follows the store only after the commit: a failed transaction leaves the
        # book as it was and the batch is tried again against it.
        self.book.apply(changes)
        self._count(changes)

    def _count(self, changes: Changes) -> None:
        for sick in changes.unhealthy:
            self.metrics.unhealthy.labels(sick.node.cause or "").inc()
        self.metrics.recovered.inc(len(changes.recovered))
        self.metrics.alerts.inc(len(changes.alerts))
        self.metrics.stragglers.inc(len(changes.stragglers))
        for inc in changes.incidents.values():
            if inc.cause != STRAGGLER:
                continue
            if inc.incident_id in changes.alerts:
                self.metrics.straggler_incidents.labels("opened").inc()
            if inc.closed_at is not None:
                self.metrics.straggler_incidents.labels("closed").inc()
        if changes.tracks:
            self._count_tracks()
        if changes.nodes or changes.dropped:
            self._count_states()

    def _count_all(self) -> None:
        self.book.recount()
        self._count_states()
        self._count_tracks()

    def _count_states(self) -> None:
        for state in NodeState:
            self.metrics.states.labels(state.value).set(self.book.by_state[state])

    def _count_tracks(self) -> None:
        self.metrics.tracked.set(len(self.book.tracks))
        self.metrics.straggling.set(len(self.book.straggling_on))
