"""The gateway's fleet and queue views on the real broker and PostgreSQL: executors'
inventories, health verdicts and job lifecycle events become `GET /v1/fleet`, `/v1/nodes`,
`/v1/nodes/{id}` and `/v1/queues`, scoped by token; poison on the fleet topics is
dead-lettered once and stops nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    ClusterCapacity,
    JobPreempted,
    JobQueued,
    JobStarted,
    NodeInfo,
    PendingExplained,
    PlacementDecided,
    ReplicaAssignment,
)
from schemas.health import NodeUnhealthy
from schemas.job import JobSpec
from services.common.db import create_pool, migrate
from services.common.topics import ensure_topics
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from services.gateway.store import MIGRATIONS, SCHEMA
from tests.conftest import private_kafka
from tests.integration.conftest import running
from tests.integration.kafka_tools import collect, produce

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
VISION = {"Authorization": "Bearer dev-vision"}
NLP = {"Authorization": "Bearer dev-nlp"}
OPS = {"Authorization": "Bearer dev-ops"}
T0 = datetime.now(UTC) - timedelta(minutes=10)


@pytest.fixture
async def own_kafka(tmp_path: Path) -> AsyncIterator[str]:
    """A broker of its own: a made-up cluster's inventory stays out of other tests' fleets."""
    with private_kafka(tmp_path / "kafka") as url:
        await ensure_topics(url)
        yield url


def envelope(payload: BaseModel, seconds: float = 0, tenant: str | None = None) -> bytes:
    env = Envelope(
        type=type(payload).__name__,
        occurred_at=T0 + timedelta(seconds=seconds),
        tenant=tenant,
        payload=payload.model_dump(mode="json"),
    )
    return env.model_dump_json().encode()


def node(node_id: str, type: str = "H100", accelerators: int = 8, rack: str = "r0") -> NodeInfo:
    return NodeInfo(
        node_id=node_id, block="b0", rack=rack, nvlink_domain=node_id, accelerator_type=type,
        generation="g", accelerator_memory_gb=80, relative_speed=1, accelerators=accelerators,
        cpu=96, memory_gb=1024, price_tier="on_demand",
    )  # fmt: skip


def spec(job_id: str, tenant: str, accelerators: float = 4) -> JobSpec:
    return JobSpec.model_validate(
        {
            "job_id": job_id,
            "tenant": tenant,
            "resources": {"accelerators": accelerators, "accelerator_types": ["H100"]},
        }
    )


def placed(s: JobSpec, node_id: str, devices: list[int]) -> PlacementDecided:
    return PlacementDecided(
        job_id=str(s.job_id), attempt=1, epoch=1, leader="s", cluster="c1",
        accelerator_type="H100", spec=s,
        replicas=[
            ReplicaAssignment(
                replica=0, node_id=node_id, accelerators=len(devices), cpu=1, memory_gb=1,
                devices=devices,
            )
        ],
    )  # fmt: skip


async def until(
    client: httpx.AsyncClient, path: str, headers: dict[str, str], ok: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for _ in range(300):
        response = await client.get(path, headers=headers)
        body = response.json()
        if response.status_code == 200 and ok(body):
            return body
        await asyncio.sleep(0.1)
    raise AssertionError(f"{path} never showed it: {body}")


async def test_fleet_nodes_and_queues(
    own_kafka: str, fresh_database_url: str, redis_url: str
) -> None:
    app = create_app(
        GatewaySettings(
            kafka_bootstrap=own_kafka,
            database_url=fresh_database_url,
            redis_url=redis_url,
            policy_file=ROOT / "examples" / "policy.yaml",
            auth_file=ROOT / "examples" / "auth.yaml",
            log_format="console",
        )
    )
    mine, theirs, victim, waiting = (
        spec("j-vision-run", "vision"),
        spec("j-nlp-held", "nlp"),
        spec("j-vision-victim", "vision"),
        spec("j-vision-wait", "vision", accelerators=8),
    )
    lifecycle: list[tuple[str, str, bytes]] = []
    for i, s in enumerate((mine, theirs, victim, waiting)):
        queued = JobQueued(job_id=str(s.job_id), spec=s, submitted_at=T0)
        lifecycle.append((topics.JOB_QUEUED, str(s.job_id), envelope(queued, i)))
    started = JobStarted(
        job_id="j-vision-run", attempt=1, cluster="c1", nodes=["n0"], started_at=T0
    )
    preempted = JobPreempted(
        job_id="j-vision-victim", attempt=1, cluster="c1", reason_code="preempted_for_priority",
        message="room for j-nlp-held", for_job="j-nlp-held",
    )  # fmt: skip
    requeued = JobQueued(
        job_id="j-vision-victim", spec=victim, submitted_at=T0, attempt=1, requeue_of_attempt=1
    )
    lifecycle += [
        (topics.PLACEMENT_DECIDED, "j-vision-run", envelope(placed(mine, "n0", [0, 1, 2, 3]), 10)),
        (topics.JOB_STARTED, "j-vision-run", envelope(started, 70)),
        (topics.PLACEMENT_DECIDED, "j-nlp-held", envelope(placed(theirs, "n0", [4, 5, 6, 7]), 20)),
        (topics.PLACEMENT_DECIDED, "j-vision-victim", envelope(placed(victim, "n2", [0]), 5)),
        (topics.JOB_PREEMPTED, "j-vision-victim", envelope(preempted, 30)),
        (topics.JOB_QUEUED, "j-vision-victim", envelope(requeued, 31)),
    ]
    why = PendingExplained(
        job_id="j-vision-wait", codes=["quota_exhausted", "behind_higher_priority"],
        message="quota", pending_jobs=1,
    )  # fmt: skip
    inventory = ClusterCapacity(
        cluster="c1", location="lab", kind="on_prem", prices={},
        nodes=[node("n0"), node("n1", rack="r1"), node("n2", type="TPU-v5e", accelerators=4)],
    )  # fmt: skip
    sick = NodeUnhealthy(
        node_id="n1", cluster="c1", cause="xid_79", signals=["gpu_xid 79 on device 3"],
        since=T0, incident_id="inc-1",
    )  # fmt: skip
    ghost = sick.model_copy(update={"node_id": "ghost", "incident_id": "inc-2"})
    nan = envelope(inventory).replace(b'"cpu":96.0', b'"cpu":NaN', 1)
    assert b"NaN" in nan
    async with running(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            for topic, key, value in lifecycle:
                await produce(own_kafka, topic, [(key, value)])
            await produce(
                own_kafka, topics.SCHEDULING_EXPLAINED, [("j-vision-wait", envelope(why, 40))]
            )
            await produce(
                own_kafka,
                topics.CLUSTER_CAPACITY,
                [("c1", b"not json"), ("c1", nan), ("c1", envelope(inventory))],
            )
            await produce(
                own_kafka,
                topics.NODE_UNHEALTHY,
                [("n1", b"\xff"), ("n1", envelope(sick, 50)), ("ghost", envelope(ghost, 50))],
            )

            # Each topic has its own consumer, so the projection reaches this state in no set
            # order: wait for all of it (the start of j-vision-run turns its held devices
            # allocated; the victim has left n2), then look at the rest.
            def settled(b: dict[str, Any]) -> bool:
                by_type = {t["accelerator_type"]: t for t in b["totals"]}
                h100, tpu = by_type.get("H100"), by_type.get("TPU-v5e")
                return (
                    h100 is not None
                    and tpu is not None
                    and (h100["allocated"], h100["held"], h100["quarantined"]) == (8, 4, 8)
                    and tpu["idle"] == 4
                )

            fleet = await until(client, "/v1/fleet", OPS, settled)
            totals = {t["accelerator_type"]: t for t in fleet["totals"]}
            h100 = totals["H100"]
            assert (h100["total"], h100["allocated"], h100["held"]) == (16, 8, 4)
            assert (h100["idle"], h100["quarantined"], h100["unhealthy"]) == (0, 8, 8)
            # The preempted job's device on n2 is free again.
            assert (totals["TPU-v5e"]["total"], totals["TPU-v5e"]["idle"]) == (4, 4)
            (cluster,) = fleet["clusters"]
            assert [r["rack"] for r in cluster["blocks"][0]["racks"]] == ["r0", "r1"]
            fits = {
                (f["accelerator_type"], f["devices"]): f["fits"] for f in fleet["fragmentation"]
            }
            assert fits[("H100", 1)] == 0 and fits[("TPU-v5e", 4)] == 1

            # A researcher sees its own jobs on a device, another tenant's only as taken.
            seen_by_vision = (await client.get("/v1/fleet", headers=VISION)).json()
            n0 = seen_by_vision["clusters"][0]["blocks"][0]["racks"][0]["nodes"][0]
            assert [(d["state"], d["jobs"]) for d in n0["devices"][3:5]] == [
                ("allocated", ["j-vision-run"]),
                ("held", []),
            ]

            quarantined = (
                await client.get("/v1/nodes", params={"state": "quarantined"}, headers=VISION)
            ).json()
            assert [n["node_id"] for n in quarantined["nodes"]] == ["n1"]
            tpu = (await client.get("/v1/nodes", params={"type": "TPU-v5e"}, headers=OPS)).json()
            assert [n["node_id"] for n in tpu["nodes"]] == ["n2"]
            n1 = (await client.get("/v1/nodes/n1", headers=VISION)).json()
            assert n1["node"]["cause"] == "xid_79" and n1["quarantined_since"] is not None
            assert [(h["verdict"], h["incident_id"]) for h in n1["health"]] == [
                ("unhealthy", "inc-1")
            ]
            on_n0 = (await client.get("/v1/nodes/n0", headers=NLP)).json()["jobs"]
            assert sorted((j["job_id"] or "", j["devices"]) for j in on_n0) == [
                ("", [0, 1, 2, 3]),  # vision's, anonymous to nlp
                ("j-nlp-held", [4, 5, 6, 7]),
            ]
            assert (await client.get("/v1/nodes/ghost", headers=OPS)).status_code == 404

            mine_only = await until(
                client,
                "/v1/queues",
                VISION,
                # The explanation, the preemption and the requeue come on three topics.
                lambda b: (
                    any(
                        r["code"] == "quota_exhausted" for r in b["tenants"][0]["pending_by_reason"]
                    )
                    and b["tenants"][0]["preemptions_received"] == 1
                    and b["tenants"][0]["pending_jobs"] == 2
                ),
            )
            (vision,) = mine_only["tenants"]
            h100_row = next(t for t in vision["types"] if t["accelerator_type"] == "H100")
            assert (h100_row["nominal"], h100_row["usage"], h100_row["borrowed"]) == (128, 4, 0)
            # The first reason code counts; the requeued victim waits for the next cycle.
            assert vision["pending_by_reason"] == [
                {"code": "awaiting_cycle", "jobs": 1, "accelerators": 4.0},
                {"code": "quota_exhausted", "jobs": 1, "accelerators": 8.0},
            ]
            assert (vision["pending_jobs"], vision["pending_accelerators"]) == (2, 12)
            assert vision["oldest_pending"]["job_id"] == "j-vision-victim"  # same age: by id
            assert vision["wait"]["starts"] == 1
            assert vision["wait"]["p50_s"] == pytest.approx(70 - 0)
            assert (vision["preemptions_received"], vision["preemptions_given"]) == (1, 0)
            assert vision["jobs_by_state"] == {"running": 1, "queued": 2}

            everyone = (await client.get("/v1/queues", headers=OPS)).json()
            by_tenant = {t["tenant"]: t for t in everyone["tenants"]}
            assert {"vision", "nlp", "speech", "research", "platform"} <= set(by_tenant)
            nlp = by_tenant["nlp"]
            assert (nlp["usage"], nlp["preemptions_given"]) == (4, 1)
            # Vision (weight 1) and nlp (1.5) have work: 40% and 60% of the fleet by weight.
            assert by_tenant["vision"]["fair_share"] == pytest.approx(0.4)
            assert nlp["fair_share"] == pytest.approx(0.6) and nlp["actual_share"] == 0.5
            assert by_tenant["speech"]["fair_share"] is None
            assert by_tenant["vision"]["oldest_pending"]["job_id"] == "j-vision-victim"
            # Finance sees every queue, but not the ids of jobs it may not read.
            as_finance = (
                await client.get("/v1/queues", headers={"Authorization": "Bearer dev-finance"})
            ).json()
            seen = {t["tenant"]: t for t in as_finance["tenants"]}
            assert seen["vision"]["oldest_pending"]["job_id"] is None
            assert seen["vision"]["oldest_pending"]["waiting_s"] >= 0

            letters = await collect(
                own_kafka,
                (topics.DEAD_LETTER,),
                lambda _t, env: (
                    env["payload"]["consumer"] == "gateway"
                    and env["payload"]["source_topic"]
                    in (topics.CLUSTER_CAPACITY, topics.NODE_UNHEALTHY)
                ),
                count=10,
                timeout_s=3,
            )
            sources = sorted(
                (env["payload"]["source_topic"], env["payload"]["offset"]) for _, env in letters
            )
            # Each unreadable record once: the pools reader and the fleet reader share them.
            assert sources == [
                (topics.CLUSTER_CAPACITY, 0),
                (topics.CLUSTER_CAPACITY, 1),
                (topics.NODE_UNHEALTHY, 0),
            ]


async def test_the_migration_fills_in_existing_rows(
    fresh_database_url: str, tmp_path: Path
) -> None:
    before = tmp_path / "before"
    before.mkdir()
    for script in sorted(MIGRATIONS.glob("*.sql")):
        if script.name < "009":
            (before / script.name).write_text(script.read_text())
    pool = await create_pool(fresh_database_url)
    try:
        await migrate(pool, SCHEMA, before)
        for job_id, types in (("a", ["H100"]), ("b", ["L4", "A100"]), ("c", [])):
            body = spec(job_id, "vision").model_dump(mode="json")
            body["resources"]["accelerator_types"] = types
            await pool.execute(
                "INSERT INTO gateway.jobs (job_id, tenant, state, spec, submitted_at, updated_at)"
                " VALUES ($1, 'vision', 'queued', $2, now(), now())",
                job_id,
                JobSpec.model_validate(body).model_dump_json(),
            )
        await pool.execute(
            "INSERT INTO gateway.job_events (event_id, job_id, at, type, message) VALUES"
            " ('e1', 'a', now(), 'JobCheckpointRequested', 'asked to checkpoint to make room"
            " for job j-9 (preempted_for_priority); stopped after its 30 s grace period')"
        )
        assert "009_fleet.sql" in await migrate(pool, SCHEMA, MIGRATIONS)
        rows = await pool.fetch("SELECT job_id, accelerator_type FROM gateway.jobs ORDER BY 1")
        assert [tuple(r) for r in rows] == [("a", "H100"), ("b", "A100|L4"), ("c", "any")]
        assert await pool.fetchval("SELECT for_job FROM gateway.job_events") == "j-9"
    finally:
        await pool.close()
