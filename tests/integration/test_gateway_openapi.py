"""The gateway against its own OpenAPI document (schemathesis), served by uvicorn on real
PostgreSQL, Redis and Kafka: no generated request gets a 5xx, and every 4xx carries a reason.
Then the hostile bodies no generator thinks of: oversized, lying about its length, not
UTF-8, NaN in an unknown field, nested 100,000 deep."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings

from cli import infra
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings

schemathesis = pytest.importorskip("schemathesis")

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TOKENS = ("dev-vision", "dev-admin", "dev-ops")


@pytest.fixture(scope="module")
def gateway_url(topics_ready: str, postgres_server_url: str, redis_url: str) -> Iterator[str]:
    from tests.conftest import fresh_database

    with fresh_database(postgres_server_url) as database:
        port = infra.free_port()
        app = create_app(
            GatewaySettings(
                kafka_bootstrap=topics_ready,
                database_url=database,
                redis_url=redis_url,
                policy_file=ROOT / "examples" / "policy.yaml",
                auth_file=ROOT / "examples" / "auth.yaml",
                log_format="console",
                log_level="WARNING",
            )
        )
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
        )
        thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise AssertionError("the gateway did not come up")
        try:
            yield url
        finally:
            server.should_exit = True
            thread.join(timeout=15)


def reason_of(response: Any) -> str:
    try:
        body = response.json()
    except ValueError:
        return ""
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, list):
        return "; ".join(f"{d.get('loc')}: {d.get('msg')}" for d in detail if isinstance(d, dict))
    return json.dumps(detail) if isinstance(detail, dict) else str(detail or "")


def exercise(operation: Any, token: str, base_url: str, failures: list[str]) -> None:
    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    @given(case=operation.as_strategy())
    def check(case: Any) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}
        response = case.call(base_url=base_url, timeout=30)
        where = f"{operation.method.upper()} {operation.path} -> {response.status_code}"
        if response.status_code >= 500:
            failures.append(f"{where}: {response.text[:300]}")
        elif response.status_code >= 400 and not reason_of(response):
            failures.append(f"{where} without a reason: {response.text[:300]}")

    check()


def test_no_generated_request_gets_a_5xx_and_every_4xx_says_why(gateway_url: str) -> None:
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    failures: list[str] = []
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) >= 4
    for i, operation in enumerate(operations):
        exercise(operation, TOKENS[i % len(TOKENS)], gateway_url, failures)
    assert failures == [], "\n".join(failures[:20])


def test_oversized_and_unreadable_bodies_get_a_reason(gateway_url: str) -> None:
    headers = {"Authorization": "Bearer dev-vision", "Content-Type": "application/json"}
    url = f"{gateway_url}/v1/jobs"
    with httpx.Client(timeout=30) as client:
        big = client.post(url, content=b'{"name": "' + b"x" * (2 << 20) + b'"}', headers=headers)
        assert big.status_code == 413 and "limit" in reason_of(big)

        def chunks() -> Iterator[bytes]:  # no Content-Length at all
            yield b'{"name": "'
            for _ in range(64):
                yield b"y" * 8192
            yield b'"}'

        streamed = client.post(url, content=chunks(), headers=headers)
        assert streamed.status_code == 413
        for body, words in (
            (b'{"name": "a", "extra": NaN}', "NaN"),
            (b'{"name": "a", "resources": {"cpu": Infinity}}', "Infinity"),
            (b"\xff\xfe{}", "UTF-8"),
            (b"[" * 100_000 + b"]" * 100_000, "nested"),
            (b'{"name": "a\\u0000b"}', "NUL"),
        ):
            r = client.post(url, content=body, headers=headers)
            assert r.status_code == 422, (body[:40], r.status_code, r.text[:200])
            assert words in reason_of(r), (body[:40], r.text[:200])
        bad_field = client.post(url, json={"tenant": "x'; DROP TABLE jobs;--"}, headers=headers)
        assert bad_field.status_code in (403, 422)
        bad_cpu = client.post(url, json={"resources": {"cpu": 1e300}}, headers=headers)
        assert bad_cpu.status_code == 422 and "resources" in reason_of(bad_cpu)
