"""The executor on the real broker and PostgreSQL: it honours what fits, refuses what would
over-commit (saying why), fences old leader epochs, stops on order, and remembers its
allocations across a restart; it checkpoints and preempts runs on order, reports job failures
as retryable run failures, and reports gang progress with stragglers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
from aiokafka import AIOKafkaProducer

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    JobCheckpointRequested,
    JobPreemptOrdered,
    PlacementDecided,
    ReplicaAssignment,
)
from schemas.job import JobSpec
from services.executor.app import create_app
from services.executor.settings import ExecutorSettings
from services.executor.store import schema_for
from tests.integration.conftest import running
from tests.integration.faults import CommitInDoubt
from tests.integration.kafka_tools import START_S, STOP_S, bounded, collect, every_record, produce

CLUSTER = "onprem-h100"
NODE = "onprem-h100-h100-0031"
OUT = (topics.JOB_STARTED, topics.PLACEMENT_REFUSED, topics.JOB_FINISHED)


def placement(
    job_id: str, gpus: float, epoch: int, node: str = NODE, duration_s: int = 100000
) -> tuple[str, bytes]:
    spec = JobSpec(tenant="vision", job_id=job_id, labels={"sim_duration_s": str(duration_s)})
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

    outcome: dict[str, list[tuple[str, str | None]]] = {}
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


def with_spec(
    record: tuple[str, bytes], cluster: str | None = None, **changes: Any
) -> tuple[str, bytes]:
    """The placement record with its spec's fields changed, valid or not (and its cluster)."""
    key, value = record
    env = json.loads(value)
    env["payload"]["spec"].update(changes)
    if cluster is not None:
        env["payload"]["cluster"] = cluster
    return key, json.dumps(env).encode()


async def test_a_placement_whose_spec_is_not_valid_is_refused_and_dead_lettered(
    service_env: dict[str, Any],
) -> None:
    """Only a producer other than the scheduler writes one; the services that read placements
    without their spec (the schedulers, the queue, the gateway) take it as placed, so the
    executor says it will not run it, besides dead-lettering it: the job is then placed
    again. A stale one is refused as stale; one for another cluster is not this executor's.
    (A node no other test here uses, and the shared epoch: see EPOCH.)"""
    run = uuid.uuid4().hex[:8]
    bad, stale, other, good = (f"{run}-{n}" for n in ("bad", "stale", "other", "good"))
    settings = ExecutorSettings(**service_env, executor_cluster=CLUSTER, time_scale=1.0)
    bootstrap = service_env["kafka_bootstrap"]

    def mine(_t: str, env: dict[str, Any]) -> bool:
        return run in json.dumps(env["payload"])

    async with running(create_app(settings)):
        await produce(
            bootstrap,
            topics.PLACEMENT_DECIDED,
            [
                with_spec(placement(bad, 1, EPOCH, node(12)), kind="no-such-kind"),
                with_spec(placement(other, 1, EPOCH, node(12)), "elsewhere", kind="no-such-kind"),
                placement(good, 1, EPOCH, node(12)),
                with_spec(placement(stale, 1, EPOCH - 1, node(12)), queue="Not A Name!"),
            ],
        )
        # bad: refused and dead-lettered; stale: the same; other: dead-lettered; good: started
        found = await collect(bootstrap, (*OUT, topics.DEAD_LETTER), mine, count=6)
    by_job: dict[str, list[tuple[str, str | None]]] = {}
    for topic, env in found:
        p = env["payload"]
        job = next(j for j in (bad, stale, other, good) if j in json.dumps(p))
        by_job.setdefault(job, []).append((topic, p.get("reason_code") or p.get("reason")))
    assert sorted(by_job[bad]) == [
        (topics.DEAD_LETTER, "unreadable"),
        (topics.PLACEMENT_REFUSED, "invalid_spec"),
    ], by_job
    assert sorted(by_job[stale]) == [
        (topics.DEAD_LETTER, "unreadable"),
        (topics.PLACEMENT_REFUSED, "stale_epoch"),
    ], by_job
    assert by_job[other] == [(topics.DEAD_LETTER, "unreadable")], by_job
    assert by_job[good] == [(topics.JOB_STARTED, None)], by_job
    refusal = next(
        env["payload"]
        for topic, env in found
        if topic == topics.PLACEMENT_REFUSED and env["payload"]["job_id"] == bad
    )
    assert "spec" in refusal["message"] and "kind" in refusal["message"], refusal


