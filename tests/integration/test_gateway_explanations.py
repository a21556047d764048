"""The gateway's store of why each job waits, on the real PostgreSQL: a batch of explanations
written in one statement, the newest per job kept whatever the order they were read in."""

from __future__ import annotations

import asyncpg
import pytest
from redis.asyncio import Redis

from schemas import topics
from schemas.events import PendingExplained
from services.gateway.explain import record_explanations
from tests.integration import test_gateway_early_events as early
from tests.integration.test_gateway_early_events import rec

pytestmark = pytest.mark.integration

rig = early.rig  # the fixture: the gateway's stores, migrated


def why(job_id: str, seconds: float, *codes: str, pending: int = 3) -> object:
    said = PendingExplained(
        job_id=job_id, codes=list(codes), message=f"{job_id} at {seconds}", pending_jobs=pending
    )
    return rec(topics.SCHEDULING_EXPLAINED, said, seconds, job_id)


async def stored(pool: asyncpg.Pool) -> dict[str, tuple[list[str], str, int]]:
    rows = await pool.fetch("SELECT job_id, codes, message, pending_jobs FROM gateway.explanations")
    return {r["job_id"]: (list(r["codes"]), r["message"], r["pending_jobs"]) for r in rows}


async def test_the_newest_explanation_of_each_job_is_kept(rig: tuple[asyncpg.Pool, Redis]) -> None:
    pool, _ = rig
    first = (
        why("a", 10, "quota_exhausted", "no_fit,h100"),  # a comma inside a code
        why("b", 10),  # no codes at all
        why("a", 30, "no_fit"),
        why("a", 20, "preemption_pending"),  # read after a newer one: not kept
        why("c", 10, "gang_incomplete", pending=7),
    )
    dead = await record_explanations(pool, first)  # type: ignore[arg-type]
    assert dead == []
    assert await stored(pool) == {
        "a": (["no_fit"], "a at 30", 3),
        "b": ([], "b at 10", 3),
        "c": (["gang_incomplete"], "c at 10", 7),
    }
    # A later batch: an older explanation of a job is not kept, a newer one replaces it.
    await record_explanations(pool, (why("a", 25, "stale"), why("c", 40, "x", "y")))  # type: ignore[arg-type]
    assert await stored(pool) == {
        "a": (["no_fit"], "a at 30", 3),
        "b": ([], "b at 10", 3),
        "c": (["x", "y"], "c at 40", 3),
    }
