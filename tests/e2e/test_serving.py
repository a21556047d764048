"""Inference services on the whole stack as processes: a service declared through the gateway
gets its replicas as jobs through the queue and scheduler; it scales up under load and back
down after it; a replica on a failed node is placed again by itself; a new version rolls out
without ever dropping below the ready count; a version whose replicas fail rolls back by
itself.

The load comes from the test, as a router in front of the replicas would report it: each
ready replica's share of the offered requests per second, and its latency.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from cli.stack import Stack
from schemas import topics
from schemas.serving import ReplicaReported
from services.common.kafka import envelope_for
from tests.integration.kafka_tools import every_record, produce

VISION = {"Authorization": "Bearer dev-vision"}


def service(name: str, version: str, **over: Any) -> dict[str, Any]:
    return {
        "name": name,
        "model": "llama-3-8b",
        "version": version,
        "resources": {"accelerators": 0.5, "cpu": 2, "memory_gb": 8},
        "min_replicas": 1,
        "max_replicas": 4,
        "target_rps": 10,
        "latency_slo_ms": 500,
        "scale_down_after_s": 2400,  # fleet seconds: 4 s at the e2e stack's 600x
        "rollout": {"ready_timeout_s": 60000},
        **over,
    }


async def declare(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
    r = await client.post("/v1/services", json=body, headers=VISION)
    assert r.status_code == 202, r.text


async def wait_for(
    client: httpx.AsyncClient, name: str, done: Any, timeout_s: float = 90.0
) -> dict[str, Any]:
    view: dict[str, Any] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        r = await client.get(f"/v1/services/{name}", headers=VISION)
        if r.status_code == 200:
            view = r.json()
            if done(view["status"], view["history"]):
                return view
        await asyncio.sleep(0.2)
    raise AssertionError(f"service {name} never got there: {view}")


@contextlib.asynccontextmanager
async def router(
    client: httpx.AsyncClient, bootstrap: str, name: str, offered: list[float]
) -> AsyncIterator[None]:
    """Reports `offered[0]` requests/s spread over the ready replicas, every 0.3 s."""

    async def loop() -> None:
        while True:
            r = await client.get(f"/v1/services/{name}/endpoints", headers=VISION)
            endpoints = r.json()["endpoints"] if r.status_code == 200 else []
            share = offered[0] / max(len(endpoints), 1)
            reports = [
                ReplicaReported(service=name, replica=e["replica"], rps=share, latency_ms=40.0)
                for e in endpoints
            ]
            await produce(
                bootstrap,
                topics.SERVICE_LOAD,
                [
                    (
                        name,
                        envelope_for("ReplicaReported", p, producer="router")
                        .model_dump_json()
                        .encode(),
                    )
                    for p in reports
                ],
            )
            await asyncio.sleep(0.3)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def ready(count: int, version: str | None = None) -> Any:
    def check(status: dict[str, Any], _history: list[dict[str, Any]]) -> bool:
        serving = [
            r
            for r in status["replicas"]
            if r["state"] == "ready" and (version is None or r["version"] == version)
        ]
        return (
            status["phase"] == "steady"
            and status["desired_replicas"] == count
            and len(serving) == count
            and len(status["endpoints"]) == count
        )

    return check


async def test_a_service_scales_up_under_load_and_down_after_it(qm_stack: Stack) -> None:
    bootstrap = qm_stack.server("kafka").url
    async with httpx.AsyncClient(base_url=qm_stack.gateway_url, timeout=30) as client:
        await declare(client, service("e2e-scale", "v1"))
        await wait_for(client, "e2e-scale", ready(1))
        offered = [35.0]  # 35 requests/s at 10 per replica: 4 replicas
        async with router(client, bootstrap, "e2e-scale", offered):
            view = await wait_for(client, "e2e-scale", ready(4))
            assert any(h["change"] == "scaled" for h in view["history"]), view["history"]
            extra = [r for r in view["status"]["replicas"] if not r["guaranteed"]]
            assert len(extra) == 3, view  # above the minimum: preemptible
            offered[0] = 3.0  # the load falls: after the quiet window, one replica again
            view = await wait_for(client, "e2e-scale", ready(1))
        reasons = [h["reason"] for h in view["history"] if h["change"] == "scaled"]
        assert any("need 4 replica" in r for r in reasons), reasons
        assert any("peaked" in r for r in reasons), reasons
        # The replicas were jobs like any other: the scaled-down ones were canceled.
        states: list[str] = []
        for _ in range(300):
            jobs = (await client.get("/v1/jobs", headers=VISION, params={"limit": 200})).json()
            states = sorted(
                j["state"] for j in jobs["jobs"] if j["job_id"].startswith("svc-e2e-scale-")
            )
            if states == ["canceled"] * 3 + ["running"]:
                break
            await asyncio.sleep(0.1)
        assert states == ["canceled"] * 3 + ["running"], states


async def test_a_replica_on_a_failed_node_is_placed_again_by_itself(qm_stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=qm_stack.gateway_url, timeout=30) as client:
        await declare(client, service("e2e-heal", "v1", min_replicas=2, max_replicas=2))
        view = await wait_for(client, "e2e-heal", ready(2))
        victim = view["status"]["replicas"][0]
        executor = next(
            s
            for s in qm_stack.services
            if s.extra_env.get("QM_EXECUTOR_CLUSTER") == victim["cluster"]
        )
        r = await client.post(
            f"http://127.0.0.1:{executor.port}/faults/node",
            json={"node_id": victim["node"], "xid": 79},
        )
        assert r.status_code == 202, r.text

        def healed(status: dict[str, Any], history: list[dict[str, Any]]) -> bool:
            mine = [x for x in status["replicas"] if x["replica"] == victim["replica"]]
            return (
                ready(2)(status, history)
                and bool(mine)
                and mine[0]["node"] != victim["node"]
                and mine[0]["state"] == "ready"
            )

        await wait_for(client, "e2e-heal", healed)
        job = (await client.get(f"/v1/jobs/{victim['replica']}", headers=VISION)).json()
        kinds = [(h["type"], h["reason_code"]) for h in job["history"]]
        assert ("JobPreempted", "node_failure") in kinds, kinds
        assert victim["node"] not in job["nodes"], job


async def test_a_rolling_update_completes_and_a_failing_version_rolls_back(
    qm_stack: Stack,
) -> None:
    bootstrap = qm_stack.server("kafka").url
    fixed = {"min_replicas": 3, "max_replicas": 3}
    async with httpx.AsyncClient(base_url=qm_stack.gateway_url, timeout=30) as client:
        await declare(client, service("e2e-roll", "v1", **fixed))
        await wait_for(client, "e2e-roll", ready(3, "v1"))
        await declare(client, service("e2e-roll", "v2", **fixed))
        view = await wait_for(client, "e2e-roll", ready(3, "v2"))
        changes = [h["change"] for h in view["history"]]
        assert "rollout_started" in changes and "rollout_done" in changes, changes
        # Every status published during the update: never fewer than 3 ready (no replica may
        # be unavailable), never more than 4 running (a surge of one).
        statuses = [
            e["payload"]
            for e in await every_record(bootstrap, topics.SERVICE_STATUS)
            if e["payload"]["service"] == "e2e-roll"
        ]
        during = [s for s in statuses if s["phase"] == "rolling"]
        assert during, statuses
        assert min(s["ready_replicas"] for s in during) >= 3, during
        assert max(len([r for r in s["replicas"] if r["state"] != "failed"]) for s in during) <= 4

        # A version whose replicas crash a second after they start.
        bad = {"sim_outcome": "failed", "sim_duration_s": "600"}
        await declare(client, service("e2e-roll", "v3", labels=bad, **fixed))

        def rolled_back(status: dict[str, Any], history: list[dict[str, Any]]) -> bool:
            return ready(3, "v2")(status, history) and any(
                h["change"] == "rolled_back" for h in history
            )

        view = await wait_for(client, "e2e-roll", rolled_back)
        back = [h for h in view["history"] if h["change"] == "rollback_started"]
        assert back and "of v3 failed" in back[0]["reason"], view["history"]
        assert view["status"]["version"] == "v2", view
