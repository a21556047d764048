"""The meter on the real broker and PostgreSQL: a scenario with exact run times (a failure, a
cancel, a preemption and a node failure ending runs on job.preempted, a refused placement, the
queue's bookkeeping finish, events delivered twice) meters exactly the true accelerator-seconds
and cost, in the ledger, on the usage.tick stream and through GET /v1/usage; budgets cross
their thresholds once each; idle capacity is reported; a failed run (job.run.failed) is
metered to its end and its retry on its own."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiokafka import AIOKafkaProducer, ConsumerRecord

from schemas import topics
from schemas.events import RunFailed
from schemas.usage import BudgetExceeded
from services.common.db import create_pool
from services.gateway.auth import Principal, Role
from services.gateway.usage import UsageProjector
from services.meter.app import create_app
from services.meter.settings import MeterSettings
from services.queue.budgets import check_budget, note_exceeded
from tests.integration.conftest import running
from tests.integration.kafka_tools import START_S, STOP_S, bounded, collect
from tests.unit.meter.scenario import (
    Drive,
    RunSpec,
    assert_exact,
    capacity,
    cents,
    ended,
    envelope,
    finished,
    ledger_by_run,
    placement,
    refused,
    send,
    started,
    until_closed,
)

SCALE = 600.0  # ten 60 s intervals per wall-clock second


def scenario(tag: str) -> list[RunSpec]:
    vision, nlp, speech = f"vision-{tag}", f"nlp-{tag}", f"speech-{tag}"
    return [
        RunSpec(f"{tag}-a", vision, "detect", "onprem-h100", "H100", 1, 8, "754.321"),
        RunSpec(
            f"{tag}-b",
            nlp,
            "llm",
            "cloud-a100",
            "A100",
            2,
            8,
            "1234.5",
            "failed",
            first_node=2,
            reason_code="application_error",
        ),
        RunSpec(f"{tag}-c", speech, "asr", "cloud-a100", "L4", 1, 0.5, "77.007", "canceled"),
        # Preempted after 333.333 s (job.preempted), resumed as attempt 2 on other nodes.
        RunSpec(
            f"{tag}-d",
            vision,
            "train",
            "tpu-slices",
            "TPU-v5e",
            4,
            4,
            "333.333",
            "preempted",
            reason_code="preempted",
        ),
        RunSpec(
            f"{tag}-d",
            vision,
            "train",
            "tpu-slices",
            "TPU-v5e",
            4,
            4,
            "500",
            attempt=2,
            first_node=4,
            start_after_s=0.9,
        ),
        # A node failed under attempt 1 (the executor hands the gang back); attempt 2 ran.
        RunSpec(
            f"{tag}-e",
            nlp,
            "eval",
            "onprem-h100",
            "H100",
            2,
            8,
            "98.765",
            "preempted",
            first_node=4,
            reason_code="node_failure",
        ),
        RunSpec(
            f"{tag}-e",
            nlp,
            "eval",
            "onprem-h100",
            "H100",
            2,
            8,
            "222.222",
            attempt=2,
            first_node=6,
            start_after_s=0.5,
        ),
        # Placed by a deposed leader (refused), then by the new one on other nodes.
        RunSpec(
            f"{tag}-f", speech, "tts", "onprem-h100", "H100", 1, 8, "60", epoch=2, first_node=11
        ),
    ]


@pytest.fixture
def budgets_file(tmp_path: Path) -> Path:
    path = tmp_path / "budgets.yaml"
    path.write_text(yaml.safe_dump({"currency": "USD"}))
    return path


def settings_for(env: dict[str, Any], budgets: Path, **extra: Any) -> MeterSettings:
    chosen: dict[str, Any] = {
        "meter_interval_s": 60,
        "meter_lag_s": 0.3,  # short: the clock bills inside runs, so credits happen too
        "meter_idle_lag_s": 0.5,
        "meter_startup_grace_s": 1.0,
    }
    return MeterSettings(
        **env,
        group_id=f"meter-{uuid.uuid4().hex[:8]}",
        budgets_file=budgets,
        time_scale=SCALE,
        **(chosen | extra),
    )


@pytest.fixture
async def producer(kafka_bootstrap: str) -> AsyncIterator[AIOKafkaProducer]:
    p = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, max_batch_size=1 << 20, linger_ms=1)
    await bounded(p.start(), START_S, "the test producer's start")
    yield p
    await bounded(p.stop(), STOP_S, "the test producer's stop")


def as_record(env: dict[str, Any], offset: int) -> ConsumerRecord[Any, Any]:
    value = json.dumps(env).encode()
    return ConsumerRecord(topics.USAGE_TICK, 0, offset, 0, 0, None, value, None, 0, len(value), ())


async def test_ground_truth_to_the_second_and_the_cent(
    service_env: dict[str, Any], producer: AIOKafkaProducer, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    runs = scenario(tag)
    budgets = tmp_path / "budgets.yaml"
    budgets.write_text(
        yaml.safe_dump(
            {
                "budgets": [
                    # vision uses 6034.568 + 2 x 16 x ... acc-s: well past 1 h, so all three.
                    {
                        "id": f"v-{tag}",
                        "tenant": f"vision-{tag}",
                        "limit": {"accelerator_hours": 1},
                        "enforcement": "block",
                    },
                    # nlp costs 9.03: past 50% and 80% of 10, not 100%.
                    {"id": f"n-{tag}", "tenant": f"nlp-{tag}", "limit": {"currency": 10}},
                ]
            }
        )
    )
    bootstrap = service_env["kafka_bootstrap"]
    drive = Drive(producer, SCALE, twice=lambda r: r.job_id.endswith(("-a", "-b", "-d")))
    f_run = runs[-1]

    async def deposed_leader_first(run: RunSpec) -> None:
        stale = placement(run, epoch=1, nodes=[f"{run.cluster}-h100-0010"])
        await send(producer, stale, refused(run, 1))

    drive.hooks[f_run.job_id] = deposed_leader_first
    app = create_app(settings_for(service_env, budgets))
    pool = await create_pool(service_env["database_url"])
    try:
        async with running(app):
            play = asyncio.create_task(drive.all(runs))
            await asyncio.sleep(0.4)
            # The queue's bookkeeping for a cancel that raced the start: 0 s, not an executor.
            await send(producer, finished(runs[0], producer="queue", ran_s="0"))
            await play
            await until_closed(pool, runs)
            # Every end once more, as after a rebalance: nothing may change.
            for r in runs:
                await send(producer, ended(r))
            await asyncio.sleep(1.0)
            by_run = await ledger_by_run(pool, [r.job_id for r in runs])
        assert_exact(runs, by_run)
        assert len(by_run) == len(runs)
        kinds = await pool.fetch(
            "SELECT kind, count(*) AS n, count(*) FILTER (WHERE seconds < 0) AS credits "
            "FROM meter.usage WHERE job_id = ANY($1::text[]) GROUP BY kind",
            [r.job_id for r in runs],
        )
        print({k["kind"]: (k["n"], k["credits"]) for k in kinds})
        # Long runs were billed interval by interval while they ran, not only at their end.
        assert {k["kind"]: k["n"] for k in kinds}["interval"] > 3 * len(runs)

        # The stream finance reads adds up the same once deduplicated by tick_id.
        ours = {r.job_id for r in runs}
        expected_ticks = await pool.fetchval(
            "SELECT count(*) FROM meter.usage WHERE job_id = ANY($1::text[])", list(ours)
        )
        got = await collect(
            bootstrap,
            (topics.USAGE_TICK,),
            lambda _t, env: env["payload"].get("job_id") in ours,
            count=expected_ticks,
        )
        stream = {env["payload"]["tick_id"]: env for _, env in got}
        assert len(stream) == expected_ticks
        stream_cost = sum(Decimal(str(e["payload"]["cost"])) for e in stream.values())
        assert cents(stream_cost) == cents(sum((r.cost for r in runs), Decimal(0)))
        await check_gateway(service_env, list(stream.values()), runs, tag)
        await check_budgets(bootstrap, tag)
    finally:
        await pool.close()


async def check_gateway(
    env: dict[str, Any], ticks: list[dict[str, Any]], runs: list[RunSpec], tag: str
) -> None:
    from fastapi import FastAPI

    from services.gateway import store as gateway_store
    from services.gateway.context import Gateway
    from services.gateway.settings import GatewaySettings
    from services.gateway.usage import router

    pool = await create_pool(env["database_url"])
    try:
        await gateway_store.migrate_gateway(pool)
        projector = UsageProjector(pool)
        records = tuple(as_record(e, i) for i, e in enumerate(ticks))
        await projector.process(records)
        await projector.process(records)  # redelivered: nothing new
        assert projector.projected == len(ticks)
        tokens = {
            "fin": Principal("platform", Role.FINANCE),
            "vis": Principal(f"vision-{tag}", Role.USER),
        }
        app = FastAPI()
        app.include_router(router)
        app.state.gateway = Gateway(GatewaySettings(**env), pool, None, None, None, tokens)  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            span = {"from": "2000-01-01", "group_by": "tenant,project"}
            r = await client.get("/v1/usage", params=span, headers={"Authorization": "Bearer fin"})
            assert r.status_code == 200, r.text
            rows = [row for row in r.json()["rows"] if row["tenant"].endswith(tag)]
            truth: dict[tuple[str, str], Decimal] = {}
            for run in runs:
                key = (run.tenant, run.project)
                truth[key] = truth.get(key, Decimal(0)) + run.cost
            assert {(x["tenant"], x["project"]): cents(Decimal(str(x["cost"]))) for x in rows} == {
                k: cents(v) for k, v in truth.items()
            }
            mine = await client.get(
                "/v1/usage", params=span, headers={"Authorization": "Bearer vis"}
            )
            assert {x["tenant"] for x in mine.json()["rows"]} == {f"vision-{tag}"}
            other = await client.get(
                "/v1/usage",
                params={**span, "tenant": f"nlp-{tag}"},
                headers={"Authorization": "Bearer vis"},
            )
            assert other.status_code == 403
            text = await client.get(
                "/v1/usage",
                params={**span, "tenant": f"nlp-{tag}"},
                headers={"Authorization": "Bearer fin", "Accept": "text/csv"},
            )
            assert text.headers["content-type"].startswith("text/csv")
            lines = text.text.strip().splitlines()
            assert lines[0].startswith("tenant,project,currency,accelerator_seconds")
            assert len(lines) == 3  # nlp's two projects
    finally:
        await pool.close()


async def check_budgets(bootstrap: str, tag: str) -> None:
    def ours(_topic: str, env: dict[str, Any]) -> bool:
        return tag in json.dumps(env["payload"])

    got = await collect(
        bootstrap, (topics.BUDGET_EXCEEDED, topics.ALERT_RAISED), ours, count=11, timeout_s=4
    )
    exceeded = [
        BudgetExceeded.model_validate(e["payload"]) for t, e in got if t == topics.BUDGET_EXCEEDED
    ]
    alerts = [e["payload"] for t, e in got if t == topics.ALERT_RAISED]
    assert sorted((e.budget_id, e.threshold_pct) for e in exceeded) == [
        (f"n-{tag}", 50),
        (f"n-{tag}", 80),
        (f"v-{tag}", 50),
        (f"v-{tag}", 80),
        (f"v-{tag}", 100),
    ]
    assert len(alerts) == 5 and len({a["alert_id"] for a in alerts}) == 5
    blocks: dict[str, Any] = {}
    for e in exceeded:
        blocks = note_exceeded(blocks, e)
    last = max(e.crossed_at for e in exceeded)
    refusal = check_budget(f"vision-{tag}", "detect", blocks, last)
    assert refusal is not None and refusal.reason_code == "budget_exhausted"
    assert check_budget(f"nlp-{tag}", "llm", blocks, last) is None


async def test_idle_capacity_is_reported_as_overhead(
    service_env: dict[str, Any], producer: AIOKafkaProducer, budgets_file: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    cluster = f"idle-{tag}"
    nodes = [f"{cluster}-n0", f"{cluster}-n1"]
    run = RunSpec(
        f"{tag}-idle",
        f"vision-{tag}",
        "p",
        cluster,
        "H100",
        1,
        8,
        "1800",
        price=Decimal("2.10"),
        node_names=(nodes[0],),
    )
    # Idle capacity of an interval is accounted `meter_idle_lag_s` after it ends, with the
    # usage known by then; at this time scale an interval is 0.1 s of wall time, so a loaded
    # machine that delivers a start later than that would see the interval as idle. 3 s is
    # the lateness this test tolerates (the default is 5 s).
    app = create_app(settings_for(service_env, budgets_file, meter_idle_lag_s=3.0))
    pool = await create_pool(service_env["database_url"])
    try:
        async with running(app):
            await send(producer, capacity(cluster, nodes, "reserved", 2.10))
            for _ in range(100):  # the inventory first, so the node's tier is known
                if await pool.fetchval(
                    "SELECT count(*) FROM meter.pools WHERE cluster = $1", cluster
                ):
                    break
                await asyncio.sleep(0.1)
            await Drive(producer, SCALE).all([run])
            await until_closed(pool, [run])
            # Idle lags usage (the clock bills it per interval): wait until it covers every
            # whole interval of the run, however slow the machine.
            for _ in range(300):
                rows = await pool.fetch(
                    "SELECT interval_index, kind, tenant, accelerator_seconds, cost"
                    " FROM meter.usage WHERE cluster = $1 ORDER BY interval_index",
                    cluster,
                )
                whole = {r["interval_index"] for r in rows if r["kind"] == "interval"}
                whole -= {min(whole, default=0)}  # the first interval may be partial
                idle = {r["interval_index"]: r for r in rows if r["kind"] == "idle"}
                if whole and whole <= set(idle):
                    break
                await asyncio.sleep(0.1)
        assert whole and whole <= set(idle)
        for k in whole:  # 16 accelerators x 60 s, 8 of them allocated
            assert idle[k]["accelerator_seconds"] == 480
            assert idle[k]["tenant"] == "platform"
            assert idle[k]["cost"] == Decimal("0.280000")
    finally:
        await pool.close()


async def test_a_failed_run_is_metered_to_its_end_and_its_retry_on_its_own(
    service_env: dict[str, Any], producer: AIOKafkaProducer, budgets_file: Path
) -> None:
    """job.run.failed closes the run (outcome failed) exactly like job.preempted; the queue's
    retry is attempt 2, metered separately. A redelivered failure changes nothing."""
    tag = uuid.uuid4().hex[:6]
    failed = RunSpec(
        f"{tag}-retry", f"vision-{tag}", "p", "onprem-h100", "H100", 1, 8, "300.5", "failed"
    )
    retry = RunSpec(
        f"{tag}-retry",
        f"vision-{tag}",
        "p",
        "onprem-h100",
        "H100",
        1,
        8,
        "120",
        attempt=2,
        first_node=1,
    )
    failure = RunFailed(
        job_id=failed.job_id,
        attempt=1,
        cluster=failed.cluster,
        reason_code="application_error",
        message="the job's process exited with code 1",
        exit_code=1,
        ran_s=float(failed.ran_s),
    )
    app = create_app(settings_for(service_env, budgets_file))
    pool = await create_pool(service_env["database_url"])
    try:
        async with running(app):
            at = datetime.now(UTC)
            await send(producer, placement(failed), started(failed, at))
            await asyncio.sleep(float(failed.ran_s) / SCALE)
            value = envelope("RunFailed", failure, "executor/onprem-h100", failed.tenant)
            for _ in range(2):  # delivered twice
                await producer.send_and_wait(
                    topics.JOB_RUN_FAILED,
                    value.model_dump_json().encode(),
                    key=failed.job_id.encode(),
                )
            await Drive(producer, SCALE).all([retry])
            await until_closed(pool, [failed, retry])
            await asyncio.sleep(0.5)
            by_run = await ledger_by_run(pool, [failed.job_id])
            outcomes = await pool.fetch(
                "SELECT run_id, outcome FROM meter.usage WHERE job_id = $1 AND kind = 'close'",
                failed.job_id,
            )
    finally:
        await pool.close()
    assert_exact([failed, retry], by_run)
    assert {r["run_id"]: r["outcome"] for r in outcomes} == {
        f"{failed.job_id}#1": "failed",
        f"{failed.job_id}#2": "succeeded",
    }
