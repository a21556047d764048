"""Scheduler leader failover on the running stack: a standby takes over when the leader is
killed, with a higher epoch, and jobs keep being placed."""

from __future__ import annotations

import asyncio

import httpx

from bench.failover import fail_over, restart_killed
from cli.stack import Stack


async def test_standby_leads_after_the_leader_is_killed(qm_stack: Stack) -> None:
    # The stack runs two schedulers: a leader and a standby following the log.
    schedulers = [s for s in qm_stack.services if s.module == "services.scheduler"]
    assert len(schedulers) == 2
    took, leader = fail_over(qm_stack, schedulers)
    print(f"failover took {took:.2f} s")
    assert leader is not None and leader.running()
    # Not a timing test: a generous bound only catches a failover that never happens.
    assert took < 30
    restart_killed(qm_stack, schedulers)

    vision = {"Authorization": "Bearer dev-vision"}
    async with httpx.AsyncClient(base_url=qm_stack.gateway_url, timeout=30) as client:
        job_id = (
            await client.post("/v1/jobs", json={"labels": {"sim_duration_s": "60"}}, headers=vision)
        ).json()["job_id"]
        for _ in range(150):
            status = (await client.get(f"/v1/jobs/{job_id}", headers=vision)).json()
            if status["state"] == "succeeded":
                break
            await asyncio.sleep(0.2)
    assert status["state"] == "succeeded", status
