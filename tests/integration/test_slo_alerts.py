"""An SLO breach raised on purpose, on the real broker, PostgreSQL and Redis: the health
service scrapes a fake service's /metrics whose counters the test moves, and raises exactly
one alert.raised per breach: none while things go well (a counter reset and a series of
absurd values included), one when the SLO burns, no second one while it keeps burning or
after a restart, and a new one for the next breach after the first has ended. Windows are
seconds here, hours in production."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import yaml
from aiohttp import web

from schemas import topics
from services.health.app import create_app
from services.health.settings import HealthSettings
from tests.integration.conftest import running
from tests.integration.kafka_tools import collect
from tests.integration.test_health_service import metrics_of

METRIC = "qm_scheduler_queue_wait_seconds"
EVAL_EVERY_S = 0.2


class FakeScheduler:
    """A /metrics like the scheduler's: the high class's queue wait histogram, whose jobs
    wait under a minute (good) or over it (bad) as the test says."""

    def __init__(self) -> None:
        self.good = 0
        self.bad = 0
        self.waits_long = False

    def restart(self) -> None:
        self.good = self.bad = 0  # a new process: its counters begin again

    def tick(self) -> None:
        if self.waits_long:
            self.bad += 5
        else:
            self.good += 5

    def exposition(self) -> str:
        labels = 'priority_class="high",queue="default",tenant="t"'
        hostile = 'priority_class="high",queue="default",tenant="huge"'
        total = self.good + self.bad
        return (
            f"# TYPE {METRIC} histogram\n"
            f'{METRIC}_bucket{{le="30.0",{labels}}} {self.good}\n'
            f'{METRIC}_bucket{{le="60.0",{labels}}} {self.good}\n'
            f'{METRIC}_bucket{{le="+Inf",{labels}}} {total}\n'
            f"{METRIC}_count{{{labels}}} {total}\n"
            f"{METRIC}_sum{{{labels}}} {self.good * 10 + self.bad * 300}\n"
            # A broken series past 2**53: left out (counted in, it would swallow every real
            # increase in float rounding and overflow the breach's bigint count).
            f'{METRIC}_bucket{{le="60.0",{hostile}}} 1e20\n'
            f"{METRIC}_count{{{hostile}}} 1e20\n"
        )


@contextlib.asynccontextmanager
async def serving(fake: FakeScheduler) -> AsyncIterator[str]:
    """The fake's /metrics on a free port, and jobs flowing through it every 50 ms."""

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=fake.exposition(), content_type="text/plain")

    async def traffic() -> None:
        while True:
            fake.tick()
            await asyncio.sleep(0.05)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    flow = asyncio.create_task(traffic())
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        flow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flow
        await runner.cleanup()


def slo_file(path: Path, name: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "dashboard": "/ui/scheduler",
                "alerts": {
                    "page": {
                        "severity": "critical",
                        "windows": [
                            {"long": "4s", "short": "1s", "burn_rate": 5},
                            {"long": "8s", "short": "2s", "burn_rate": 3},
                        ],
                    }
                },
                "slos": [
                    {
                        "name": name,
                        "description": "high-class jobs placed within a minute",
                        "objective": 0.9,
                        "period": "1h",
                        "services": ["fake"],
                        "sli": {
                            "kind": "latency",
                            "metric": METRIC,
                            "labels": {"priority_class": "high"},
                            "threshold_s": 60,
                        },
                    }
                ],
            }
        )
    )
    return path


async def evaluations(app: Any) -> float:
    return (await metrics_of(app)).get("qm_health_slo_evaluations_total", 0.0)


async def until(done: Callable[[], Awaitable[bool]], timeout_s: float = 60.0) -> None:
    """Poll until `done` says so; fails the test (TimeoutError) after a generous deadline."""
    async with asyncio.timeout(timeout_s):
        while True:
            if await done():
                return
            await asyncio.sleep(0.1)


async def rounds(app: Any, n: int) -> None:
    """Wait until the evaluator has run `n` more rounds."""
    start = await evaluations(app)

    async def counted() -> bool:
        return await evaluations(app) >= start + n

    await until(counted)


async def test_an_slo_breach_raises_exactly_one_alert_until_it_ends(
    service_env: dict[str, Any], fresh_database_url: str, tmp_path: Path
) -> None:
    run = uuid.uuid4().hex[:8]
    name = f"wait-{run}"
    subject = f"slo/{name}"
    bootstrap = service_env["kafka_bootstrap"]
    fake = FakeScheduler()

    def alerts_about(_topic: str, env: dict[str, Any]) -> bool:
        return bool(env["payload"].get("subject") == subject)

    async def alerts(count: int, timeout_s: float) -> list[dict[str, Any]]:
        got = await collect(bootstrap, (topics.ALERT_RAISED,), alerts_about, count, timeout_s)
        return [env["payload"] for _, env in got]

    conn = await asyncpg.connect(fresh_database_url)

    async def breaches() -> list[tuple[str, bool]]:
        rows = await conn.fetch(
            "SELECT breach_id, closed_at IS NULL AS open FROM health.slo_breaches "
            "WHERE slo = $1 ORDER BY opened_at",
            name,
        )
        return [(r["breach_id"], r["open"]) for r in rows]

    async def all_closed() -> bool:
        return not any(is_open for _, is_open in await breaches())

    try:
        async with serving(fake) as url:
            settings = HealthSettings(
                **{**service_env, "database_url": fresh_database_url},
                slo_file=slo_file(tmp_path / "slo.yaml", name),
                metrics_targets=f"fake={url}",
                slo_eval_every_s=EVAL_EVERY_S,
                fetch_max_wait_ms=20,
            )
            async with running(create_app(settings)) as app:
                # Things go well, through a restart of the scraped service: no alert.
                await rounds(app, 15)
                fake.restart()
                await rounds(app, 15)
                assert await breaches() == []
                # Every job now waits too long: one alert...
                fake.waits_long = True
                [first] = await alerts(1, timeout_s=30)
                # ...and no other while the breach lasts.
                await rounds(app, 25)
                [(breach_id, still_open)] = await breaches()
                assert (breach_id, still_open) == (first["alert_id"], True)
                # It ends (no event, the store closes it), then a second breach: a new alert.
                fake.waits_long = False
                await until(all_closed)
                fake.waits_long = True
                both = await alerts(2, timeout_s=30)
            # A restart (or a new holder of the lease) mid-breach does not alert again.
            async with running(create_app(settings)) as app:
                await rounds(app, 25)
                assert [o for _, o in await breaches()] == [False, True]
        after = await alerts(99, timeout_s=3)
    finally:
        await conn.close()
    assert first["severity"] == "critical" and first["cause"] == "slo_burn_page"
    assert (first["cluster"], first.get("node_id"), first["count"] > 0) == ("", None, True)
    action = first["suggested_action"]
    assert f"SLO {name} (high-class jobs placed within a minute)" in action
    assert "error budget" in action and "/ui/scheduler" in action
    assert len({a["alert_id"] for a in both}) == 2
    assert [a["alert_id"] for a in after] == [a["alert_id"] for a in both]
