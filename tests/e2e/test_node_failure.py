"""A node fails under a running 4-node gang: the health service quarantines it on the injected XID,
the executor stops the whole gang and hands it back, and the queue requeues it; it runs again
elsewhere, avoiding the failed node, and finishes."""

from __future__ import annotations

import asyncio

import httpx

from cli.stack import Stack


async def test_a_4_node_gang_on_a_failed_node_is_requeued_whole_elsewhere(
    qm_stack: Stack,
) -> None:
    vision = {"Authorization": "Bearer dev-vision"}
    async with httpx.AsyncClient(base_url=qm_stack.gateway_url, timeout=30) as client:
        gang = {
            "replicas": 4,
            "resources": {"accelerators": 8, "accelerator_types": ["H100"]},
            "labels": {"sim_duration_s": "3600"},
        }
        job_id = (await client.post("/v1/jobs", json=gang, headers=vision)).json()["job_id"]
        status = await wait_state(client, job_id, {"running"})
        assert len(status["nodes"]) == 4, status
        victim = status["nodes"][0]
        executor = next(
            s
            for s in qm_stack.services
            if s.extra_env.get("QM_EXECUTOR_CLUSTER") == status["cluster"]
        )
        r = await client.post(
            f"http://127.0.0.1:{executor.port}/faults/node", json={"node_id": victim, "xid": 79}
        )
        assert r.status_code == 202, r.text
        status = await wait_state(client, job_id, {"failed", "succeeded", "canceled"})
    assert status["state"] == "succeeded", status
    assert victim not in status["nodes"] and len(status["nodes"]) == 4, status
    kinds = [(h["type"], h["reason_code"]) for h in status["history"]]
    # The gang is handed back once, as a whole, not replica by replica.
    assert kinds.count(("JobPreempted", "node_failure")) == 1, kinds
    assert [k for k, _ in kinds].count("PlacementDecided") == 2, kinds
    assert ("JobQueued", "requeued") in kinds, kinds


async def wait_state(client: httpx.AsyncClient, job_id: str, states: set[str]) -> dict:  # type: ignore[type-arg]
    status: dict = {}  # type: ignore[type-arg]
    for _ in range(600):
        status = (
            await client.get(f"/v1/jobs/{job_id}", headers={"Authorization": "Bearer dev-admin"})
        ).json()
        if status["state"] in states:
            return status
        await asyncio.sleep(0.1)
    raise AssertionError(f"job {job_id} never reached {states}: {status}")
