"""The SLO evaluator's shell: every QM_SLO_EVAL_EVERY_S, scrape the services' /metrics
(QM_METRICS_TARGETS) and this process's own registry, feed each SLO's tally, judge the burn
rates (services.health.burn), then write opened and closed breaches and the alerts of the
opened ones in one transaction per SLO (one SLO's failure does not hold back another's
alerts), and relay.

It runs in the health service, which holds a lease: one evaluator at a time. An open breach
is in the store (`health.slo_breaches`, at most one open per SLO and level), so a restart or a
new holder of the lease does not raise it again.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime

import asyncpg
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.outbox import OutboxRelay
from services.common.scrape import Target, parse_metrics, scrape
from services.health import store
from services.health.burn import (
    Breach,
    Decisions,
    LevelVerdict,
    NoBucket,
    Reading,
    Tally,
    burn_rate,
    decide,
    judge,
    max_points,
    reading_of,
)
from services.health.emit import slo_alert
from services.health.slofile import Slo, SloFile, format_duration

log = structlog.get_logger()

WRITE_FAILED = "SLO breaches could not be written"

Scraper = Callable[[Iterable[tuple[str, str]]], Awaitable[list[Target]]]


class SloMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.evaluations = Counter(
            "qm_health_slo_evaluations_total", "SLO evaluation rounds", registry=registry
        )
        self.burn = Gauge(
            "qm_health_slo_burn_rate",
            "Error budget burn rate of each SLO over each of its alert windows",
            ["slo", "window"],
            registry=registry,
        )
        self.breaches = Gauge(
            "qm_health_slo_breaches",
            "1 while a level of an SLO is in breach (alerted once)",
            ["slo", "level"],
            registry=registry,
        )
        self.scrape_failures = Counter(
            "qm_health_slo_scrape_failures_total",
            "Scrapes of a metrics target that failed",
            ["target"],
            registry=registry,
        )


def selects(slo: Slo, target: str) -> bool:
    """Whether the SLO reads this target: all of them, or those of its services (an
    executor-<cluster> target is of service `executor`)."""
    return not slo.services or any(target == s or target.startswith(f"{s}-") for s in slo.services)


class SloWatch:
    def __init__(
        self,
        slos: SloFile,
        targets: list[tuple[str, str]],
        pool: asyncpg.Pool,
        relay: OutboxRelay,
        metrics: SloMetrics,
        *,
        own: tuple[str, Callable[[], str]],
        clock: Callable[[], datetime],
        new_id: Callable[[], str],
        on_alerts: Callable[[int], None] = lambda n: None,
        scraper: Scraper = scrape,
        monotonic: Callable[[], float] = time.monotonic,
        every_s: float = 15.0,
    ) -> None:
        self.slos = slos
        self.targets = targets
        self.pool = pool
        self.relay = relay
        self.metrics = metrics
        self.own = own  # this process's name and its /metrics text, read without HTTP
        self.clock = clock
        self.new_id = new_id
        self.on_alerts = on_alerts
        self.scraper = scraper
        self.monotonic = monotonic
        caps = max_points(slos, every_s)  # CannotCover when every_s is too short
        self.tallies = {
            s.name: Tally(keep_s=s.longest_s, max_points=caps[s.name]) for s in slos.slos
        }
        self.open: dict[tuple[str, str], Breach] = {}
        self._no_bucket: set[str] = set()  # SLOs already warned about
        self._failing: set[str] = set()  # targets whose last scrape failed
        # (SLO, what) whose last evaluation or write failed: logged once until it works again
        self._broken: set[tuple[str, str]] = set()

    async def load(self) -> None:
        async with self.pool.acquire() as conn:
            self.open = {b.key: b for b in await store.open_breaches(conn)}
        for key in self.open:
            self.metrics.breaches.labels(*key).set(1)

    async def evaluate(self) -> Decisions:
        targets = await self.scraper(self.targets)
        name, text = self.own
        targets.append(Target(name, "(this process)", parse_metrics(text())))
        at = self.monotonic()
        self._count_failures(targets)
        verdicts: dict[str, tuple[LevelVerdict, ...] | None] = {}
        for slo in self.slos.slos:
            try:
                verdicts[slo.name] = self._judge(slo, at, targets)
            except Exception:  # one SLO's bug must not keep the others from alerting
                verdicts[slo.name] = None  # not judged: its breaches stay as they are
                self._failed(slo.name, "SLO evaluation failed")
            else:
                self._broken.discard((slo.name, "SLO evaluation failed"))
        decisions = decide(self.slos, verdicts, self.open, self.clock(), self.new_id)
        if decisions:
            decisions = await self._write_each(decisions)
        self.metrics.evaluations.inc()
        return decisions

    def _judge(self, slo: Slo, at: float, targets: list[Target]) -> tuple[LevelVerdict, ...] | None:
        tally = self.tallies[slo.name]
        tally.add(at, self._readings(slo, targets))
        judged = judge(slo, tally)
        for window in slo.windows_s:
            events = tally.events(window)
            if events is not None and tally.span_s >= window:
                rate = burn_rate(*events, slo.objective)
                self.metrics.burn.labels(slo.name, format_duration(window)).set(rate)
        return judged

    def _failed(self, slo: str, event: str) -> None:
        if (slo, event) not in self._broken:  # once until it works again, not every round
            self._broken.add((slo, event))
            log.exception(event, slo=slo)

    async def _write_each(self, decisions: Decisions) -> Decisions:
        """Each SLO's decisions in a transaction of their own: a write that fails (its
        decisions are taken again next round) holds back only that SLO's alerts."""
        names = sorted({b.slo for b in (*decisions.opened, *decisions.closed)})
        opened: list[Breach] = []
        closed: list[Breach] = []
        for name in names:
            mine = Decisions(
                tuple(b for b in decisions.opened if b.slo == name),
                tuple(b for b in decisions.closed if b.slo == name),
            )
            try:
                done = await self._write(mine)
            except Exception:
                self._failed(name, WRITE_FAILED)
                continue
            self._broken.discard((name, WRITE_FAILED))
            opened.extend(done.opened)
            closed.extend(done.closed)
        return Decisions(tuple(opened), tuple(closed))

    def _readings(self, slo: Slo, targets: list[Target]) -> dict[str, Reading]:
        out = {}
        for t in targets:
            if t.error is not None or not selects(slo, t.name):
                continue
            try:
                out[t.name] = reading_of(slo.sli, t.samples)
            except NoBucket as exc:
                if slo.name not in self._no_bucket:
                    self._no_bucket.add(slo.name)
                    log.error(
                        "SLO cannot be evaluated", slo=slo.name, target=t.name, error=str(exc)
                    )
        return out

    def _count_failures(self, targets: list[Target]) -> None:
        for t in targets:
            if t.error is None:
                self._failing.discard(t.name)
                continue
            self.metrics.scrape_failures.labels(t.name).inc()
            if t.name not in self._failing:  # once per outage, not every round
                self._failing.add(t.name)
                log.warning("metrics target unreachable", target=t.name, error=t.error)

    async def _write(self, decisions: Decisions) -> Decisions:
        async with self.relay.transaction() as tx:
            fresh = await store.save_breaches(tx.conn, decisions)
            opened = tuple(b for b in decisions.opened if b.breach_id in fresh)
            tx.emit(slo_alert(b) for b in opened)
        for b in decisions.closed:
            self.open.pop(b.key, None)
            self.metrics.breaches.labels(*b.key).set(0)
            log.info("SLO breach ended", slo=b.slo, alert_level=b.level, alert_id=b.breach_id)
        for b in opened:
            self.open[b.key] = b
            self.metrics.breaches.labels(*b.key).set(1)
            log.warning(
                "SLO breach: alert raised", slo=b.slo, alert_level=b.level, alert_id=b.breach_id
            )
        self.on_alerts(len(opened))
        if len(opened) < len(decisions.opened):
            # Another evaluator opened it first (a lease handover in flight): take the
            # store's view, which holds the one alert that went out.
            await self.load()
        return Decisions(opened, decisions.closed)
