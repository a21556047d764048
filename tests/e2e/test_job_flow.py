"""The whole platform as processes: 100 jobs over REST and 100 as raw JSON on Kafka all finish
with the right history, no node ever holds more than it has, and bad input is refused with its
own reason while nothing else is disturbed."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections import defaultdict
from typing import Any

import httpx
import pytest

from bench.chaos import RUN_EDGES, overcommitted_nodes
from cli.stack import Stack
from schemas import topics
from tests.integration.kafka_tools import collect, produce

TERMINAL = {"succeeded", "failed", "canceled", "rejected"}
ADMIN = {"Authorization": "Bearer dev-admin"}
TENANT_TOKENS = {"vision": "dev-vision", "nlp": "dev-nlp", "speech": "dev-speech"}


def job_body(rng: random.Random, tenant: str, index: int) -> dict[str, Any]:
    shape = rng.random()
    if shape < 0.6:
        replicas, gpus, types = 1, rng.choice([1, 2, 4]), ["H100", "A100"]
    elif shape < 0.8:
        replicas, gpus, types = 1, 0.5, ["L4"]
    elif shape < 0.9:
        replicas, gpus, types = rng.choice([2, 4]), 8, ["H100"]
    else:
        replicas, gpus, types = 2, 4, ["TPU-v5e"]
    body: dict[str, Any] = {
        "tenant": tenant,
        "name": f"e2e-{index}",
        "replicas": replicas,
        "resources": {"accelerators": gpus, "accelerator_types": types},
        "labels": {"sim_duration_s": str(rng.randint(60, 900))},
    }
    if index % 17 == 0:
        body["labels"]["sim_outcome"] = "failed"
    return body


async def wait_terminal(
    client: httpx.AsyncClient, job_ids: list[str], timeout_s: float = 150
) -> dict[str, dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(done) < len(job_ids) and asyncio.get_running_loop().time() < deadline:
        for job_id in job_ids:
            if job_id in done:
                continue
            r = await client.get(f"/v1/jobs/{job_id}", headers=ADMIN)
            if r.status_code == 200 and r.json()["state"] in TERMINAL:
                done[job_id] = r.json()
        await asyncio.sleep(0.5)
    return done


@pytest.fixture(scope="module")
async def client(qm_stack: Stack) -> Any:
    async with httpx.AsyncClient(base_url=qm_stack.gateway_url, timeout=30) as c:
        yield c


async def test_two_hundred_jobs_finish_without_overcommit(
    qm_stack: Stack, client: httpx.AsyncClient
) -> None:
    rng = random.Random(7)
    bootstrap = qm_stack.server("kafka").url
    tenants = list(TENANT_TOKENS)
    rest_ids = []
    for i in range(100):
        tenant = tenants[i % len(tenants)]
        r = await client.post(
            "/v1/jobs",
            json=job_body(rng, tenant, i),
            headers={"Authorization": f"Bearer {TENANT_TOKENS[tenant]}"},
        )
        assert r.status_code == 202, r.text
        rest_ids.append(r.json()["job_id"])
    run = uuid.uuid4().hex[:6]
    raw_ids = [f"raw-{run}-{i}" for i in range(100)]
    await produce(
        bootstrap,
        topics.JOB_SUBMITTED,
        [
            (
                job_id,
                json.dumps({**job_body(rng, tenants[i % 3], 100 + i), "job_id": job_id}).encode(),
            )
            for i, job_id in enumerate(raw_ids)
        ],
    )

    done = await wait_terminal(client, rest_ids + raw_ids)
    assert len(done) == 200, f"{200 - len(done)} jobs did not finish"
    outcomes = defaultdict(int)
    for job_id, status in done.items():
        outcomes[status["state"]] += 1
        types = [h["type"] for h in status["history"]]
        expected = ["JobQueued", "PlacementDecided", "JobStarted", "JobFinished"]
        if job_id in rest_ids:
            expected = ["JobSubmitted", *expected]
        # refused placements may add lines; the essential steps appear in order
        it = iter(types)
        assert all(step in it for step in expected), (job_id, types)
        assert status["cluster"] and status["nodes"]
    assert outcomes["succeeded"] >= 180 and outcomes["failed"] >= 1, outcomes

    await assert_no_overcommit(bootstrap, set(rest_ids + raw_ids))


async def assert_no_overcommit(bootstrap: str, job_ids: set[str]) -> None:
    """Rebuild every node's use over time from the executors' own events."""
    events = await collect(
        bootstrap,
        (topics.PLACEMENT_DECIDED, *RUN_EDGES),
        lambda _t, env: env["payload"].get("job_id") in job_ids,
        count=10**9,
        timeout_s=8,
    )
    assert any(t == topics.JOB_STARTED for t, _ in events), "no lifecycle events were seen"
    assert overcommitted_nodes(events) == 0, "a node held more accelerators than it has"


@pytest.mark.parametrize(
    ("body", "token", "status", "reason"),
    [
        ({"replicas": "four"}, "dev-vision", 422, None),
        ({"tenant": "ghosts"}, "dev-admin", 422, "unknown_tenant"),
        ({"queue": "express"}, "dev-vision", 422, "unknown_queue"),
        (
            {"resources": {"accelerator_types": ["B200"]}},
            "dev-vision",
            422,
            "unknown_accelerator_type",
        ),
        ({"resources": {"accelerators": 0}}, "dev-vision", 422, "invalid_resources"),
        ({"replicas": -1}, "dev-vision", 422, "invalid_resources"),
        ({"replicas": 65}, "dev-vision", 422, "gang_too_large"),
        ({"tenant": "nlp"}, "dev-vision", 403, None),
        ({}, None, 401, None),
        ({}, "not-a-token", 401, None),
    ],
)
async def test_bad_rest_input_gets_its_reason(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    token: str | None,
    status: int,
    reason: str | None,
) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = await client.post("/v1/jobs", json=body, headers=headers)
    assert r.status_code == status, r.text
    if reason is not None:
        assert r.json()["detail"]["reason_code"] == reason
        assert r.json()["detail"]["message"]


async def test_malformed_json_body_is_a_422(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/jobs",
        content=b"{nope",
        headers={"Authorization": "Bearer dev-vision", "content-type": "application/json"},
    )
    assert r.status_code == 422 and "json" in r.text.lower()


async def test_raw_kafka_rejections_are_visible_to_the_owner(
    qm_stack: Stack, client: httpx.AsyncClient
) -> None:
    run = uuid.uuid4().hex[:6]
    bad = {
        f"q-{run}": {"tenant": "vision", "queue": "express"},
        f"t-{run}": {"tenant": "vision", "replicas": "many"},
    }
    await produce(
        qm_stack.server("kafka").url,
        topics.JOB_SUBMITTED,
        [(k, json.dumps({**v, "job_id": k}).encode()) for k, v in bad.items()]
        + [(None, b"{garbage")],
    )
    done = await wait_terminal(client, list(bad), timeout_s=30)
    assert done[f"q-{run}"]["reason_code"] == "unknown_queue"
    assert done[f"t-{run}"]["reason_code"] == "invalid_spec"
    dead = await collect(
        qm_stack.server("kafka").url,
        (topics.DEAD_LETTER,),
        lambda _t, env: "garbage" in env["payload"]["value"],
        count=1,
        timeout_s=15,
    )
    assert dead and "not valid JSON" in dead[0][1]["payload"]["error"]


async def test_tenants_cannot_see_or_cancel_each_other(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/jobs",
        json={"labels": {"sim_duration_s": "60"}},
        headers={"Authorization": "Bearer dev-vision"},
    )
    job_id = r.json()["job_id"]
    nlp = {"Authorization": "Bearer dev-nlp"}
    assert (await client.get(f"/v1/jobs/{job_id}", headers=nlp)).status_code == 404
    assert (await client.delete(f"/v1/jobs/{job_id}", headers=nlp)).status_code == 404
    listed = (await client.get("/v1/jobs", headers=nlp)).json()["jobs"]
    assert all(j["tenant"] == "nlp" for j in listed)
    assert (await client.get(f"/v1/jobs/{job_id}", headers=ADMIN)).status_code == 200
    # The ops role reads every tenant's jobs but may not change them: exactly 403, with the
    # reason, whatever state the job is in (the role is checked before the state).
    ops = {"Authorization": "Bearer dev-ops"}
    refused = await client.delete(f"/v1/jobs/{job_id}", headers=ops)
    assert refused.status_code == 403, refused.text
    assert "cannot cancel" in refused.json()["detail"]


async def test_cancel_works_while_queued_and_while_running(client: httpx.AsyncClient) -> None:
    vision = {"Authorization": "Bearer dev-vision"}
    # 64 x 8 H100 can never fit this fleet: it stays queued until cancelled.
    stuck = (
        await client.post(
            "/v1/jobs",
            json={"replicas": 64, "resources": {"accelerators": 8, "accelerator_types": ["H100"]}},
            headers=vision,
        )
    ).json()["job_id"]
    long = (
        await client.post(
            "/v1/jobs",
            json={"resources": {"accelerators": 1}, "labels": {"sim_duration_s": "10000000"}},
            headers=vision,
        )
    ).json()["job_id"]
    for _ in range(100):
        state = (await client.get(f"/v1/jobs/{long}", headers=vision)).json()["state"]
        if state == "running":
            break
        await asyncio.sleep(0.2)
    assert state == "running"
    why = {}
    for _ in range(50):
        why = (await client.get(f"/v1/jobs/{stuck}/explain", headers=vision)).json()
        if why["codes"] != ["awaiting_cycle"]:
            break
        await asyncio.sleep(0.2)
    assert why["state"] == "queued" and why["codes"] != ["awaiting_cycle"], why
    assert "H100" in why["message"], why
    for job_id in (stuck, long):
        assert (await client.delete(f"/v1/jobs/{job_id}", headers=vision)).status_code == 202
    done = await wait_terminal(client, [stuck, long], timeout_s=30)
    assert {done[j]["state"] for j in (stuck, long)} == {"canceled"}
    assert (await client.delete(f"/v1/jobs/{long}", headers=vision)).status_code == 409


async def test_watch_streams_the_lifecycle_until_the_end(client: httpx.AsyncClient) -> None:
    vision = {"Authorization": "Bearer dev-vision"}
    job_id = (
        await client.post("/v1/jobs", json={"labels": {"sim_duration_s": "300"}}, headers=vision)
    ).json()["job_id"]
    states = []
    async with client.stream(
        "GET", f"/v1/jobs/{job_id}/events", params={"follow": "true"}, headers=vision
    ) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data: "):
                states.append(json.loads(line[6:])["state"])
    assert states[0] == "submitted" and states[-1] == "succeeded"
    assert "running" in states
