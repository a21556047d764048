"""A model rolled out to a robot fleet on the whole stack as processes: the dev fleet's robots
(site lab-b: 16 robots, 4 of them on flaky links) with their edge executor, the serving
service and the gateway.

The rollout reaches every robot in waves (canary first), while one robot is offline; that robot
gets the version when it returns. The edge executor is killed and started again mid-way and
converges from the log. A version whose model check fails on the canary rolls everything back
without any robot past the canary ever being told to run it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx

from cli.stack import Stack
from schemas import topics
from tests.integration.kafka_tools import every_record

VISION = {"Authorization": "Bearer dev-vision"}
AWAY = "lab-b-003"  # not one of the flaky robots
MODEL = "e2e-nav"


async def wait_until(
    client: httpx.AsyncClient,
    path: str,
    done: Callable[[dict[str, Any]], bool],
    timeout_s: float = 90.0,
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    body: dict[str, Any] = {}
    while loop.time() < deadline:
        r = await client.get(path, headers=VISION)
        if r.status_code == 200:
            body = r.json()
            if done(body):
                return body
        await asyncio.sleep(0.25)
    raise AssertionError(f"{path} never got there: {body}")


def running(robots: dict[str, Any], version: str) -> set[str]:
    return {r["robot"] for r in robots["robots"] if r["running"].get(MODEL) == version}


def deploy(version: str, **labels: str) -> dict[str, Any]:
    return {
        "name": "e2e-nav",
        "model": MODEL,
        "version": version,
        "to": "site=lab-b",
        "canary_share": 0.1,
        "wave_share": 0.5,
        "soak_s": 600,  # fleet seconds: 1 s at the e2e stack's 600x
        "labels": labels,
    }


async def test_a_robot_rollout_goes_in_waves_waits_for_the_offline_and_rolls_back_a_bad_canary(
    qm_stack: Stack,
) -> None:
    bootstrap = qm_stack.server("kafka").url
    edge = next(s for s in qm_stack.services if s.extra_env.get("QM_EDGE_FLEET") == "robots")
    async with httpx.AsyncClient(base_url=qm_stack.gateway_url, timeout=30) as client:
        robots = await wait_until(client, "/v1/robots?to=site=lab-b", lambda b: b["total"] == 16)
        fault = f"http://127.0.0.1:{edge.port}/faults/robot"
        r = await client.post(fault, json={"robot": AWAY, "link": "offline"})
        assert r.status_code == 202, r.text
        r = await client.post("/v1/deployments", json=deploy("v1"), headers=VISION)
        assert r.status_code == 202, r.text

        # Part-way through, the edge executor is killed and started again: it reads the
        # desired state from the log again.
        await wait_until(client, "/v1/deployments/e2e-nav", lambda b: b["status"]["wave"] >= 2)
        assert edge.process is not None
        old_pid = edge.pid
        edge.process.kill()
        edge.process.wait(timeout=30)
        await asyncio.to_thread(qm_stack.restart, edge)
        assert edge.pid != old_pid and edge.running()

        view = await wait_until(
            client, "/v1/deployments/e2e-nav", lambda b: b["status"]["phase"] == "done"
        )
        everyone = {r["robot"] for r in robots["robots"]}
        robots = await wait_until(
            client,
            "/v1/robots?to=site=lab-b",
            lambda b: running(b, "v1") == everyone - {AWAY},  # flaky ones too, once back
        )
        # In waves: the canary's two robots, then half the rest, then the others.
        statuses = [
            e["payload"]
            for e in await every_record(bootstrap, topics.DEPLOYMENT_STATUS)
            if e["payload"]["deployment"] == "e2e-nav"
        ]
        waves = [s["wave"] for s in statuses if s["version"] == "v1"]
        assert waves == sorted(waves) and set(waves) == {1, 2, 3}, waves
        assert view["status"]["waves"] == 3
        told = [
            e["payload"]["robot"]
            for e in await every_record(bootstrap, topics.ROBOT_DESIRED)
            if e["payload"]["deployment"] == "e2e-nav"
        ]
        assert told[:2] == ["lab-b-000", "lab-b-001"], told
        assert len(told) == len(set(told)) == 16  # each robot told once, the away one too

        # The robot that was away returns and catches up.
        r = await client.post(fault, json={"robot": AWAY, "link": "online"})
        assert r.status_code == 202, r.text
        await wait_until(client, "/v1/robots?to=site=lab-b", lambda b: running(b, "v1") == everyone)

        # A version whose model check fails: the canary fails the gate, everything goes back.
        r = await client.post(
            "/v1/deployments", json=deploy("v2", sim_health="failed"), headers=VISION
        )
        assert r.status_code == 202, r.text
        view = await wait_until(
            client, "/v1/deployments/e2e-nav", lambda b: b["status"]["phase"] == "rolled_back"
        )
        assert "unhealthy on v2" in view["status"]["reason"], view
        await wait_until(client, "/v1/robots?to=site=lab-b", lambda b: running(b, "v1") == everyone)
        told_v2 = {
            e["payload"]["robot"]
            for e in await every_record(bootstrap, topics.ROBOT_DESIRED)
            if e["payload"]["deployment"] == "e2e-nav" and e["payload"]["version"] == "v2"
        }
        assert told_v2 == {"lab-b-000", "lab-b-001"}, told_v2
