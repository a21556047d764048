"""Page times of the web dashboard over a read model of 10,000 jobs.

Fills the gateway's schema with `--jobs` jobs of four tenants in every state (with their
history lines, usage ticks and the scheduler's explanations for the pending ones) on a fleet of
800 nodes of 8 devices (4 clusters of one type each), starts the
real gateway (uvicorn, on a socket) against it, and times each page over HTTP: `--repeat`
requests after two warm-ups, as an operator (every tenant) and as a researcher (one tenant).
Reports median and p95 milliseconds per page and the size of the HTML.

Uses QM_KAFKA_BOOTSTRAP / QM_DATABASE_URL / QM_REDIS_URL when set; otherwise starts Tansu and
takes a fresh database on the local PostgreSQL (or an embedded one).

    python bench/dashboard.py                 # 10,000 jobs, 20 requests per page
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import describe, percentile, servers
from cli.infra import free_port
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings

TENANTS = ("vision", "nlp", "speech", "research")
STATES = (
    ["succeeded"] * 50 + ["failed"] * 6 + ["canceled"] * 4 + ["running"] * 20 + ["queued"] * 18
) + ["placed", "preempting"]
TYPES = ("H100", "A100", "L4", "TPU-v5e")
ADMIN = {"Authorization": "Bearer dev-admin"}
RESEARCHER = {"Authorization": "Bearer dev-vision"}


def synthetic(n: int, seed: int) -> tuple[list[tuple[Any, ...]], ...]:
    """Rows of gateway.jobs, job_events, usage_ticks and explanations for n jobs over a day."""
    rng = random.Random(seed)
    now = datetime.now(UTC)
    jobs, events, ticks, whys = [], [], [], []
    for i in range(n):
        job_id = f"bench-{i:06d}"
        tenant = rng.choice(TENANTS)
        state = rng.choice(STATES)
        kind = rng.choice(TYPES)
        acc = rng.choice([1, 1, 2, 4, 8, 16, 0.5])
        at = now - timedelta(seconds=rng.uniform(0, 86_400))
        cluster = None if state == "queued" else f"cluster-{kind.lower()}"
        nodes = [] if cluster is None else [f"{cluster}-{rng.randrange(200):04d}"]
        spec = {"job_id": job_id, "tenant": tenant, "resources": {"accelerators": acc}}
        placement = (
            None
            if cluster is None
            else {
                "attempt": 1,
                "cluster": cluster,
                "accelerator_type": kind,
                "replicas": [
                    {"replica": 0, "node_id": nodes[0], "accelerators": acc, "devices": [0]}
                ],
            }
        )
        jobs.append(
            (
                job_id,
                tenant,
                f"proj-{rng.randrange(12)}",
                f"user-{rng.randrange(40)}",
                rng.choice(["default", "batch", "interactive"]),
                f"job-{i}",
                state,
                1,
                cluster,
                nodes,
                1,
                float(acc),
                json.dumps(spec),
                at,
                at + timedelta(seconds=30),
                json.dumps(placement) if placement else None,
                kind,
            )
        )
        kinds = ["JobSubmitted", "JobQueued"]
        if state != "queued":
            kinds += ["PlacementDecided", "JobStarted"]
        if state in ("succeeded", "failed", "canceled"):
            kinds.append("JobFinished")
        for k, event_type in enumerate(kinds):
            events.append((f"{job_id}-e{k}", job_id, at + timedelta(seconds=2 * k), event_type))
        if state in ("succeeded", "failed", "canceled", "running"):
            for t in range(rng.randrange(1, 6)):
                start = at + timedelta(minutes=t)
                ticks.append(
                    (
                        f"{job_id}-t{t}",
                        "interval",
                        f"{job_id}-r1",
                        job_id,
                        tenant,
                        "proj",
                        "user",
                        cluster,
                        kind,
                        "reserved",
                        t,
                        start,
                        start + timedelta(minutes=1),
                        acc,
                        60,
                        acc * 60,
                        2.5,
                        acc * 60 * 2.5 / 3600,
                        "USD",
                    )
                )
        if state == "queued":
            whys.append((job_id, ["quota_exhausted"], "waiting for quota", 1800, at))
    return jobs, events, ticks, whys


def fleet(now: datetime) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The nodes the jobs' placements name: 4 clusters x 200 nodes of 8 devices, and their
    clusters' inventories."""
    nodes, clusters = [], []
    for kind in TYPES:
        cluster = f"cluster-{kind.lower()}"
        clusters.append((cluster, "bench", "onprem", 200, now))
        for n in range(200):
            nodes.append(
                (
                    f"{cluster}-{n:04d}",
                    cluster,
                    f"b{n // 64}",
                    f"r{n // 8}",
                    f"nv{n // 8}",
                    kind,
                    kind,
                    8,
                    80.0,
                    "reserved",
                    True,
                    now,
                )
            )
    return nodes, clusters


