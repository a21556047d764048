"""The executor's runs on the real PostgreSQL: a batch's net change written in one statement per
kind of change, and read back (a restarted executor's state) as it was written."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from schemas.events import ReplicaAssignment
from services.common.db import create_pool, migrate
from services.executor.simulated import RunEnd
from services.executor.store import MIGRATIONS, Checkpoint, ExecutorStore, RunningJob, schema_for

pytestmark = pytest.mark.integration

T0 = datetime(2026, 11, 28, 12, tzinfo=UTC)


def run(job_id: str, attempt: int = 1, **over: object) -> RunningJob:
    replicas = [
        ReplicaAssignment(replica=i, node_id=f"n,{i}", accelerators=4, cpu=8, memory_gb=64)
        for i in range(2)
    ]
    base = RunningJob(
        job_id, attempt, 3, "vision", replicas, T0, T0 + timedelta(minutes=5), RunEnd.SUCCEEDED
    )
    return replace(base, **over)  # type: ignore[arg-type]


async def test_a_batch_of_runs_reads_back_as_written(fresh_database_url: str) -> None:
    pool = await create_pool(fresh_database_url)
    store = ExecutorStore(pool, "Cloud-A100")
    try:
        await migrate(pool, schema_for("Cloud-A100"), MIGRATIONS)
        every_shape = [
            run("plain"),
            run(
                "failing", end=RunEnd.RUN_FAILED, reason_code="oom", message="killed", exit_code=137
            ),
            run("paced", step_s=0.5, checkpoint_s=30.0, checkpoint_every_s=600.0, started=False),
            run("saved", checkpoint=Checkpoint(T0, T0 + timedelta(seconds=30))),
            run("served", service="chat", ready_at=T0 + timedelta(seconds=20)),
            run("gone"),
        ]
        async with pool.acquire() as conn, conn.transaction():
            await store.write(conn, started=every_shape, ended=[], epoch=3, tombstones=[])
        assert sorted((await store.load())[0], key=lambda j: j.job_id) == sorted(
            every_shape, key=lambda j: j.job_id
        )

        # The next batch: a new attempt takes a job's row over (listed twice, the last one
        # kept, as rows applied one by one would leave it), a run ends, a checkpoint is
        # signalled, a start is announced, one started and ended within the batch is never
        # written.
        stop = T0 + timedelta(minutes=1)
        marked = replace(every_shape[0], checkpoint=Checkpoint(T0, stop, stop))
        shown = replace(every_shape[2], started=True, started_at=T0 + timedelta(seconds=9))
        again = [run("failing", 2, epoch=4), run("failing", 3, epoch=4)]
        async with pool.acquire() as conn, conn.transaction():
            await store.write(
                conn,
                started=[*again, run("brief")],
                ended=[("gone", 1), ("brief", 1)],
                epoch=4,
                tombstones=["late"],
                checkpointed=[marked],
                announced=[shown],
            )
        jobs, epoch, tombs = await store.load()
    finally:
        await pool.close()
    want = [marked, again[1], shown, every_shape[3], every_shape[4]]
    assert sorted(jobs, key=lambda j: j.job_id) == sorted(want, key=lambda j: j.job_id)
    assert (epoch, set(tombs)) == (4, {"late"})
