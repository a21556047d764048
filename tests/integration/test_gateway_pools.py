"""The gateway's pool views on the real broker and PostgreSQL: an executor's pools, the
autoscaler's decisions and the scheduler's demand become `GET /v1/pools`, and a waiting job
whose pool is growing says so in its explanation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    AutoscaleDecided,
    CapacityDemand,
    ClusterCapacity,
    DemandItem,
    PoolNode,
    PoolNodeState,
    PoolStatus,
)
from services.common.topics import ensure_topics
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from tests.conftest import private_kafka
from tests.integration.conftest import running
from tests.integration.kafka_tools import produce

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
VISION = {"Authorization": "Bearer dev-vision"}
NOW = datetime.now(UTC)


@pytest.fixture
async def own_kafka(tmp_path: Path) -> AsyncIterator[str]:
    """A broker of its own: a made-up cluster's inventory stays out of other tests' fleets."""
    with private_kafka(tmp_path / "kafka") as url:
        await ensure_topics(url)
        yield url


def envelope(event_type: str, payload: BaseModel) -> bytes:
    return (
        Envelope(type=event_type, payload=payload.model_dump(mode="json"))
        .model_dump_json()
        .encode()
    )


async def until(client: httpx.AsyncClient, path: str, ok: Any) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for _ in range(200):
        body = (await client.get(path, headers=VISION)).json()
        if ok(body):
            return body
        await asyncio.sleep(0.1)
    raise AssertionError(f"{path} never showed it: {body}")


async def test_pools_decisions_and_demand_are_shown(
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
    async with running(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            r = await client.post("/v1/jobs", json={"name": "big", "replicas": 2}, headers=VISION)
            job_id = r.json()["job_id"]
            status = PoolStatus(
                pool="burst",
                accelerator_type="A100",
                accelerators_per_node=8,
                price_tier="on_demand",
                min_nodes=0,
                max_nodes=4,
                desired_nodes=2,
                nodes=[
                    PoolNode(
                        node_id="cloud-burst-0000",
                        state=PoolNodeState.PROVISIONING,
                        requested_at=NOW,
                    ),
                    PoolNode(
                        node_id="cloud-burst-0001",
                        state=PoolNodeState.READY,
                        requested_at=NOW,
                        ready_at=NOW,
                        used=8,
                    ),
                ],
            )
            capacity = ClusterCapacity(
                cluster="cloud", location="x", kind="cloud", prices={}, nodes=[], pools=[status]
            )
            decided = AutoscaleDecided(
                cluster="cloud",
                pool="burst",
                desired_nodes=2,
                for_jobs=[job_id],
                reason="1 waiting job(s) need new node(s)",
            )
            demand = CapacityDemand(
                scheduler="s",
                epoch=1,
                pending_jobs=3,
                jobs=[
                    DemandItem(job_id=job_id, tenant="vision", replicas=2, accelerators=8),
                    DemandItem(job_id="other", tenant="nlp", replicas=2, accelerators=8),
                ],
            )
            await produce(
                own_kafka,
                topics.CLUSTER_CAPACITY,
                [("cloud", envelope("ClusterCapacity", capacity))],
            )
            await produce(
                own_kafka,
                topics.AUTOSCALE_DECIDED,
                [("cloud", envelope("AutoscaleDecided", decided)), (None, b"not json")],
            )
            await produce(
                own_kafka, topics.CAPACITY_DEMAND, [("s", envelope("CapacityDemand", demand))]
            )
            pools = await until(
                client,
                "/v1/pools",
                lambda b: b["pools"] and b["pools"][0]["decisions"] and b["waiting_jobs"],
            )
            (pool,) = pools["pools"]
            assert (pool["ready"], pool["provisioning"], pool["busy"]) == (1, 1, 1)
            assert pool["decisions"][0]["jobs"] == 1 and "waiting" in pool["decisions"][0]["reason"]
            # Shapes only: another tenant's job is counted, never named.
            assert pools["waiting_for_capacity"] == [
                {"replicas": 2, "accelerators": 8.0, "accelerator_types": [], "jobs": 2}
            ]
            assert "other" not in str(pools)
            why = await until(client, f"/v1/jobs/{job_id}/explain", lambda b: b.get("growing"))
            assert why["growing"]["pool"] == "burst"
            assert "growing to 2 node(s)" in why["growing"]["message"]
