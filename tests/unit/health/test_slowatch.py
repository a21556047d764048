"""The SLO evaluator's shell with a fake store and scrape: one SLO whose breach cannot be
written (or whose evaluation breaks) does not hold back another SLO's alert."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from schemas import topics
from services.common.scrape import Sample, Target
from services.health.slofile import SloFile, parse_slo_file
from services.health.slowatch import SloMetrics, SloWatch

METRIC = "qm_wait_seconds"


def two_slos() -> SloFile:
    def slo(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "objective": 0.9,
            "period": "1h",
            "sli": {"kind": "latency", "metric": METRIC, "threshold_s": 60},
        }

    return parse_slo_file(
        {
            "alerts": {
                "page": {
                    "severity": "critical",
                    "windows": [{"long": "4s", "short": "1s", "burn_rate": 5}],
                }
            },
            "slos": [slo("broken"), slo("fine")],
        }
    )


class FakeConn:
    """What store.save_breaches asks of a connection; inserting a breach of SLO `broken`
    fails as PostgreSQL would on a count beyond bigint."""

    async def executemany(self, *_args: Any) -> None:
        return None

    async def fetchrow(self, _sql: str, breach_id: str, slo: str, *_rest: Any) -> dict[str, str]:
        if slo == "broken":
            raise OverflowError("value out of int64 range")
        return {"breach_id": breach_id}


class FakeTx:
    def __init__(self) -> None:
        self.conn = FakeConn()
        self.out: list[Any] = []

    def emit(self, messages: Iterable[Any]) -> None:
        self.out.extend(messages)


class FakeRelay:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[FakeTx]:
        tx = FakeTx()
        yield tx  # an error inside: nothing is committed
        self.sent.extend(tx.out)


def watch_of(relay: FakeRelay) -> tuple[SloWatch, list[float]]:
    clock = [0.0]
    bad = itertools.count(0, 10)

    async def scraper(_targets: Iterable[tuple[str, str]]) -> list[Target]:
        n = float(next(bad))  # every event bad
        samples = [
            Sample(f"{METRIC}_bucket", {"le": "60.0"}, 0.0),
            Sample(f"{METRIC}_count", {}, n),
        ]
        return [Target("fake", "http://fake/metrics", samples)]

    watch = SloWatch(
        two_slos(),
        [("fake", "http://fake/metrics")],
        pool=None,
        relay=relay,  # type: ignore[arg-type]
        metrics=SloMetrics(CollectorRegistry()),
        own=("health", lambda: ""),
        clock=lambda: datetime(2025, 1, 1, tzinfo=UTC),
        new_id=iter(f"a{i}" for i in itertools.count()).__next__,
        scraper=scraper,
        monotonic=lambda: clock[0],
        every_s=1.0,
    )
    return watch, clock


async def rounds(watch: SloWatch, clock: list[float], n: int) -> None:
    for _ in range(n):
        clock[0] += 1.0
        await watch.evaluate()


async def test_a_breach_that_cannot_be_written_does_not_block_another_slos_alert() -> None:
    relay = FakeRelay()
    watch, clock = watch_of(relay)
    await rounds(watch, clock, 8)  # raises nothing, round after round
    assert [(m.topic, m.key) for m in relay.sent] == [(topics.ALERT_RAISED, "slo/fine")]
    assert set(watch.open) == {("fine", "page")}  # `broken` is tried again each round


async def test_an_slo_whose_evaluation_breaks_does_not_block_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    relay = FakeRelay()
    watch, clock = watch_of(relay)

    def boom(*_args: Any) -> None:
        raise RuntimeError("a bug in one SLO's arithmetic")

    monkeypatch.setattr(watch.tallies["broken"], "add", boom)
    await rounds(watch, clock, 8)
    assert set(watch.open) == {("fine", "page")}
    assert [m.key for m in relay.sent] == ["slo/fine"]
