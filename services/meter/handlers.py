"""The meter's two writers: the batch handler (lifecycle facts in, runs opened and closed) and
the clock (open runs billed interval by interval, idle capacity). Each step writes the ledger,
the run state, the budget counters and the outbox in one transaction; one lock keeps the two
from interleaving, so memory (the open runs) always equals the store after a commit, and the
counters count a step only once it has committed (a step rolled back is retried: counting inside
the transaction would count its ticks again)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import structlog
from aiokafka import ConsumerRecord
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as Metric

from schemas.envelope import utcnow
from schemas.usage import BudgetExceeded, TickKind, budget_month
from services.common.kafka import OutMessage
from services.common.outbox import OutboxRelay
from services.meter import store
from services.meter.budgets import (
    MeterConfig,
    exceeded,
    of_tenants,
    reached,
    usage_deltas,
    used,
)
from services.meter.emit import budget_messages, tick_messages
from services.meter.intake import read_batch
from services.meter.overhead import idle_ticks, usage_by_interval
from services.meter.pricing import Pool, PriceBook, PriceKey
from services.meter.runs import Phase, RunKey, RunState, apply_facts, bill_open, fact_key
from services.meter.ticks import Grid, Tick

log = structlog.get_logger()
CLOSE = TickKind.CLOSE
# How far a producer's clock may run ahead of the meter's: a run's reported end is believed up
# to now plus this (wall time), and cut there beyond it (runs.advance). Generous, since a run's
# start comes from the executor's clock and an honest run is cut only past it; it bounds what
# closing one run can cost to this much of fleet time's intervals.
CLOCK_SKEW = timedelta(hours=1)


class MeterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ticks = Metric(
            "qm_meter_ticks_written_total", "Ticks new to the ledger", ["kind"], registry=registry
        )
        self.credits = Metric(
            "qm_meter_credit_ticks_total",
            "Close ticks with negative seconds (a run ended inside time already billed)",
            registry=registry,
        )
        self.open_runs = Gauge("qm_meter_open_runs", "Runs billed by the clock", registry=registry)
        self.duplicates = Metric(
            "qm_meter_duplicates_total", "Redelivered events skipped", registry=registry
        )
        self.dead = Metric("qm_meter_dead_letters_total", "Unreadable records", registry=registry)
        self.budget_events = Metric(
            "qm_meter_budget_thresholds_total", "Budget thresholds announced", registry=registry
        )
        self.unpriced = Gauge(
            "qm_meter_unpriced_pools", "Pools without any price (billed at 0)", registry=registry
        )
        self.cut = Metric(
            "qm_meter_runs_cut_total",
            "Runs whose end event reported more run time than can have passed (closed at now)",
            registry=registry,
        )
        self.batch = Histogram("qm_meter_batch_seconds", "One lifecycle batch", registry=registry)
        self.tick_pass = Histogram("qm_meter_tick_seconds", "One clock pass", registry=registry)
        self.spend = Metric(
            "qm_meter_spend_total",
            "Cost of the usage metered, by tenant, in the configured currency (idle capacity is "
            "not usage)",
            ["tenant", "currency"],
            registry=registry,
        )
        self.usage = Metric(
            "qm_meter_usage_accelerator_seconds_total",
            "Accelerator-seconds of usage metered, by tenant",
            ["tenant"],
            registry=registry,
        )
        self.budget_used = Gauge(
            "qm_meter_budget_used_ratio",
            "This month's consumption of each budget over its limit (1 = used up), as of the "
            "tenant's last metered usage",
            ["tenant", "budget"],
            registry=registry,
        )

    def count(self, counts: Counts, currency: str) -> None:
        """A committed transaction's counts."""
        for kind, n in counts.ticks.items():
            self.ticks.labels(kind).inc(n)
        self.credits.inc(counts.credits)
        self.budget_events.inc(counts.budget_events)
        for tenant, (seconds_u, cost_u) in counts.usage.items():
            # A run that ends inside time already billed is credited back: counters only rise.
            if seconds_u > 0:
                self.usage.labels(tenant).inc(seconds_u / 1e6)
            if cost_u > 0:
                self.spend.labels(tenant, currency).inc(cost_u / 1e6)
        for (tenant, budget_id), ratio in counts.budget_used.items():
            self.budget_used.labels(tenant, budget_id).set(ratio)


@dataclass
class Counts:
    """What one transaction adds to the counters (and sets the budget gauges to), applied by
    `MeterMetrics.count` after its commit."""

    ticks: Counter[TickKind] = field(default_factory=Counter)
    credits: int = 0
    budget_events: int = 0
    # tenant -> (accelerator-seconds, cost), millionths
    usage: dict[str, tuple[int, int]] = field(default_factory=dict)
    budget_used: dict[tuple[str, str], float] = field(default_factory=dict)

    def add_usage(self, deltas: dict[tuple[str, str, str], tuple[int, int]]) -> None:
        for (tenant, _project, _month), (seconds_u, cost_u) in deltas.items():
            s, c = self.usage.get(tenant, (0, 0))
            self.usage[tenant] = (s + seconds_u, c + cost_u)


