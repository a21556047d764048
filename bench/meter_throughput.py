"""The meter on the real broker and PostgreSQL: how many ticks a second it writes into the
ledger (batched, with the outbox and the relay to Kafka running), and the delay from a job
finishing (its JobFinished published) to its close tick being queryable in the ledger.

Phase 1 opens `--runs` runs that started `--backlog-s` wall seconds ago (at time scale 600,
ten 60 s intervals per wall second each), so the clock has a backlog of ticks to write: the
figure is the ledger's growth rate while it catches up. Those runs are then ended and the
outbox left to drain. Phase 2 keeps `--background` runs billed by the clock (ten ticks a
second each) while it ends `--finishes` other runs at known moments and polls the ledger for
each close tick.

Uses QM_KAFKA_BOOTSTRAP / QM_DATABASE_URL when set; otherwise starts Tansu, and takes a fresh
database on the local PostgreSQL (or an embedded one), and removes them afterwards.

    python bench/meter_throughput.py                  # 1000 runs x 600 intervals, 300 finishes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from aiokafka import AIOKafkaProducer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import describe, percentile, servers
from schemas import topics
from schemas.envelope import Envelope
from services.common.db import create_pool
from services.common.settings import REPO_ROOT
from services.common.topics import ensure_topics
from services.meter.app import create_app
from services.meter.settings import MeterSettings

SCALE = 600.0
INTERVAL_S = 60.0
CLUSTER, NODES = "onprem-h100", 32  # examples/fleet.yaml: 32 nodes of 8 reserved H100


def lifecycle(job_id: str, at: datetime, ran_s: float | None) -> list[tuple[str, Envelope]]:
    """Placement and start of a one-node H100 run, and its end if `ran_s` is given."""
    node = f"{CLUSTER}-h100-{hash(job_id) % NODES:04d}"
    spec = {"job_id": job_id, "tenant": "vision", "project": "bench", "user": "bench"}
    out = [
        (
            topics.PLACEMENT_DECIDED,
            Envelope(
                type="PlacementDecided",
                producer="scheduler",
                payload={
                    "job_id": job_id,
                    "attempt": 1,
                    "epoch": 1,
                    "leader": "bench",
                    "cluster": CLUSTER,
                    "accelerator_type": "H100",
                    "replicas": [
                        {"replica": 0, "node_id": node, "accelerators": 1, "cpu": 1, "memory_gb": 1}
                    ],
                    "spec": spec,
                },
            ),
        ),
        (
            topics.JOB_STARTED,
            Envelope(
                type="JobStarted",
                producer=f"executor/{CLUSTER}",
                payload={
                    "job_id": job_id,
                    "attempt": 1,
                    "cluster": CLUSTER,
                    "nodes": [node],
                    "started_at": at.isoformat(),
                },
            ),
        ),
    ]
    if ran_s is not None:
        out.append(finished(job_id, ran_s))
    return out


def finished(job_id: str, ran_s: float) -> tuple[str, Envelope]:
    return (
        topics.JOB_FINISHED,
        Envelope(
            type="JobFinished",
            producer=f"executor/{CLUSTER}",
            payload={
                "job_id": job_id,
                "attempt": 1,
                "outcome": "succeeded",
                "cluster": CLUSTER,
                "ran_s": ran_s,
            },
        ),
    )


async def send(producer: AIOKafkaProducer, events: list[tuple[str, Envelope]]) -> None:
    futures = [
        await producer.send(t, e.model_dump_json().encode(), key=e.payload["job_id"].encode())
        for t, e in events
    ]
    await asyncio.gather(*futures)


async def ledger_rows(pool: Any) -> int:
    # The planner's estimate would lag; count(*) on a few million rows is fine here.
    return int(await pool.fetchval("SELECT count(*) FROM meter.ledger"))


async def throughput(
    pool: Any, producer: AIOKafkaProducer, args: argparse.Namespace
) -> dict[str, Any]:
    run = uuid.uuid4().hex[:6]
    started = datetime.now(UTC) - timedelta(seconds=args.backlog_s)
    backlog = int(args.runs * args.backlog_s * SCALE / INTERVAL_S)
    events = [e for i in range(args.runs) for e in lifecycle(f"tp-{run}-{i}", started, None)]
    base = await ledger_rows(pool)
    await send(producer, events)
    samples: list[tuple[float, int]] = []
    deadline = time.perf_counter() + args.timeout_s
    while time.perf_counter() < deadline:
        samples.append((time.perf_counter(), await ledger_rows(pool) - base))
        if samples[-1][1] >= backlog:
            break
        await asyncio.sleep(0.25)
    # The rate between 10% and 90% of the backlog: ramp-up and the tail left out.
    lo = next(s for s in samples if s[1] >= backlog * 0.1)
    hi = next((s for s in samples if s[1] >= backlog * 0.9), samples[-1])
    rate = (hi[1] - lo[1]) / (hi[0] - lo[0]) if hi[0] > lo[0] else float("nan")
    took = samples[-1][0] - samples[0][0]
    print(
        f"backlog of {backlog} ticks ({args.runs} runs x {backlog // args.runs} intervals): "
        f"{samples[-1][1]} written in {took:.1f} s, {rate:,.0f} ticks/s (10%..90%)"
    )
    # End them all (a JobFinished each) and let the relay drain before the next phase.
    ran = round((datetime.now(UTC) - started).total_seconds() * SCALE, 3)
    await send(producer, [finished(f"tp-{run}-{i}", ran) for i in range(args.runs)])
    await drained(pool, [f"tp-{run}-{i}#1/close/reserved" for i in range(args.runs)])
    return {"ticks_per_s": round(rate), "backlog_ticks": backlog, "backlog_written": samples[-1][1]}


async def drained(pool: Any, close_ticks: list[str], timeout_s: float = 300.0) -> None:
    """Until these close ticks are in the ledger and the outbox is empty."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        closed = await pool.fetchval(
            "SELECT count(*) FROM meter.ledger WHERE tick_id = ANY($1::text[])", close_ticks
        )
        if closed == len(close_ticks) and not await pool.fetchval(
            "SELECT count(*) FROM meter.outbox"
        ):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError("the meter did not drain in time")