async def test_tombstones_expire_from_memory_and_table(service_env: dict[str, Any]) -> None:
    """A stop order for a job not running here is kept for the retention, then forgotten in
    memory and in the table: every cancel adds one in every executor, so without pruning
    they would grow for as long as the platform runs."""
    run = uuid.uuid4().hex[:8]
    old, new = f"{run}-old", f"{run}-new"
    settings = ExecutorSettings(**service_env, executor_cluster=CLUSTER, time_scale=1.0)
    app = create_app(settings)
    async with running(app):
        bootstrap = service_env["kafka_bootstrap"]
        await produce(bootstrap, topics.JOB_STOP_ORDERED, [stop(old), stop(new)])
        await tombstoned(service_env["database_url"], old)
        await tombstoned(service_env["database_url"], new)
        executor = app.state.executor["executor"]
        conn = await asyncpg.connect(service_env["database_url"])
        try:
            # Age one of them by an hour and a minute, as if written then.
            await conn.execute(
                f"UPDATE {schema_for(CLUSTER)}.tombstones "
                "SET at = now() - interval '61 minutes' WHERE job_id = $1",
                old,
            )
            executor.tombstones[old] -= 3660
            assert await executor.prune_tombstones(3600) == 1
            left = {
                r["job_id"]
                for r in await conn.fetch(
                    f"SELECT job_id FROM {schema_for(CLUSTER)}.tombstones "
                    "WHERE job_id = ANY($1::text[])",
                    [old, new],
                )
            }
        finally:
            await conn.close()
        assert old not in executor.tombstones and new in executor.tombstones
        assert left == {new}


async def fence_every_partition(bootstrap: str, topic: str, epoch: int) -> None:
    """What a new scheduler leader writes before it decides (schemas.events.LeaderFence)."""
    env = Envelope(type="LeaderFence", payload={"epoch": epoch, "leader": "new"})
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await bounded(producer.start(), START_S, "a test producer's start")
    try:
        partitions = await producer.partitions_for(topic)
        sent = [
            await producer.send(topic, env.model_dump_json().encode(), partition=p)
            for p in sorted(partitions)
        ]
        await asyncio.gather(*sent)
    finally:
        await bounded(producer.stop(), STOP_S, "a test producer's stop")


async def test_a_leader_fence_refuses_the_deposed_leaders_later_placements(
    service_env: dict[str, Any],
) -> None:
    """A deposed leader still publishing after its successor fenced the topic: its placements
    are refused although the executor has seen no placement of the new epoch. Its own cluster
    (a fresh fence); every executor and the preemptor read the fence, so it stays below the
    epochs the other tests use (EPOCH below, the preemptor's 100)."""
    cluster, node = "cloud-a100", "cloud-a100-a100-0003"
    base = EPOCH - 3
    run = uuid.uuid4().hex[:8]
    settings = ExecutorSettings(**service_env, executor_cluster=cluster, time_scale=1.0)
    bootstrap = service_env["kafka_bootstrap"]

    def at(job: str, epoch: int) -> tuple[str, bytes]:
        _, value = placement(f"{run}-{job}", 1, epoch=epoch, node=node)
        env = json.loads(value)
        env["payload"]["cluster"] = cluster
        env["payload"]["accelerator_type"] = "A100"
        return "fenced", json.dumps(env).encode()

    def mine(_t: str, env: dict[str, Any]) -> bool:
        return run in json.dumps(env["payload"])

    async with running(create_app(settings)):
        await produce(bootstrap, topics.PLACEMENT_DECIDED, [at("before", base)])
        await collect(bootstrap, OUT, mine, count=1)
        await fence_every_partition(bootstrap, topics.PLACEMENT_DECIDED, base + 2)
        await produce(
            bootstrap, topics.PLACEMENT_DECIDED, [at("late", base + 1), at("new", base + 2)]
        )
        found = await collect(bootstrap, OUT, mine, count=3)
    outcome = {
        env["payload"]["job_id"].removeprefix(f"{run}-"): (topic, env["payload"].get("reason_code"))
        for topic, env in found
    }
    assert outcome == {
        "before": (topics.JOB_STARTED, None),
        "late": (topics.PLACEMENT_REFUSED, "stale_epoch"),
        "new": (topics.JOB_STARTED, None),
    }, outcome


