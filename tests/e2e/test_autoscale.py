"""Autoscaling on the whole stack as processes, on a fleet of its own: one fixed A100 node on
premises and two elastic A100 pools in the cloud, the cheaper one always out of stock.

A gang that no fixed node can hold makes the autoscaler ask the cheap pool for two nodes; they
never come (a stockout, one alert), so it asks the dearer pool; the gang runs on its nodes and,
once it ends and the cool-down passes, the nodes go. A job that waits for its quota grows
nothing. The autoscaler is killed right after its first decision and started again: no node is
asked for twice."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cli.stack import PROJECT_ROOT, Service, Stack
from schemas import topics
from schemas.envelope import Envelope
from schemas.usage import BudgetExceeded, BudgetUnit, Enforcement
from tests.conftest import own_stack
from tests.integration.kafka_tools import collect, produce

ADMIN = {"Authorization": "Bearer dev-admin"}
VISION = {"Authorization": "Bearer dev-vision"}
NLP = {"Authorization": "Bearer dev-nlp"}  # its budget is spent in the second test
TIME_SCALE = 60.0  # provisioning 120 fleet s = 2 s; cool-down 300 fleet s = 5 s


def _fleet(workdir: Path) -> Path:
    fleet = {
        "clusters": [
            {
                "name": "onprem",
                "location": "dc1",
                "kind": "on_prem",
                "prices": {"A100": {"reserved": 1.0}},
                "node_groups": [
                    {
                        "prefix": "a100",
                        "count": 1,
                        "accelerator_type": "A100",
                        "accelerators_per_node": 8,
                        "cpu": 96,
                        "memory_gb": 1152,
                        "price_tier": "reserved",
                    }
                ],
            },
            {
                "name": "cloud",
                "location": "us-west-2",
                "kind": "cloud",
                "prices": {"A100": {"on_demand": 2.9, "reserved": 2.0}},
                "node_pools": [
                    {
                        "name": "cheap",
                        "accelerator_type": "A100",
                        "price_tier": "reserved",
                        "max_nodes": 4,
                        "provision_s": 120,
                        "cooldown_s": 300,
                        "stockout_rate": 1.0,
                        "cpu": 96,
                        "memory_gb": 1152,
                    },
                    {
                        "name": "dear",
                        "accelerator_type": "A100",
                        "price_tier": "on_demand",
                        "max_nodes": 4,
                        "provision_s": 120,
                        "cooldown_s": 300,
                        "cpu": 96,
                        "memory_gb": 1152,
                    },
                ],
            },
        ]
    }
    path = workdir / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    return path


@pytest.fixture(scope="module")
def autoscale_stack(
    tmp_path_factory: pytest.TempPathFactory, postgres_server_url: str
) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("autoscale-stack")
    env = {
        "QM_CAPACITY_INTERVAL_S": "2",
        "QM_UNHEALTHY_AFTER_S": "10",
        "QM_DECIDE_EVERY_S": "0.5",
        "QM_FAILING_PAUSE_S": "600",
        # A cloud budget far above what the tests spend: counted and stored, never binding.
        "QM_CLOUD_BUDGET_PER_MONTH": "1000000000",
    }
    with own_stack(
        workdir,
        postgres_server_url,
        env,
        fleet_file=_fleet(workdir),
        policy_file=PROJECT_ROOT / "examples" / "policy.yaml",
        time_scale=TIME_SCALE,
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
async def client(autoscale_stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=autoscale_stack.gateway_url, timeout=30) as c:
        yield c


async def wait_state(
    client: httpx.AsyncClient, job_id: str, states: set[str], timeout_s: float = 90
) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        seen = (await client.get(f"/v1/jobs/{job_id}", headers=ADMIN)).json()
        if seen.get("state") in states:
            return seen
        await asyncio.sleep(0.2)
    raise AssertionError(f"{job_id} never reached {states}: {seen}")


async def submit(client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]) -> str:
    r = await client.post("/v1/jobs", json=body, headers=headers)
    assert r.status_code == 202, r.text
    return str(r.json()["job_id"])


def service(stack: Stack, name: str) -> Service:
    return next(s for s in stack.services if s.name == name)


async def pools_now(bootstrap: str) -> dict[str, Any]:
    """The cloud executor's latest view of its pools."""
    events = await collect(
        bootstrap,
        (topics.CLUSTER_CAPACITY,),
        lambda _t, e: e["payload"]["cluster"] == "cloud",
        count=10_000,
        timeout_s=3,
    )
    latest = events[-1][1]["payload"]
    return {p["pool"]: p for p in latest["pools"]}


