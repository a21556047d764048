"""The executor on the real broker and PostgreSQL: it honours what fits, refuses what would
over-commit (saying why), fences old leader epochs, stops on order, and remembers its
allocations across a restart."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import asyncpg

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import PlacementDecided, ReplicaAssignment
from schemas.job import JobSpec
from services.executor.app import create_app
from services.executor.settings import ExecutorSettings
from services.executor.store import schema_for
from tests.integration.conftest import running
from tests.integration.kafka_tools import collect, produce

CLUSTER = "onprem-h100"
NODE = "onprem-h100-h100-0031"
OUT = (topics.JOB_STARTED, topics.PLACEMENT_REFUSED, topics.JOB_FINISHED)


def placement(job_id: str, gpus: float, epoch: int, node: str = NODE) -> tuple[str, bytes]:
    spec = JobSpec(tenant="vision", job_id=job_id, labels={"sim_duration_s": "100000"})
    p = PlacementDecided(
        job_id=job_id,
        attempt=1,
        epoch=epoch,
        leader="test",
        cluster=CLUSTER,
        accelerator_type="H100",
        spec=spec,
        replicas=[
            ReplicaAssignment(replica=0, node_id=node, accelerators=gpus, cpu=1, memory_gb=1)
        ],
    )
    env = Envelope(type="PlacementDecided", payload=p.model_dump(mode="json"))
    # One key for all: the test needs them read in this order, which only a partition keeps.
    return "node-31", env.model_dump_json().encode()


def stop(job_id: str) -> tuple[str, bytes]:
    env = Envelope(type="JobStopOrdered", payload={"job_id": job_id, "reason": "canceled"})
    return "node-31", env.model_dump_json().encode()


async def tombstoned(database_url: str, job_id: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        for _ in range(200):
            if await conn.fetchval(
                f"SELECT 1 FROM {schema_for(CLUSTER)}.tombstones WHERE job_id = $1", job_id
            ):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the stop order was never recorded")
    finally:
        await conn.close()


async def test_placements_refusals_fencing_and_restart(service_env: dict[str, Any]) -> None:
    run = uuid.uuid4().hex[:8]
    j = {n: f"{run}-{n}" for n in ("a", "b", "big", "old", "early")}
    settings = ExecutorSettings(**service_env, executor_cluster=CLUSTER, time_scale=1.0)
    bootstrap = service_env["kafka_bootstrap"]

    def mine(_t: str, env: dict[str, Any]) -> bool:
        return run in json.dumps(env["payload"])

    async with running(create_app(settings)):
        await produce(bootstrap, topics.JOB_STOP_ORDERED, [stop(j["early"])])
        # Topics are not ordered with each other: let the stop land before its placement.
        await tombstoned(service_env["database_url"], j["early"])
        await produce(
            bootstrap,
            topics.PLACEMENT_DECIDED,
            [
                placement(j["a"], 6, epoch=7),
                placement(j["b"], 4, epoch=7),
                placement(j["old"], 1, epoch=6),
                placement(j["early"], 1, epoch=7),
            ],
        )
        first = await collect(bootstrap, OUT, mine, count=4)
    # A restarted executor still knows node 31 holds 6 of its 8 GPUs.
    async with running(create_app(settings)):
        await produce(bootstrap, topics.PLACEMENT_DECIDED, [placement(j["big"], 3, epoch=7)])
        await collect(bootstrap, OUT, mine, count=5)  # the refusal of big, before a stops
        await produce(bootstrap, topics.JOB_STOP_ORDERED, [stop(j["a"])])
        second = await collect(bootstrap, OUT, mine, count=6)

    outcome = {}
    for topic, env in second:  # each collect reads the topics from the start
        p = env["payload"]
        outcome.setdefault(p["job_id"], []).append(
            (topic, p.get("reason_code") or p.get("outcome"))
        )
    assert outcome[j["a"]][0] == (topics.JOB_STARTED, None)
    assert (topics.JOB_FINISHED, "canceled") in outcome[j["a"]], outcome
    assert outcome[j["b"]] == [(topics.PLACEMENT_REFUSED, "would_overcommit")]
    assert outcome[j["old"]] == [(topics.PLACEMENT_REFUSED, "stale_epoch")]
    assert outcome[j["early"]] == [(topics.PLACEMENT_REFUSED, "canceled")], outcome
    assert outcome[j["big"]] == [(topics.PLACEMENT_REFUSED, "would_overcommit")]
    refusal = next(env["payload"] for topic, env in first if env["payload"]["job_id"] == j["b"])
    assert "2 whole H100 free of 8" in refusal["message"]