# Preemption, checkpoints, run failures and progress run at the e2e tests' time scale: one
# wall second is ten fleet minutes.
SCALE = 600.0
EPOCH = 7  # the fence is shared by every test on this database: never move it backwards
FOREVER = "100000000"


def gang(
    job_id: str,
    nodes: list[str],
    *,
    attempt: int = 1,
    gpus: float = 8,
    memory_gb: float = 64,
    labels: dict[str, str] | None = None,
) -> tuple[str, bytes]:
    spec = JobSpec(
        tenant="vision",
        job_id=job_id,
        replicas=len(nodes),
        labels={"sim_duration_s": FOREVER, **(labels or {})},
    )
    p = PlacementDecided(
        job_id=job_id,
        attempt=attempt,
        epoch=EPOCH,
        leader="test",
        cluster=CLUSTER,
        accelerator_type="H100",
        spec=spec,
        replicas=[
            ReplicaAssignment(
                replica=i, node_id=node, accelerators=gpus, cpu=4, memory_gb=memory_gb
            )
            for i, node in enumerate(nodes)
        ],
    )
    env = Envelope(type="PlacementDecided", payload=p.model_dump(mode="json"))
    return job_id, env.model_dump_json().encode()


def command(payload: JobCheckpointRequested | JobPreemptOrdered) -> tuple[str, bytes]:
    env = Envelope(type=type(payload).__name__, payload=payload.model_dump(mode="json"))
    return payload.job_id, env.model_dump_json().encode()


def checkpoint_order(job_id: str, attempt: int = 1) -> tuple[str, bytes]:
    return command(
        JobCheckpointRequested(
            job_id=job_id,
            attempt=attempt,
            cluster=CLUSTER,
            grace_s=30,
            stop_at=datetime.now(UTC) + timedelta(seconds=30 / SCALE),
            for_job="urgent",
            reason_code="preempted_for_priority",
        )
    )


def preempt_order(job_id: str, attempt: int = 1, for_job: str = "urgent") -> tuple[str, bytes]:
    return command(
        JobPreemptOrdered(
            job_id=job_id,
            attempt=attempt,
            cluster=CLUSTER,
            for_job=for_job,
            reason_code="preempted_for_priority",
            message=f"made room for {for_job}",
        )
    )


def node(i: int) -> str:
    return f"{CLUSTER}-h100-{i:04d}"


def of(found: list[tuple[str, dict[str, Any]]], job_id: str, topic: str) -> list[dict[str, Any]]:
    return [env["payload"] for t, env in found if t == topic and env["payload"]["job_id"] == job_id]


async def checkpoint_row(database_url: str, job_id: str) -> asyncpg.Record:
    """The run's row once its checkpoint signal is recorded."""
    conn = await asyncpg.connect(database_url)
    try:
        for _ in range(200):
            row = await conn.fetchrow(
                f"SELECT started_at, checkpoint_at, checkpoint_done_at "
                f"FROM {schema_for(CLUSTER)}.allocations WHERE job_id = $1",
                job_id,
            )
            if row is not None and row["checkpoint_done_at"] is not None:
                return row
            await asyncio.sleep(0.05)
        raise AssertionError("the checkpoint signal was never recorded")
    finally:
        await conn.close()


