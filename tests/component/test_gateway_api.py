"""The gateway's REST handlers on the in-memory and the real broker: a submission becomes a
`job.submitted` envelope keyed by its id, and the caller's tenant scopes everything."""

from __future__ import annotations

from pathlib import Path

import httpx

from schemas import topics
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from tests.component.conftest import Harness

ROOT = Path(__file__).resolve().parents[2]


async def test_submit_publishes_and_scopes_by_tenant(
    harness: Harness, fresh_database_url: str, redis_url: str
) -> None:
    app = create_app(
        GatewaySettings(
            kafka_bootstrap=harness.bootstrap or "127.0.0.1:1",
            database_url=fresh_database_url,
            redis_url=redis_url,
            policy_file=ROOT / "examples" / "policy.yaml",
            auth_file=ROOT / "examples" / "auth.yaml",
            log_format="console",
        )
    )
    harness.capture(app.state.broker, topics.JOB_SUBMITTED)
    vision = {"Authorization": "Bearer dev-vision"}
    async with harness.running(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            r = await client.post(
                "/v1/jobs",
                json={"name": "c1", "replicas": 2, "idempotency_key": "k1"},
                headers=vision,
            )
            assert r.status_code == 202, r.text
            job_id = r.json()["job_id"]
            again = await client.post(
                "/v1/jobs", json={"name": "c1", "idempotency_key": "k1"}, headers=vision
            )
            assert again.status_code == 200 and again.json() == {
                "job_id": job_id,
                "state": "submitted",
                "duplicate": True,
            }
            got = await harness.wait_for(
                (topics.JOB_SUBMITTED,),
                lambda _t, env: env.get("payload", {}).get("job_id") == job_id,
                count=1,
            )
            status = await client.get(f"/v1/jobs/{job_id}", headers=vision)
            other = await client.get(
                f"/v1/jobs/{job_id}", headers={"Authorization": "Bearer dev-nlp"}
            )
            anonymous = await client.get(f"/v1/jobs/{job_id}")
            openapi = await client.get("/openapi.json")
    envelope = got[0][1]
    assert envelope["type"] == "JobSubmitted" and envelope["tenant"] == "vision"
    assert envelope["payload"]["replicas"] == 2 and envelope["producer"] == "gateway"
    assert status.json()["state"] == "submitted"
    assert status.json()["history"][0]["type"] == "JobSubmitted"
    assert other.status_code == 404 and anonymous.status_code == 401
    assert "/v1/jobs" in openapi.json()["paths"]