class Meter:
    def __init__(
        self,
        pool: asyncpg.Pool,
        relay: OutboxRelay,
        grid: Grid,
        config: MeterConfig,
        book: PriceBook,
        metrics: MeterMetrics,
        *,
        lag_s: float,
        idle_lag_s: float,
        max_ticks_per_pass: int,
        max_idle_backfill: int,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.pool = pool
        self.relay = relay
        self.grid = grid
        self.config = config
        self.book = book
        self.metrics = metrics
        self.lag = timedelta(seconds=lag_s)
        self.idle_lag = timedelta(seconds=idle_lag_s)
        self.max_ticks_per_pass = max_ticks_per_pass
        self.max_idle_backfill = max_idle_backfill
        self.clock = clock
        self.open: dict[RunKey, RunState] = {}
        # The clock's pass need not look at every open run each time: every open run but
        # those in `_fresh` (opened or changed by a batch since) is billed through interval
        # `_billed_through`. None: nothing is known, look at them all.
        self._billed_through: int | None = None
        self._fresh: dict[RunKey, None] = {}  # in the order the batches came (ticks' order)
        self.pools: dict[PriceKey, Pool] = {}
        self.idle_done: int | None = None
        self.caught_up = asyncio.Event()
        self._lock = asyncio.Lock()

    async def restore(self) -> None:
        self.open = {s.key: s for s in await store.load_open(self.pool)}
        self._billed_through, self._fresh = None, {}
        self.pools = {p.key: p for p in await store.load_pools(self.pool)}
        self.book.announced.update(await store.load_announced(self.pool))
        self.idle_done = await store.idle_through(self.pool)
        self.metrics.open_runs.set(len(self.open))

    # --- lifecycle facts -----------------------------------------------------------------

    async def process(self, records: tuple[ConsumerRecord[Any, Any], ...], full: int = 0) -> None:
        """One batch; `full` is the batch size at which more records may be waiting."""
        facts, dead = read_batch(records)
        unique = list({event_id: fact for event_id, fact in facts}.items())
        with self.metrics.batch.time():
            async with self._lock:
                if unique or dead:
                    await self._apply(unique, dead)
        self.metrics.dead.inc(len(dead))
        if not full or len(records) < full:
            self.caught_up.set()

    async def _apply(self, facts: list[tuple[str, Any]], dead: list[OutMessage]) -> None:
        counts = Counts()
        async with self.relay.transaction() as tx:
            conn = tx.conn
            fresh = await tx.claim([e for e, _ in facts])
            todo = [f for e, f in facts if e in fresh]
            keys = {k for k in map(fact_key, todo) if k is not None}
            known = {k: self.open[k] for k in keys if k in self.open}
            known.update(await store.lock_runs(conn, keys - known.keys()))
            # A run cannot have ended after now (with room for the producer's clock).
            latest = self.grid.virtual(self.clock() + CLOCK_SKEW)
            applied = apply_facts(todo, known, self.book, self.grid, latest)
            await store.save_runs(conn, list(applied.states.values()))
            await store.save_pools(conn, applied.pools)
            await store.save_announced(conn, {c: self.book.announced[c] for c in applied.pools})
            tx.emit(await self._write(conn, applied.ticks, dead, counts))
        self.metrics.count(counts, self.config.currency)
        for key, state in applied.states.items():
            if state.phase is Phase.OPEN:
                self.open[key] = state
                self._fresh[key] = None
            else:
                self.open.pop(key, None)
        for cluster, pools in applied.pools.items():
            self.pools = {k: p for k, p in self.pools.items() if p.cluster != cluster}
            self.pools.update((p.key, p) for p in pools)
        self.metrics.duplicates.inc(len(facts) - len(todo))
        if applied.cut:
            self.metrics.cut.inc(applied.cut)
            log.warning("run times past now reported; closed at now", runs=applied.cut)
        self.metrics.open_runs.set(len(self.open))
        self.metrics.unpriced.set(len(self.book.unpriced))

    # --- the clock -----------------------------------------------------------------------

    async def tick(self, now: datetime | None = None) -> bool:
        """Bill open runs for every interval that has ended; account idle capacity. Returns
        True when a catch-up limit held something back (call again at once)."""
        now = now or self.clock()
        last = self.grid.closed_through(now - self.lag)
        with self.metrics.tick_pass.time():
            async with self._lock:
                # A pass is one transaction: share its size out over the open runs.
                per_run = max(1, self.max_ticks_per_pass // max(1, len(self.open)))
                changed, ticks, held = bill_open(self._to_bill(last), last, self.grid, per_run)
                # Idle needs every usage tick of its interval: not while runs are catching up.
                idle = None if held else self._idle_range(now)
                if not ticks and idle is None:
                    self._billed(last, held)
                    return held
                counts = Counts()
                async with self.relay.transaction() as tx:
                    conn = tx.conn
                    new = await self._record(conn, ticks)
                    await store.save_billed(conn, changed)
                    if idle is not None:  # after this pass's usage is counted
                        new += await self._record(conn, await self._idle(conn, *idle))
                        await store.set_idle_through(conn, idle[1])
                    tx.emit(await self._announce(conn, new, [], counts))
                self.metrics.count(counts, self.config.currency)
                for state in changed:
                    self.open[state.key] = state
                self._billed(last, held)
                if idle is not None:
                    self.idle_done = idle[1]
        return held

    def _to_bill(self, last: int) -> Iterable[RunState]:
        """The open runs a pass through interval `last` may bill: all of them when an interval
        has closed since the last pass, else only those a batch opened or changed since. At
        40,000 open runs a look at each cost some 60 ms, four times a second, with the batches
        waiting on the lock."""
        if last != self._billed_through:  # None, a closed interval, or the clock set back
            return self.open.values()
        return [self.open[k] for k in self._fresh if k in self.open]

    def _billed(self, last: int, held: bool) -> None:
        """A pass through `last` has committed: every run it looked at is billed through
        `last`, unless the catch-up limit held one back."""
        if held:
            self._billed_through = None
        else:
            self._billed_through = last
            self._fresh.clear()

    def _idle_range(self, now: datetime) -> tuple[int, int] | None:
        last = self.grid.closed_through(now - self.idle_lag)
        if self.idle_done is not None and self.idle_done >= last:
            return None
        # A first start accounts from now on; a restart catches up, within reason.
        first = last if self.idle_done is None else self.idle_done + 1
        return max(first, last - self.max_idle_backfill + 1), last

    async def _idle(self, conn: asyncpg.Connection, first: int, last: int) -> list[Tick]:
        allocated = await store.allocated(conn, first, last)
        pools = list(self.pools.values())
        out: list[Tick] = []
        for k in range(first, last + 1):
            out += idle_ticks(k, pools, allocated.get(k, {}), self.grid, self.config.overhead)
        return out

    # --- writing ---------------------------------------------------------------------------

    async def _record(self, conn: asyncpg.Connection, ticks: list[Tick]) -> list[Tick]:
        """Ledger and per-interval usage; returns the ticks new to the ledger."""
        new = await store.insert_ticks(conn, ticks)
        await store.add_interval_usage(conn, usage_by_interval(new))
        return new

    async def _write(
        self, conn: asyncpg.Connection, ticks: list[Tick], extra: list[OutMessage], counts: Counts
    ) -> list[OutMessage]:
        return await self._announce(conn, await self._record(conn, ticks), extra, counts)

    async def _announce(
        self, conn: asyncpg.Connection, new: list[Tick], extra: list[OutMessage], counts: Counts
    ) -> list[OutMessage]:
        """Budget counters and the outbox for ticks new to the ledger (a replay adds none);
        what the metrics should count of them goes into `counts`."""
        budget_events = await self._budgets(conn, new, counts)
        counts.ticks.update(t.kind for t in new)
        counts.credits += sum(1 for t in new if t.kind is CLOSE and t.seconds_u < 0)
        counts.budget_events += len(budget_events)
        return [
            *extra,
            *tick_messages(new, self.grid, self.config.currency),
            *budget_messages(budget_events),
        ]

    async def _budgets(
        self, conn: asyncpg.Connection, new: list[Tick], counts: Counts
    ) -> list[BudgetExceeded]:
        deltas = usage_deltas(new)
        if not deltas:
            return []
        counts.add_usage(deltas)
        await store.add_budget_usage(conn, deltas)
        now = self.clock()
        events: list[BudgetExceeded] = []
        for month in sorted({m for _, _, m in deltas}):
            tenants = {t for t, _, m in deltas if m == month}
            budgets = of_tenants(self.config.budgets, tenants)
            if not budgets:
                continue
            totals = await store.budget_totals(conn, tenants, month)
            candidates = []
            current = month == budget_month(now)
            for b in budgets:
                consumption = used(b, totals)
                candidates += [(b, threshold, consumption) for threshold in reached(b, consumption)]
                if current and b.limit > 0:
                    counts.budget_used[(b.tenant, b.budget_id)] = float(consumption / b.limit)
            claimed = await store.claim_thresholds(
                conn, [(b.budget_id, month, th, u) for b, th, u in candidates]
            )
            events += [
                exceeded(b, month, u, th, self.config.currency, now)
                for b, th, u in candidates
                if (b.budget_id, month, th) in claimed
            ]
        return events