async def fill(database: str, n: int, seed: int) -> None:
    jobs, events, ticks, whys = synthetic(n, seed)
    conn = await asyncpg.connect(database)
    try:
        await conn.copy_records_to_table(
            "jobs",
            schema_name="gateway",
            records=jobs,
            columns=[
                "job_id",
                "tenant",
                "project",
                "user",
                "queue",
                "name",
                "state",
                "attempt",
                "cluster",
                "nodes",
                "replicas",
                "accelerators",
                "spec",
                "submitted_at",
                "updated_at",
                "placement",
                "accelerator_type",
            ],
        )
        await conn.copy_records_to_table(
            "job_events",
            schema_name="gateway",
            records=events,
            columns=["event_id", "job_id", "at", "type"],
        )
        await conn.copy_records_to_table(
            "usage_ticks",
            schema_name="gateway",
            records=ticks,
            columns=[
                "tick_id",
                "kind",
                "run_id",
                "job_id",
                "tenant",
                "project",
                "user",
                "cluster",
                "accelerator_type",
                "price_tier",
                "interval_index",
                "interval_start",
                "interval_end",
                "count",
                "seconds",
                "accelerator_seconds",
                "unit_price",
                "cost",
                "currency",
            ],
        )
        await conn.copy_records_to_table(
            "explanations",
            schema_name="gateway",
            records=whys,
            columns=["job_id", "codes", "message", "pending_jobs", "at"],
        )
        nodes, clusters = fleet(datetime.now(UTC))
        await conn.copy_records_to_table(
            "fleet_clusters",
            schema_name="gateway",
            records=clusters,
            columns=["cluster", "location", "kind", "nodes", "at"],
        )
        await conn.copy_records_to_table(
            "fleet_nodes",
            schema_name="gateway",
            records=nodes,
            columns=[
                "node_id",
                "cluster",
                "block",
                "rack",
                "nvlink_domain",
                "accelerator_type",
                "generation",
                "accelerators",
                "accelerator_memory_gb",
                "price_tier",
                "schedulable",
                "at",
            ],
        )
        await conn.execute("ANALYZE gateway.jobs; ANALYZE gateway.job_events;")
        await conn.execute("ANALYZE gateway.usage_ticks;")
    finally:
        await conn.close()
    print(
        f"filled: {len(jobs):,} jobs, {len(events):,} history lines, {len(ticks):,} ticks,"
        f" {len(nodes):,} nodes of 8 devices"
    )


async def deep_cursor(client: httpx.AsyncClient, pages: int) -> str:
    """The URL of the jobs table `pages` pages in (following the next links)."""
    url = "/ui/jobs"
    for _ in range(pages):
        html = (await client.get(url, headers=ADMIN)).text
        marker = 'data-testid="next" href="'
        start = html.index(marker) + len(marker)
        url = html[start : html.index('"', start)].replace("&amp;", "&")
    return url


async def measure(database: str, kafka: str, args: argparse.Namespace) -> dict[str, Any]:
    os.environ.update(
        {
            "QM_DATABASE_URL": database,
            "QM_KAFKA_BOOTSTRAP": kafka,
            "QM_GROUP_ID": f"gateway-bench-{os.getpid()}",
        }
    )
    port = free_port()
    app = create_app(GatewaySettings(http_port=port))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    serving = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 (uvicorn offers no event to wait on)
        await asyncio.sleep(0.05)
    try:
        await fill(database, args.jobs, args.seed)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            deep = max(1, min(40, args.jobs // 100))  # pages of 50: well inside the table
            sample = await client.get("/ui/jobs?state=queued", headers=ADMIN)
            one = sample.text.split('href="/ui/jobs/', 1)[1].split('"', 1)[0]
            pages: list[tuple[str, str, dict[str, str]]] = [
                ("overview", "/ui/", ADMIN),
                ("jobs", "/ui/jobs", ADMIN),
                (f"jobs, page {deep}", await deep_cursor(client, deep), ADMIN),
                ("jobs, filtered", "/ui/jobs?state=running&type=H100&queue=batch", ADMIN),
                ("jobs, one tenant", "/ui/jobs", RESEARCHER),
                ("jobs, grouped by user", "/ui/jobs?group=user", ADMIN),
                ("job detail (pending)", f"/ui/jobs/{one}", ADMIN),
                ("cost by project, month", "/ui/cost?by=project", ADMIN),
                ("tenants and queues", "/ui/tenants", ADMIN),
                ("fleet, every node", "/ui/fleet", ADMIN),
                ("fleet, one cluster", "/ui/fleet?cluster=cluster-h100", ADMIN),
                ("scheduler health", "/ui/scheduler", ADMIN),
                ("CSV of every job", "/ui/jobs.csv", ADMIN),
            ]
            figures: dict[str, dict[str, float]] = {}
            for name, url, headers in pages:
                times, size = [], 0
                for i in range(args.repeat + 2):
                    t0 = time.perf_counter()
                    answer = await client.get(url, headers=headers)
                    elapsed = (time.perf_counter() - t0) * 1000
                    if answer.status_code != 200:
                        raise SystemExit(f"{name}: {answer.status_code} {answer.text[:300]}")
                    size = len(answer.content)
                    if i >= 2:
                        times.append(elapsed)
                times.sort()
                figures[name] = {
                    "median_ms": round(statistics.median(times), 1),
                    "p95_ms": round(percentile(times, 0.95), 1),
                    "kb": round(size / 1024, 1),
                }
                print(
                    f"  {name:<26} median {figures[name]['median_ms']:7.1f} ms"
                    f"  p95 {figures[name]['p95_ms']:7.1f} ms  {figures[name]['kb']:8.1f} KiB"
                )
        return figures
    finally:
        server.should_exit = True
        await serving


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=20, help="timed requests per page")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with servers("qm_dashboard_bench") as (kafka, database, where):
        print(f"dashboard page times, {args.jobs:,} jobs, against {where}")
        figures = asyncio.run(measure(database, kafka, args))
    setup = {
        **describe(),
        "jobs": args.jobs,
        "repeat": args.repeat,
        "client": "httpx over a socket to one uvicorn worker, sequential requests",
    }
    print(
        json.dumps(
            {
                "bench": "dashboard",
                "jobs": args.jobs,
                "page_ms": {k: v["median_ms"] for k, v in figures.items()},
                "page_p95_ms": {k: v["p95_ms"] for k, v in figures.items()},
                "page_kb": {k: v["kb"] for k, v in figures.items()},
                "setup": setup,
            }
        )
    )


if __name__ == "__main__":
    main()
