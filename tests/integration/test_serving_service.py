"""The serving service on the real broker, PostgreSQL and Redis: a declared service's replicas
are submitted as jobs; while its store refuses writes nothing more goes out, and once the
store is back the books are read again, so every replica submitted is one the books hold
(none lost, none twice); hostile records are dead-lettered and what follows is served."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import asyncpg

from schemas import topics
from schemas.envelope import Envelope
from services.serving.app import create_app
from services.serving.settings import ServingSettings
from tests.integration.conftest import running
from tests.integration.kafka_tools import every_record, produce


def settings(env: dict[str, Any]) -> ServingSettings:
    return ServingSettings(**{**env, "time_scale": 1.0, "decide_every_s": 0.2})


def declared(name: str, **over: Any) -> tuple[str, bytes]:
    spec = {
        "name": name,
        "tenant": "vision",
        "model": "m",
        "version": "v1",
        "resources": {"accelerators": 1},
        "min_replicas": 2,
        "max_replicas": 2,
        **over,
    }
    env = Envelope(type="ServiceDeclared", producer="test", tenant="vision", payload={"spec": spec})
    return name, env.model_dump_json().encode()


def command(name: str, **payload: Any) -> tuple[str, bytes]:
    body = {"service": name, "tenant": "vision", **payload}
    env = Envelope(type="ServiceCommand", producer="test", tenant="vision", payload=body)
    return name, env.model_dump_json().encode()


async def submitted(bootstrap: str, name: str) -> list[str]:
    return [
        e["payload"]["job_id"]
        for e in await every_record(bootstrap, topics.JOB_SUBMITTED, skip_unreadable=True)
        if isinstance(e.get("payload"), dict)
        and str(e["payload"].get("job_id", "")).startswith(f"svc-{name}-")
    ]


async def eventually(check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError("never happened")
        await asyncio.sleep(0.2)


async def test_a_store_that_refuses_writes_loses_no_replica_and_sends_none_twice(
    service_env: dict[str, Any], database_url: str
) -> None:
    bootstrap = service_env["kafka_bootstrap"]
    name = f"it-{uuid.uuid4().hex[:8]}"
    async with running(create_app(settings(service_env))):
        await produce(bootstrap, topics.SERVICE_DECLARED, [declared(name)])
        await eventually(lambda: _count(bootstrap, name, 2))
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute("ALTER TABLE serving.replicas RENAME TO replicas_away")
            await produce(
                bootstrap,
                topics.SERVICE_COMMAND,
                [command(name, action="scale", min_replicas=4, max_replicas=4)],
            )
            await asyncio.sleep(2.0)  # rounds try, and fail to write
            assert len(await submitted(bootstrap, name)) == 2
        finally:
            await conn.execute("ALTER TABLE serving.replicas_away RENAME TO replicas")
        jobs = await eventually(lambda: _count(bootstrap, name, 4))
        stored = {
            r["job_id"]
            for r in await conn.fetch(
                "SELECT job_id FROM serving.replicas WHERE service = $1", name
            )
        }
        await conn.close()
    assert len(jobs) == len(set(jobs)) == 4, jobs
    assert set(jobs) == stored


async def test_hostile_records_are_dead_lettered_and_what_follows_is_served(
    service_env: dict[str, Any],
) -> None:
    bootstrap = service_env["kafka_bootstrap"]
    name = f"it-{uuid.uuid4().hex[:8]}"
    nan = b'{"type":"ReplicaReported","producer":"x","payload":{"service":"a","replica":"b",'
    nan += b'"rps":NaN}}'
    poison = [
        (name, b"\xff\xfe not json"),
        (name, nan),
        declared(name, min_replicas=5, max_replicas=2),  # min above max
        declared(name, resources={"accelerators": -1}),
    ]
    async with running(create_app(settings(service_env))):
        await produce(bootstrap, topics.SERVICE_DECLARED, poison[:1] + poison[2:])
        await produce(bootstrap, topics.SERVICE_LOAD, poison[1:2])
        await produce(bootstrap, topics.SERVICE_DECLARED, [declared(name)])
        await eventually(lambda: _count(bootstrap, name, 2))

        async def letters() -> list[dict[str, Any]]:
            # Every poison record was keyed by the service's name.
            found = [
                e["payload"]
                for e in await every_record(bootstrap, topics.DEAD_LETTER, skip_unreadable=True)
                if isinstance(e.get("payload"), dict)
                and e["payload"].get("consumer") == "serving"
                and e["payload"].get("key") == name
            ]
            return found if len(found) >= 4 else []

        dead = await eventually(letters)
    errors = [d["error"] for d in dead]
    assert len(dead) == 4, errors
    assert any("min_replicas" in e for e in errors), errors
    assert any("accelerators" in e for e in errors), errors
    assert any("NaN" in e or "number" in e for e in errors), errors


async def _count(bootstrap: str, name: str, n: int) -> list[str]:
    jobs = await submitted(bootstrap, name)
    return jobs if len(jobs) >= n else []