LIFECYCLE = (
    topics.JOB_STARTED,
    topics.PLACEMENT_REFUSED,
    topics.JOB_FINISHED,
    topics.JOB_PREEMPTED,
    topics.JOB_RUN_FAILED,
)


def settings_for(service_env: dict[str, Any], **extra: Any) -> ExecutorSettings:
    return ExecutorSettings(**service_env, executor_cluster=CLUSTER, time_scale=SCALE, **extra)


async def test_a_checkpointed_run_is_preempted_with_its_work_kept_even_across_a_restart(
    service_env: dict[str, Any],
) -> None:
    run = uuid.uuid4().hex[:8]
    victim, after = f"{run}-victim", f"{run}-after"
    bootstrap = service_env["kafka_bootstrap"]
    settings = settings_for(service_env)

    def mine(_t: str, env: dict[str, Any]) -> bool:
        return run in env["payload"].get("job_id", "")

    async with running(create_app(settings)):
        await produce(bootstrap, topics.PLACEMENT_DECIDED, [gang(victim, [node(20)])])
        await collect(bootstrap, LIFECYCLE, mine, count=1)
        await asyncio.sleep(0.5)  # ~300 fleet seconds of work before the signal
        await produce(bootstrap, topics.JOB_CHECKPOINT_REQUESTED, [checkpoint_order(victim)])
        row = await checkpoint_row(service_env["database_url"], victim)
    # The checkpoint is in the store: a restarted executor still knows the work it saved.
    async with running(create_app(settings)):
        await produce(bootstrap, topics.JOB_PREEMPT_ORDERED, [preempt_order(victim)])
        found = await collect(bootstrap, LIFECYCLE, mine, count=2)
        # Its 8 GPUs are free again: the same devices take a new gang.
        await produce(bootstrap, topics.PLACEMENT_DECIDED, [gang(after, [node(20)])])
        found = await collect(bootstrap, LIFECYCLE, mine, count=3)
        await produce(bootstrap, topics.JOB_PREEMPT_ORDERED, [preempt_order(after)])
        await collect(bootstrap, LIFECYCLE, mine, count=4)

    (event,) = of(found, victim, topics.JOB_PREEMPTED)
    saved = (row["checkpoint_at"] - row["started_at"]).total_seconds() * SCALE
    assert event["reason_code"] == "preempted_for_priority"
    assert event["for_job"] == "urgent" and event["attempt"] == 1
    assert event["work_kept_s"] > 0
    assert abs(event["work_kept_s"] - saved) < 0.01, (event, saved)
    assert abs(event["work_lost_s"] - (event["ran_s"] - event["work_kept_s"])) < 0.01
    assert of(found, after, topics.JOB_STARTED), found
    assert not of(found, after, topics.PLACEMENT_REFUSED)


async def test_without_a_signal_only_periodic_checkpoints_keep_work(
    service_env: dict[str, Any],
) -> None:
    run = uuid.uuid4().hex[:8]
    periodic, bare = f"{run}-periodic", f"{run}-bare"
    bootstrap = service_env["kafka_bootstrap"]
    every = {"sim_checkpoint_every_s": "120", "sim_checkpoint_s": "10"}

    def mine(_t: str, env: dict[str, Any]) -> bool:
        return run in env["payload"].get("job_id", "")

    async with running(create_app(settings_for(service_env))):
        await produce(
            bootstrap,
            topics.PLACEMENT_DECIDED,
            [gang(periodic, [node(21)], labels=every), gang(bare, [node(22)])],
        )
        await collect(bootstrap, LIFECYCLE, mine, count=2)
        await asyncio.sleep(1.0)  # ~600 fleet seconds: four or five periodic checkpoints
        await produce(
            bootstrap, topics.JOB_PREEMPT_ORDERED, [preempt_order(periodic), preempt_order(bare)]
        )
        found = await collect(bootstrap, LIFECYCLE, mine, count=4)

    (kept,) = of(found, periodic, topics.JOB_PREEMPTED)
    assert kept["work_kept_s"] >= 480 and kept["work_kept_s"] % 120 == 0, kept
    # What is lost is at most one interval plus the checkpoint being written.
    assert 0 <= kept["work_lost_s"] < 130
    (lost,) = of(found, bare, topics.JOB_PREEMPTED)
    assert lost["work_kept_s"] == 0 and lost["work_lost_s"] == lost["ran_s"] > 0


