"""A whole cluster goes dark: the health service declares its nodes lost, the executor hands
the gangs back, and they are requeued onto another cluster that fits; when the cluster comes
back, its nodes recover."""

from __future__ import annotations

import httpx

from cli.stack import Stack
from tests.e2e.test_node_failure import wait_state


async def test_jobs_of_a_dark_cluster_finish_elsewhere(qm_stack: Stack) -> None:
    vision = {"Authorization": "Bearer dev-vision"}
    async with httpx.AsyncClient(base_url=qm_stack.gateway_url, timeout=30) as client:
        body = {"resources": {"accelerators": 1}, "labels": {"sim_duration_s": "7200"}}
        job_id = (await client.post("/v1/jobs", json=body, headers=vision)).json()["job_id"]
        first = await wait_state(client, job_id, {"running"})
        dark = first["cluster"]
        executor = next(
            s for s in qm_stack.services if s.extra_env.get("QM_EXECUTOR_CLUSTER") == dark
        )
        url = f"http://127.0.0.1:{executor.port}/faults/cluster"
        assert (await client.post(url, json={"state": "down"})).status_code == 202
        try:
            done = await wait_state(client, job_id, {"succeeded", "failed", "canceled"})
        finally:
            assert (await client.post(url, json={"state": "up"})).status_code == 202
    assert done["state"] == "succeeded", done
    assert done["cluster"] != dark, done
    kinds = [(h["type"], h["reason_code"]) for h in done["history"]]
    assert ("JobPreempted", "node_failure") in kinds, kinds
