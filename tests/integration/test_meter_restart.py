"""Kill the meter (SIGKILL, a real process) in the middle of a stream of runs, let runs end
and start while it is down, restart it: every run's ticks still tile its run time with no gap
and no overlap, and the ledger and the usage.tick stream add up to the truth exactly."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiokafka import AIOKafkaProducer

from cli.infra import free_port
from schemas import topics
from services.common.db import create_pool
from tests.integration.kafka_tools import START_S, STOP_S, bounded, collect
from tests.integration.test_meter_service import SCALE
from tests.unit.meter.scenario import (
    Drive,
    assert_exact,
    cents,
    ledger_by_run,
    random_runs,
    until_closed,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def producer(kafka_bootstrap: str) -> AsyncIterator[AIOKafkaProducer]:
    p = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, max_batch_size=1 << 20, linger_ms=1)
    await bounded(p.start(), START_S, "the test producer's start")
    yield p
    await bounded(p.stop(), STOP_S, "the test producer's stop")


def meter_env(service_env: dict[str, Any], budgets: Path, group: str) -> dict[str, str]:
    return {
        **os.environ,
        "QM_KAFKA_BOOTSTRAP": service_env["kafka_bootstrap"],
        "QM_DATABASE_URL": service_env["database_url"],
        "QM_POLICY_FILE": str(service_env["policy_file"]),
        "QM_FLEET_FILE": str(service_env["fleet_file"]),
        "QM_BUDGETS_FILE": str(budgets),
        "QM_GROUP_ID": group,
        "QM_TIME_SCALE": str(SCALE),
        "QM_METER_INTERVAL_S": "60",
        "QM_METER_LAG_S": "0.3",
        "QM_METER_STARTUP_GRACE_S": "3",
        "QM_LOG_FORMAT": "json",
    }


def spawn_meter(env: dict[str, str], log: Path, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.meter"],
        cwd=ROOT,
        env={**env, "QM_HTTP_PORT": str(port)},
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


def tail(log: Path) -> str:
    return log.read_text()[-3000:]


async def start_meter(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    port = free_port()
    proc = spawn_meter(env, log, port)
    async with httpx.AsyncClient() as client:
        for _ in range(200):
            try:
                if (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
    proc.kill()
    raise AssertionError(f"meter did not start; see {log}:\n{tail(log)}")


async def test_kill_and_restart_mid_stream_totals_still_exact(
    service_env: dict[str, Any], producer: AIOKafkaProducer, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    runs = random_runs(tag, 40, seed=11, spread_s=4.0)  # 0.2 to 5 s of wall clock each
    budgets = tmp_path / "budgets.yaml"
    budgets.write_text(yaml.safe_dump({"currency": "USD"}))
    env = meter_env(service_env, budgets, f"meter-{tag}")
    log = tmp_path / "meter.log"
    pool = await create_pool(service_env["database_url"])
    meter = await start_meter(env, log)
    try:
        play = asyncio.create_task(
            Drive(producer, SCALE, twice=lambda r: r.job_id.endswith(("1", "5"))).all(runs)
        )
        await asyncio.sleep(2.5)
        open_then = await pool.fetchval(
            "SELECT count(*) FROM meter.runs WHERE phase = 'open' AND job_id LIKE $1", f"{tag}-%"
        )
        meter.kill()  # SIGKILL: no shutdown hook, no final offset commit
        meter.wait()
        await asyncio.sleep(2.0)  # runs end and others start while it is down
        meter = await start_meter(env, log)
        await play
        await until_closed(pool, runs, timeout_s=90)
        await asyncio.sleep(1.0)
        by_run = await ledger_by_run(pool, [r.job_id for r in runs])
        ticks = await pool.fetch(
            "SELECT run_id, start_offset_s AS a, end_offset_s AS b, seconds FROM meter.usage "
            "WHERE job_id LIKE $1 ORDER BY run_id, start_offset_s, end_offset_s",
            f"{tag}-%",
        )
    finally:
        meter.terminate()
        meter.wait(timeout=20)
        await pool.close()
    assert open_then > 0, "the kill should hit while runs are open"
    assert_exact(runs, by_run)
    for run in runs:  # no gap, no overlap: the forward ticks tile [0, end of billing)
        mine = [t for t in ticks if t["run_id"] == f"{run.job_id}#1" and t["seconds"] >= 0]
        assert mine[0]["a"] == 0
        assert all(x["b"] == y["a"] for x, y in itertools.pairwise(mine)), run

    ours = {r.job_id for r in runs}
    expected = len(ticks)
    got = await collect(
        service_env["kafka_bootstrap"],
        (topics.USAGE_TICK,),
        lambda _t, env: env["payload"].get("job_id") in ours,
        count=2 * expected,  # read all there is: redelivered ticks may be on the wire twice
        timeout_s=10,
    )
    stream = {env["payload"]["tick_id"]: env["payload"] for _, env in got}
    assert len(stream) == expected  # duplicates on the wire, if any, share a tick_id
    cost = sum(Decimal(str(p["cost"])) for p in stream.values())
    assert cents(cost) == cents(sum((r.cost for r in runs), Decimal(0)))