async def test_orders_for_another_attempt_do_nothing(service_env: dict[str, Any]) -> None:
    run = uuid.uuid4().hex[:8]
    job = f"{run}-job"
    bootstrap = service_env["kafka_bootstrap"]

    def mine(_t: str, env: dict[str, Any]) -> bool:
        return bool(env["payload"].get("job_id") == job)

    async with running(create_app(settings_for(service_env))):
        await produce(bootstrap, topics.PLACEMENT_DECIDED, [gang(job, [node(23)], attempt=2)])
        await collect(bootstrap, LIFECYCLE, mine, count=1)
        await produce(bootstrap, topics.JOB_CHECKPOINT_REQUESTED, [checkpoint_order(job, 1)])
        # Same key, same partition: the stale order is read before the valid one.
        await produce(
            bootstrap,
            topics.JOB_PREEMPT_ORDERED,
            [preempt_order(job, 1, for_job="stale"), preempt_order(job, 2, for_job="valid")],
        )
        await collect(bootstrap, LIFECYCLE, mine, count=2)
        # Another order for the attempt that is gone now: nothing more either.
        await produce(bootstrap, topics.JOB_PREEMPT_ORDERED, [preempt_order(job, 2, "late")])
        found = await collect(bootstrap, LIFECYCLE, mine, count=3, timeout_s=3)

    (event,) = of(found, job, topics.JOB_PREEMPTED)
    assert event["attempt"] == 2 and event["for_job"] == "valid", found
    assert event["work_kept_s"] == 0  # the stale checkpoint signal saved nothing


async def test_job_failures_are_run_failures_and_retried_attempts_can_succeed(
    service_env: dict[str, Any],
) -> None:
    run = uuid.uuid4().hex[:8]
    broken, flaky, hungry = (f"{run}-{n}" for n in ("broken", "flaky", "hungry"))
    bootstrap = service_env["kafka_bootstrap"]
    short = {"sim_duration_s": "600"}  # one wall second

    def mine(_t: str, env: dict[str, Any]) -> bool:
        return run in env["payload"].get("job_id", "")

    async with running(create_app(settings_for(service_env))):
        await produce(
            bootstrap,
            topics.PLACEMENT_DECIDED,
            [
                gang(broken, [node(24)], labels={**short, "sim_outcome": "failed"}),
                gang(flaky, [node(25)], labels={**short, "sim_fail_attempts": "1"}),
                gang(
                    hungry,
                    [node(26), node(27)],
                    memory_gb=64,
                    labels={"sim_duration_s": "6000", "sim_memory_gb": "96"},
                ),
            ],
        )
        await collect(bootstrap, LIFECYCLE, mine, count=6)  # 3 started, 3 failed
        # The queue would retry the flaky job: its second attempt succeeds.
        await produce(
            bootstrap, topics.PLACEMENT_DECIDED, [gang(flaky, [node(25)], attempt=2, labels=short)]
        )
        found = await collect(bootstrap, LIFECYCLE, mine, count=8)

    (failed,) = of(found, broken, topics.JOB_RUN_FAILED)
    assert failed["reason_code"] == "application_error" and failed["exit_code"] == 1
    assert abs(failed["ran_s"] - 600) < 1
    assert not of(found, broken, topics.JOB_FINISHED)

    (first,) = of(found, flaky, topics.JOB_RUN_FAILED)
    assert first["attempt"] == 1 and first["reason_code"] == "application_error"
    (done,) = of(found, flaky, topics.JOB_FINISHED)
    assert done["attempt"] == 2 and done["outcome"] == "succeeded"

    (oom,) = of(found, hungry, topics.JOB_RUN_FAILED)
    assert oom["reason_code"] == "out_of_memory" and oom["exit_code"] == 137
    assert "96 GB" in oom["message"] and "64 GB" in oom["message"], oom
    assert abs(oom["ran_s"] - 600) < 1  # a tenth of its 6000 s


