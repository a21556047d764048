"""Preemption end to end, on the stack as processes: a critical gang arrives on a full H100
cluster; the scheduler names victims, the preemptor asks them to checkpoint, waits out their
(capped) grace period and orders the stop; the executor hands them back with the work they
kept; the queue requeues them with a backoff, and they finish after the gang."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

import httpx

from cli.stack import Stack
from schemas import topics
from tests.e2e.test_node_failure import wait_state
from tests.integration.kafka_tools import collect

H100_NODES = 32  # examples/fleet.yaml: onprem-h100
GRACE_CAP_S = 300  # examples/policy.yaml: preemption.grace_cap_s


async def test_a_critical_gang_preempts_gracefully_and_the_victims_finish_later(
    qm_stack: Stack,
) -> None:
    nlp = {"Authorization": "Bearer dev-nlp"}
    vision = {"Authorization": "Bearer dev-vision"}
    bootstrap = qm_stack.server("kafka").url
    filler = {
        "priority_class": "low",
        "resources": {"accelerators": 8, "accelerator_types": ["H100"]},
        "topology": {"level": "node", "required": True},
        # 6000 fleet s = 10 s of wall time at 600x; a checkpoint every 600 fleet s.
        "labels": {"sim_duration_s": "6000", "sim_checkpoint_every_s": "600"},
        "checkpoint_grace_s": 900,  # more than the policy allows: capped to 300
    }
    async with httpx.AsyncClient(base_url=qm_stack.gateway_url, timeout=30) as client:
        fillers = []
        for i in range(H100_NODES):
            body = {**filler, "name": f"filler-{i}"}
            r = await client.post("/v1/jobs", json=body, headers=nlp)
            assert r.status_code == 202, r.text
            fillers.append(r.json()["job_id"])
        try:
            await wait_until_full(client, fillers)
            # Past the 600 fleet-second minimum runtime (1 s of wall time at 600x).
            await asyncio.sleep(1.5)
            gang = {
                "priority_class": "critical",
                "replicas": 2,
                "resources": {"accelerators": 8, "accelerator_types": ["H100"]},
                "labels": {"sim_duration_s": "600"},
            }
            r = await client.post("/v1/jobs", json=gang, headers=vision)
            assert r.status_code == 202, r.text
            critical = r.json()["job_id"]
            done = await wait_state(client, critical, {"succeeded", "failed", "canceled"})
            assert done["state"] == "succeeded", done

            events = await collect(
                bootstrap,
                (
                    topics.PREEMPTION_REQUESTED,
                    topics.JOB_CHECKPOINT_REQUESTED,
                    topics.JOB_PREEMPT_ORDERED,
                    topics.JOB_PREEMPTED,
                ),
                lambda _t, e: e["payload"].get("for_job") == critical,
                count=8,
                timeout_s=20,
            )
            by_topic: dict[str, list[dict[str, Any]]] = {}
            for topic, env in events:
                by_topic.setdefault(topic, []).append(env)
            history = [(h["type"], h["message"]) for h in done["history"]]
            assert topics.JOB_PREEMPTED in by_topic, (sorted(by_topic), history)
            victims = {e["payload"]["job_id"] for e in by_topic[topics.JOB_PREEMPTED]}
            assert len(victims) == 2 and victims <= set(fillers), by_topic
            for victim in victims:
                (signal,) = [
                    e
                    for e in by_topic[topics.JOB_CHECKPOINT_REQUESTED]
                    if e["payload"]["job_id"] == victim
                ]
                (order,) = [
                    e
                    for e in by_topic[topics.JOB_PREEMPT_ORDERED]
                    if e["payload"]["job_id"] == victim
                ]
                (ended,) = [
                    e for e in by_topic[topics.JOB_PREEMPTED] if e["payload"]["job_id"] == victim
                ]
                assert signal["payload"]["grace_s"] == GRACE_CAP_S
                waited = _at(order) - _at(signal)
                # The stop came no sooner than the grace period (300 fleet s = 0.5 s wall).
                assert waited >= 0.45, (victim, waited)
                kept = ended["payload"]
                assert kept["reason_code"] == "preempted_for_priority", kept
                assert kept["work_kept_s"] > 0 and kept["work_lost_s"] >= 0, kept

            # The victims went back to the queue keeping their submit time, and finish later.
            for victim in victims:
                status = await wait_state(client, victim, {"succeeded", "failed", "canceled"})
                assert status["state"] == "succeeded", status
                kinds = [(h["type"], h["reason_code"]) for h in status["history"]]
                assert ("JobPreempted", "preempted_for_priority") in kinds, kinds
                assert [k for k, _ in kinds].count("JobStarted") == 2, kinds
                assert status["submitted_at"] < done["updated_at"], status
        finally:
            for job_id in fillers:  # leave the cluster free for the tests that follow
                await client.delete(f"/v1/jobs/{job_id}", headers=nlp)


async def wait_until_full(client: httpx.AsyncClient, fillers: list[str]) -> None:
    """Until every filler runs, or those that don't wait for want of capacity: the cluster is
    full. (An earlier test may have left a node quarantined, so not all 32 may fit.)"""
    admin = {"Authorization": "Bearer dev-admin"}
    states: dict[str, str] = {}
    for _ in range(300):
        states = {}
        for job_id in fillers:
            state = (await client.get(f"/v1/jobs/{job_id}", headers=admin)).json()["state"]
            if state == "queued":
                why = (await client.get(f"/v1/jobs/{job_id}/explain", headers=admin)).json()
                state = "full" if "insufficient_capacity" in why["codes"] else state
            states[job_id] = state
        if all(s in ("running", "full") for s in states.values()):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the H100 cluster never filled up: {states}")


def _at(env: dict[str, Any]) -> float:
    return datetime.fromisoformat(env["occurred_at"]).timestamp()
