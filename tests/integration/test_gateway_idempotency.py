"""Retries with the same idempotency key, at the same moment, through the gateway: one job,
every caller told its id, no 5xx (the unique index decides, not a select before an insert)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from tests.integration.conftest import running

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


async def test_concurrent_retries_create_one_job(
    topics_ready: str, fresh_database_url: str, redis_url: str
) -> None:
    app = create_app(
        GatewaySettings(
            kafka_bootstrap=topics_ready,
            database_url=fresh_database_url,
            redis_url=redis_url,
            policy_file=ROOT / "examples" / "policy.yaml",
            auth_file=ROOT / "examples" / "auth.yaml",
            log_format="console",
        )
    )
    key = f"retry-{uuid.uuid4().hex[:8]}"
    body: dict[str, Any] = {"name": "same", "idempotency_key": key}
    headers = {"Authorization": "Bearer dev-vision"}
    async with running(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            answers = await asyncio.gather(
                *(client.post("/v1/jobs", json=body, headers=headers) for _ in range(12))
            )
            listed = await client.get("/v1/jobs", headers=headers)
    assert [a.status_code for a in answers if a.status_code >= 500] == []
    ids = {a.json()["job_id"] for a in answers}
    assert len(ids) == 1, [a.text for a in answers]
    assert sorted(a.status_code for a in answers)[-1] in (201, 202)  # the one that created it
    assert sum(1 for a in answers if a.json().get("duplicate")) == len(answers) - 1
    same = [j for j in listed.json()["jobs"] if j["name"] == "same"]
    assert [j["job_id"] for j in same] == list(ids)