async def test_a_waiting_gang_grows_a_pool_past_a_stockout_and_the_nodes_go_after(
    autoscale_stack: Stack, client: httpx.AsyncClient
) -> None:
    stack = autoscale_stack
    bootstrap = stack.server("kafka").url
    # A quota-bound job first: `platform` may hold 16 A100; this one asks for 24.
    quota_bound = await submit(
        client,
        {
            "replicas": 3,
            "resources": {"accelerators": 8, "accelerator_types": ["A100"]},
            "labels": {"sim_duration_s": "60"},
        },
        ADMIN,  # tenant `platform`
    )
    gang = await submit(
        client,
        {
            "replicas": 2,
            "resources": {"accelerators": 8, "accelerator_types": ["A100"]},
            "labels": {"sim_duration_s": "600"},  # 10 s at 60x
        },
        VISION,
    )
    # The first decision goes to the cheap pool; the autoscaler dies right after it and comes
    # back: the size it set stands and nothing is asked twice.
    (first,) = await collect(
        bootstrap,
        (topics.AUTOSCALE_DECIDED,),
        lambda _t, e: gang in e["payload"]["for_jobs"],
        count=1,
        timeout_s=60,
    )
    assert first[1]["payload"]["pool"] == "cheap" and first[1]["payload"]["desired_nodes"] == 2
    autoscaler = service(stack, "autoscaler")
    assert autoscaler.process is not None
    autoscaler.process.kill()
    autoscaler.process.wait(timeout=30)
    stack.restart(autoscaler)

    running = await wait_state(client, gang, {"running", "succeeded", "failed"}, timeout_s=120)
    assert running["cluster"] == "cloud", running
    assert all(n.startswith("cloud-dear-") for n in running["nodes"]), running
    done = await wait_state(client, gang, {"succeeded", "failed", "canceled"})
    assert done["state"] == "succeeded", done

    decisions = [
        e[1]["payload"]
        for e in await collect(
            bootstrap, (topics.AUTOSCALE_DECIDED,), lambda _t, _e: True, count=10_000, timeout_s=3
        )
    ]
    # The cheap pool stocked out: one alert, and the dear pool was asked for the gang.
    alerts = await collect(
        bootstrap,
        (topics.ALERT_RAISED,),
        lambda _t, e: e["payload"]["subject"] == "cheap",
        count=10,
        timeout_s=3,
    )
    assert len(alerts) == 1 and "stockout" in alerts[0][1]["payload"]["cause"]
    dear = [d for d in decisions if d["pool"] == "dear"]
    assert dear and dear[0]["desired_nodes"] == 2 and gang in dear[0]["for_jobs"]
    # Nothing was ever decided for the quota-bound job.
    assert not any(quota_bound in d["for_jobs"] for d in decisions)
    why = (await client.get(f"/v1/jobs/{quota_bound}/explain", headers=ADMIN)).json()
    assert "quota_exhausted" in why["codes"], why

    # Once the gang is over, its nodes are empty; after the cool-down they go.
    for _ in range(120):
        pools = await pools_now(bootstrap)
        if not pools["dear"]["nodes"]:
            break
        await asyncio.sleep(0.5)
    assert pools["dear"]["nodes"] == [], pools["dear"]
    # No node of the dear pool was ever asked for beyond the two the gang needed.
    assert pools["dear"]["desired_nodes"] == 0
    later = [
        e[1]["payload"]
        for e in await collect(
            bootstrap,
            (topics.AUTOSCALE_DECIDED,),
            lambda _t, e: e["payload"]["pool"] == "dear",
            count=10_000,
            timeout_s=3,
        )
    ]
    removed = sorted({n for d in later for n in d["remove"]})
    assert removed == ["cloud-dear-0000", "cloud-dear-0001"], later
    assert max(d["desired_nodes"] for d in later) == 2, later

    # The pools' spend this month was counted (and stored: the restarted autoscaler went on
    # from the row its predecessor left).
    async with httpx.AsyncClient() as plain:
        metrics = (await plain.get(f"http://127.0.0.1:{autoscaler.port}/metrics")).text
    (spent,) = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("qm_autoscaler_cloud_spend_this_month ")
    ]
    assert spent > 0

    # What an operator sees: `qm pools` (the gateway's GET /v1/pools).
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from cli.main import app; app()",
        "pools",
        "--json",
        env={**os.environ, "QM_GATEWAY_URL": stack.gateway_url, "QM_TOKEN": "dev-ops"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    report = json.loads(out)
    by_name = {p["pool"]: p for p in report["pools"]}
    assert set(by_name) == {"cheap", "dear"}
    assert "stockout" in (by_name["cheap"]["failing"] or "")
    assert [d["desired_nodes"] for d in by_name["dear"]["decisions"]][:2] == [0, 2]


async def test_a_tenant_whose_budget_is_spent_grows_nothing(
    autoscale_stack: Stack, client: httpx.AsyncClient
) -> None:
    """nlp's budget is spent (deprioritize); its gang waits for capacity like vision's, but
    only vision's grows a pool. nlp's job is in the demand the decision was taken on (it came
    first and cannot have started before any node was bought), so the decision's job list
    shows the budget at work."""
    bootstrap = autoscale_stack.server("kafka").url
    now = datetime.now(UTC)
    spent = BudgetExceeded(
        budget_id="nlp-cloud",
        tenant="nlp",
        month=now.strftime("%Y-%m"),
        unit=BudgetUnit.CURRENCY,
        limit=1000,
        used=1000,
        threshold_pct=100,
        # Deprioritize, not block: a blocking budget makes the queue refuse nlp's new jobs
        # outright (budget_exhausted), so none would wait for capacity at all.
        enforcement=Enforcement.DEPRIORITIZE,
        weight_factor=0.5,
        crossed_at=now,
        message="nlp spent its monthly budget",
    )
    envelope = Envelope(type="BudgetExceeded", payload=spent.model_dump(mode="json"))
    await produce(bootstrap, topics.BUDGET_EXCEEDED, [("nlp", envelope.model_dump_json().encode())])
    shape = {
        "replicas": 2,
        "resources": {"accelerators": 8, "accelerator_types": ["A100"]},
        "labels": {"sim_duration_s": "60"},
    }
    blocked = await submit(client, shape, NLP)
    await collect(
        bootstrap,
        (topics.CAPACITY_DEMAND,),
        lambda _t, e: blocked in {j["job_id"] for j in e["payload"]["jobs"]},
        count=1,
        timeout_s=60,
    )
    served = await submit(client, shape, VISION)
    (decision,) = await collect(
        bootstrap,
        (topics.AUTOSCALE_DECIDED,),
        lambda _t, e: served in e["payload"]["for_jobs"],
        count=1,
        timeout_s=60,
    )
    assert blocked not in decision[1]["payload"]["for_jobs"], decision
    # The budget keeps nlp from buying capacity, not from using what exists: both finish
    # (nlp's on nodes bought for vision), and no decision ever named nlp's job.
    for job_id in (served, blocked):
        done = await wait_state(client, job_id, {"succeeded", "failed", "canceled"}, timeout_s=120)
        assert done["state"] == "succeeded", done
    decisions = await collect(
        bootstrap, (topics.AUTOSCALE_DECIDED,), lambda _t, _e: True, count=10_000, timeout_s=3
    )
    assert not any(blocked in e[1]["payload"]["for_jobs"] for e in decisions)