async def test_progress_shows_the_replica_on_a_slowed_node(service_env: dict[str, Any]) -> None:
    run = uuid.uuid4().hex[:8]
    job, solo = f"{run}-gang", f"{run}-solo"
    bootstrap = service_env["kafka_bootstrap"]
    app = create_app(settings_for(service_env, progress_interval_s=0.2))

    def mine(_t: str, env: dict[str, Any]) -> bool:
        return run in env["payload"].get("job_id", "")

    async with running(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://executor") as client:
            r = await client.post("/faults/slow", json={"node_id": node(29), "factor": 3})
            assert r.status_code == 202, r.text
            assert (await client.get("/faults")).json()["slow"] == {node(29): 3}
            missing = await client.post("/faults/slow", json={"node_id": "nope", "factor": 2})
            assert missing.status_code == 404
        await produce(
            bootstrap,
            topics.PLACEMENT_DECIDED,
            [
                gang(job, [node(28), node(29)], labels={"sim_step_s": "2"}),
                gang(solo, [node(30)]),
            ],
        )
        found = await collect(bootstrap, (topics.JOB_PROGRESS,), mine, count=4)
        await produce(
            bootstrap, topics.JOB_PREEMPT_ORDERED, [preempt_order(job), preempt_order(solo)]
        )
        await collect(bootstrap, (topics.JOB_PREEMPTED,), mine, count=2)

    assert {env["payload"]["job_id"] for _, env in found} == {job}  # one replica: no report
    for _, env in found:
        steps = {r["node_id"]: r["step_time_s"] for r in env["payload"]["replicas"]}
        assert 1.9 < steps[node(28)] < 2.1, steps
        assert 2.8 < steps[node(29)] / steps[node(28)] < 3.2, steps


async def test_a_run_end_whose_commit_is_in_doubt_is_announced_once(
    service_env: dict[str, Any],
) -> None:
    """A run ends by its clock; the database answers the commit with a dropped connection
    although the commit went through. The executor reads its store back before ending anything
    again, so the run's end goes out once (it used to end the run a second time, with a second
    job.finished, on the next tick)."""
    run = uuid.uuid4().hex[:8]
    job_id = f"{run}-doubt"
    settings = ExecutorSettings(**service_env, executor_cluster=CLUSTER, time_scale=1.0)
    app = create_app(settings)
    bootstrap = service_env["kafka_bootstrap"]
    async with running(app):
        executor = app.state.executor["executor"]
        record = placement(job_id, 1, EPOCH, duration_s=6)
        await produce(bootstrap, topics.PLACEMENT_DECIDED, [record])
        started = await collect(
            bootstrap, (topics.JOB_STARTED,), lambda _t, e: e["payload"]["job_id"] == job_id, 1
        )
        assert started, "the run did not start"
        doubt = CommitInDoubt(executor.relay)
        executor.relay = doubt  # from here on: the next transaction is the run's end
        async with asyncio.timeout(60):
            await doubt.dropped.wait()  # the run ended by its clock; its commit "failed"
        # Whatever the clock loop does next, one more tick past the run's end:
        with contextlib.suppress(Exception):
            await executor.finish_due(datetime.now(UTC).timestamp() + 60)
        await doubt.publish_committed()
        await doubt.flush(min_age_s=0)
        ends = [
            e
            for e in await every_record(bootstrap, topics.JOB_FINISHED)
            if e["payload"].get("job_id") == job_id
        ]
    assert len(ends) == 1, ends