async def final_delay(
    pool: Any, producer: AIOKafkaProducer, args: argparse.Namespace
) -> dict[str, Any]:
    run = uuid.uuid4().hex[:6]
    rng = random.Random(7)
    jobs = [f"fd-{run}-{i}" for i in range(args.finishes)]
    now = datetime.now(UTC)
    background = [e for i in range(args.background) for e in lifecycle(f"bg-{run}-{i}", now, None)]
    await send(producer, background + [e for j in jobs for e in lifecycle(j, now, None)])
    # Each ends between 1 and 4 wall seconds from now, at an arbitrary fleet second.
    ends = {j: rng.uniform(1.0, 4.0) for j in jobs}
    sent: dict[str, float] = {}

    async def end(job_id: str) -> None:
        await asyncio.sleep(ends[job_id])
        ran = round((datetime.now(UTC) - now).total_seconds() * SCALE, 3)
        sent[job_id] = time.perf_counter()
        await send(producer, [finished(job_id, ran)])

    closes = {f"{j}#1/close/reserved": j for j in jobs}
    seen: dict[str, float] = {}
    ending = asyncio.gather(*(end(j) for j in jobs))
    deadline = time.perf_counter() + 60
    while len(seen) < len(jobs) and time.perf_counter() < deadline:
        waiting = [t for t in closes if closes[t] not in seen and closes[t] in sent]
        if waiting:
            rows = await pool.fetch(
                "SELECT tick_id FROM meter.ledger WHERE tick_id = ANY($1::text[])", waiting
            )
            now_pc = time.perf_counter()
            for r in rows:
                seen[closes[r["tick_id"]]] = now_pc
        await asyncio.sleep(0.005)
    await ending
    delays = sorted((seen[j] - sent[j]) * 1000 for j in seen)
    p50, p99 = percentile(delays, 0.5), percentile(delays, 0.99)
    print(
        f"{len(delays)}/{len(jobs)} close ticks queryable: p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
        f"max {delays[-1] if delays else float('nan'):.1f} ms after the JobFinished was published"
    )
    return {
        "final_tick_delay_ms": round(p50, 1),
        "final_tick_delay_p99_ms": round(p99, 1),
        "finishes": len(delays),
    }


async def measure(bootstrap: str, database: str, args: argparse.Namespace) -> dict[str, Any]:
    await ensure_topics(bootstrap)
    with tempfile.TemporaryDirectory(prefix="qm-meter-bench-") as tmp:
        budgets = Path(tmp) / "budgets.yaml"
        budgets.write_text(yaml.safe_dump({"currency": "USD"}))
        settings = MeterSettings(
            kafka_bootstrap=bootstrap,
            database_url=database,
            policy_file=REPO_ROOT / "examples" / "policy.yaml",
            fleet_file=REPO_ROOT / "examples" / "fleet.yaml",
            budgets_file=budgets,
            group_id=f"meter-bench-{uuid.uuid4().hex[:6]}",
            time_scale=SCALE,
            meter_interval_s=INTERVAL_S,
            meter_startup_grace_s=0.5,
            log_format="console",
            log_level="WARNING",
        )
        app = create_app(settings)
        pool = await create_pool(database)
        producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap, linger_ms=2, max_batch_size=1 << 20
        )
        await producer.start()
        try:
            async with app.router.lifespan_context(app):
                figures = await throughput(pool, producer, args)
                figures |= await final_delay(pool, producer, args)
        finally:
            await producer.stop()
            await pool.close()
    return figures


def main() -> None:
    # `timeout` or Ctrl-C must still stop the broker and drop the database started here.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=1000, help="open runs in phase 1")
    parser.add_argument("--backlog-s", type=float, default=60.0, help="wall seconds they ran")
    parser.add_argument("--finishes", type=int, default=300, help="runs ended in phase 2")
    parser.add_argument(
        "--background", type=int, default=200, help="runs billed by the clock in phase 2"
    )
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    with servers("qm_meter_bench") as (bootstrap, database, where):
        print(f"meter_throughput against {where} ({bootstrap})")
        figures = asyncio.run(measure(bootstrap, database, args))
    setup = {
        **describe(),
        "runs": args.runs,
        "backlog_s": args.backlog_s,
        "finishes": args.finishes,
        "background_runs": args.background,
        "background_ticks_per_s": args.background * SCALE / INTERVAL_S,
        "time_scale": SCALE,
        "interval_s": INTERVAL_S,
        "ledger": "meter.ledger via COPY, outbox per batch, relay to Kafka running",
    }
    print(json.dumps({"bench": "meter_throughput", **figures, "setup": setup}))


if __name__ == "__main__":
    main()
