"""The queue on the real broker and PostgreSQL: raw JSON from another platform, bad input,
redelivery and cancel; retries by failure class and requeue backoff."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from schemas import topics
from schemas.envelope import Envelope
from services.common.db import create_pool
from services.queue.app import create_app
from services.queue.settings import QueueSettings
from tests.integration.conftest import running
from tests.integration.kafka_tools import collect, produce

OUT = (
    topics.JOB_QUEUED,
    topics.JOB_REJECTED,
    topics.DEAD_LETTER,
    topics.JOB_FINISHED,
    topics.JOB_STOP_ORDERED,
)


def spec(job_id: str, **fields: Any) -> bytes:
    return json.dumps({"job_id": job_id, "tenant": "vision", **fields}).encode()


def mentions(run: str):  # type: ignore[no-untyped-def]
    def keep(_topic: str, env: dict[str, Any]) -> bool:
        return run in json.dumps(env)

    return keep


async def test_raw_json_jobs_and_every_kind_of_bad_input(service_env: dict[str, Any]) -> None:
    run = uuid.uuid4().hex[:8]
    j = {
        name: f"{run}-{name}"
        for name in (
            "good",
            "envelope",
            "types",
            "tenant",
            "queue",
            "accel",
            "zero",
            "negative",
            "gang",
            "after",
        )
    }
    envelope = Envelope(
        type="JobSubmitted", payload={"job_id": j["envelope"], "tenant": "nlp"}
    ).model_dump_json()
    messages = [
        (j["good"], spec(j["good"], replicas=2, resources={"accelerators": 8})),
        (j["envelope"], envelope.encode()),
        (None, f"{{not json {run}".encode()),
        (j["types"], spec(j["types"], replicas="lots")),
        (j["tenant"], spec(j["tenant"], tenant="ghosts")),
        (j["queue"], spec(j["queue"], queue="express")),
        (j["accel"], spec(j["accel"], resources={"accelerator_types": ["B200"]})),
        (j["zero"], spec(j["zero"], resources={"accelerators": 0})),
        (j["negative"], spec(j["negative"], replicas=-2)),
        (j["gang"], spec(j["gang"], replicas=9)),
        (j["after"], spec(j["after"])),  # a poison message must not stop the partition
    ]
    app = create_app(QueueSettings(**service_env))
    async with running(app):
        await produce(service_env["kafka_bootstrap"], topics.JOB_SUBMITTED, messages)
        got = await collect(service_env["kafka_bootstrap"], OUT, mentions(run), count=12)

    def outcome(job_id: str) -> tuple[str, str | None]:
        for topic, env in got:
            if env["payload"].get("job_id") == job_id and topic != topics.DEAD_LETTER:
                return topic, env["payload"].get("reason_code")
        return "missing", None

    assert outcome(j["good"]) == (topics.JOB_QUEUED, None)
    assert outcome(j["envelope"]) == (topics.JOB_QUEUED, None)
    assert outcome(j["after"]) == (topics.JOB_QUEUED, None)
    assert outcome(j["types"]) == (topics.JOB_REJECTED, "invalid_spec")
    assert outcome(j["tenant"]) == (topics.JOB_REJECTED, "unknown_tenant")
    assert outcome(j["queue"]) == (topics.JOB_REJECTED, "unknown_queue")
    assert outcome(j["accel"]) == (topics.JOB_REJECTED, "unknown_accelerator_type")
    assert outcome(j["zero"]) == (topics.JOB_REJECTED, "invalid_resources")
    assert outcome(j["negative"]) == (topics.JOB_REJECTED, "invalid_resources")
    assert outcome(j["gang"]) == (topics.JOB_REJECTED, "gang_too_large")
    dead = [env["payload"] for topic, env in got if topic == topics.DEAD_LETTER]
    assert sorted(d["error"].split(":")[0] for d in dead) == ["invalid_spec", "malformed"]
    assert all(d["source_topic"] == topics.JOB_SUBMITTED for d in dead)


async def test_duplicates_are_absorbed_and_cancel_finishes_a_queued_job(
    service_env: dict[str, Any],
) -> None:
    run = uuid.uuid4().hex[:8]
    job_id = f"{run}-dup"
    envelope = (
        Envelope(type="JobSubmitted", payload={"job_id": job_id, "tenant": "vision"})
        .model_dump_json()
        .encode()
    )
    twin = spec(f"{run}-twin", idempotency_key=f"key-{run}")
    app = create_app(QueueSettings(**service_env))
    async with running(app):
        # The same envelope twice (a producer retry) and a second job with a used key.
        await produce(
            service_env["kafka_bootstrap"],
            topics.JOB_SUBMITTED,
            [
                (job_id, envelope),
                (job_id, envelope),
                (f"{run}-a", spec(f"{run}-a", idempotency_key=f"key-{run}")),
                (f"{run}-twin", twin),
            ],
        )
        first = await collect(service_env["kafka_bootstrap"], OUT, mentions(run), count=3)
        cancel = Envelope(
            type="JobCancelRequested", payload={"job_id": job_id, "requested_by": "test"}
        )
        await produce(
            service_env["kafka_bootstrap"],
            topics.JOB_CANCEL_REQUESTED,
            [(job_id, cancel.model_dump_json().encode())],
        )
        after = await collect(service_env["kafka_bootstrap"], OUT, mentions(run), count=5)
    queued = [env["payload"]["job_id"] for topic, env in first if topic == topics.JOB_QUEUED]
    # The two jobs sharing a key sit on different partitions: whichever came first wins.
    assert job_id in queued and len(queued) == 2
    winner = next(q for q in queued if q != job_id)
    rejected = [env["payload"] for topic, env in first if topic == topics.JOB_REJECTED]
    assert [r["reason_code"] for r in rejected] == ["duplicate_submission"]
    assert winner in rejected[0]["message"] and rejected[0]["job_id"] != winner
    finished = [env["payload"] for topic, env in after if topic == topics.JOB_FINISHED]
    assert [(f["job_id"], f["outcome"]) for f in finished] == [(job_id, "canceled")]
    stops = [env["payload"]["job_id"] for topic, env in after if topic == topics.JOB_STOP_ORDERED]
    assert stops == [job_id]


# --- retries by failure class and requeue backoff (docs/retries.md) ----------------------

SCALE = 60.0  # fleet seconds per wall second: a 30 s backoff is 0.5 s of wall time
RETRY_OUT = (topics.JOB_QUEUED, topics.JOB_FINISHED)


def lifecycle_event(kind: str, at: datetime, **payload: Any) -> bytes:
    return Envelope(type=kind, occurred_at=at, payload=payload).model_dump_json().encode()


def run_failed(job_id: str, attempt: int, at: datetime, reason: str = "application_error") -> bytes:
    return lifecycle_event(
        "RunFailed",
        at,
        job_id=job_id,
        attempt=attempt,
        cluster="c1",
        reason_code=reason,
        message="the job's process exited with code 1" if reason != "out_of_memory" else "OOM",
        exit_code=1,
        ran_s=12.5,
    )


def of_job(got: list[tuple[str, dict[str, Any]]], job_id: str, topic: str) -> list[dict[str, Any]]:
    payloads = [env["payload"] for t, env in got if t == topic]
    return sorted(
        (p for p in payloads if p["job_id"] == job_id), key=lambda p: p.get("attempt") or 0
    )


def when(value: str) -> datetime:
    return datetime.fromisoformat(value)


async def test_failed_runs_are_retried_with_backoff_then_fail_and_claims_back_off(
    service_env: dict[str, Any],
) -> None:
    run = uuid.uuid4().hex[:8]
    app_err, oom, claim, cancel = (f"{run}-{n}" for n in ("app", "oom", "claim", "cancel"))
    bootstrap = service_env["kafka_bootstrap"]
    keep = mentions(run)
    app = create_app(QueueSettings(**service_env, time_scale=SCALE))
    pool = await create_pool(service_env["database_url"])
    try:
        async with running(app):
            await produce(
                bootstrap,
                topics.JOB_SUBMITTED,
                [
                    (app_err, spec(app_err)),
                    (oom, spec(oom, retry={"oom_memory_factor": 1.5})),
                    (claim, spec(claim)),
                    # A long backoff (one wall minute) so the cancel surely lands inside it.
                    (cancel, spec(cancel, retry={"backoff_s": 3600})),
                ],
            )
            first = await collect(bootstrap, RETRY_OUT, keep, count=4)
            submitted = {p["job_id"]: p["submitted_at"] for _, p in payloads(first)}
            assert set(submitted) == {app_err, oom, claim, cancel}

            t = datetime.now(UTC)
            ms = timedelta(milliseconds=100)
            # Three runs of one job fail in turn; the queue reads them in order (same key).
            await produce(
                bootstrap,
                topics.JOB_RUN_FAILED,
                [
                    (app_err, run_failed(app_err, 1, t)),
                    (app_err, run_failed(app_err, 2, t + ms)),
                    (app_err, run_failed(app_err, 2, t + ms)),  # a producer retry: stale
                    (app_err, run_failed(app_err, 3, t + 2 * ms)),
                    (oom, run_failed(oom, 1, t, reason="out_of_memory")),
                    (cancel, run_failed(cancel, 1, t)),
                ],
            )
            preempted = lifecycle_event(
                "JobPreempted",
                t,
                job_id=claim,
                attempt=1,
                cluster="c1",
                reason_code="preempted_for_priority",
                message=f"made room for {run}-urgent",
                work_kept_s=540,
                work_lost_s=60,
                for_job=f"{run}-urgent",
            )
            await produce(bootstrap, topics.JOB_PREEMPTED, [(claim, preempted)])
            # 4 first queueings + 2 retries + 1 end (app) + 1 (oom) + 1 (claim) + 1 (cancel)
            second = await collect(bootstrap, RETRY_OUT, keep, count=10)

            # The OOM-grown spec is stored: a node failure of the retry requeues it grown.
            node_failure = lifecycle_event(
                "JobPreempted",
                datetime.now(UTC),
                job_id=oom,
                attempt=2,
                cluster="c1",
                reason_code="node_failure",
                message="node n3 failed",
                failed_nodes=["n3"],
            )
            await produce(bootstrap, topics.JOB_PREEMPTED, [(oom, node_failure)])
            cancel_cmd = Envelope(
                type="JobCancelRequested", payload={"job_id": cancel, "requested_by": "ada"}
            )
            await produce(
                bootstrap,
                topics.JOB_CANCEL_REQUESTED,
                [(cancel, cancel_cmd.model_dump_json().encode())],
            )
            third = await collect(bootstrap, RETRY_OUT, keep, count=12)
            rows = await pool.fetch(
                "SELECT job_id, state, failures, claim_preemptions, requeues, reason_code, "
                "(spec->'resources'->>'memory_gb')::float AS memory FROM queue.jobs "
                "WHERE job_id = ANY($1::text[])",
                [app_err, oom, claim, cancel],
            )
            history = await pool.fetch(
                "SELECT job_id, event_type, reason_code, message FROM queue.job_history "
                "WHERE job_id = ANY($1::text[]) ORDER BY id",
                [app_err, oom, claim, cancel],
            )
    finally:
        await pool.close()
    jobs = {r["job_id"]: r for r in rows}

    # An application error, twice retried with a growing backoff, then the job fails.
    retries = of_job(second, app_err, topics.JOB_QUEUED)[1:]
    assert [(q["attempt"], q["requeue_of_attempt"]) for q in retries] == [(1, 1), (2, 2)]
    assert [when(q["not_before"]) for q in retries] == [
        t + timedelta(seconds=30 / SCALE),
        t + ms + timedelta(seconds=60 / SCALE),
    ]
    assert all(q["submitted_at"] == submitted[app_err] for q in retries)
    [end] = of_job(second, app_err, topics.JOB_FINISHED)
    assert (end["outcome"], end["reason_code"]) == ("failed", "application_error")
    assert "failed 3 times (last on attempt 3)" in end["message"]
    assert (jobs[app_err]["state"], jobs[app_err]["failures"]) == ("failed", 3)
    lines = [
        h["message"] for h in history if h["job_id"] == app_err and h["event_type"] == "RunFailed"
    ]
    assert lines[:2] == [
        "the job's process exited with code 1; retry 1 of 2 in 30 s",
        "the job's process exited with code 1; retry 2 of 2 in 60 s",
    ]

    # Out of memory with a factor: retried with 1.5 x the memory, kept for the next requeue.
    grown = of_job(third, oom, topics.JOB_QUEUED)[1:]
    assert [q["spec"]["resources"]["memory_gb"] for q in grown] == [48, 48]
    assert "not_before" in grown[0] and "not_before" not in grown[1]  # node failure: no wait
    assert grown[1]["excluded_nodes"] == ["n3"]
    assert (jobs[oom]["memory"], jobs[oom]["failures"], jobs[oom]["requeues"]) == (48, 1, 2)

    # Preempted for a higher claim: requeued with the original submit time, after a backoff.
    [_, requeued] = of_job(second, claim, topics.JOB_QUEUED)
    assert requeued["submitted_at"] == submitted[claim]
    assert when(requeued["not_before"]) == t + timedelta(seconds=30 / SCALE)
    assert (jobs[claim]["claim_preemptions"], jobs[claim]["failures"]) == (1, 0)
    [line] = [h["message"] for h in history if h["job_id"] == claim and h["reason_code"]]
    assert "540 s of work kept, 60 s lost" in line

    # Canceled while backing off: it ends canceled, before it could be placed again.
    [_, backing_off] = of_job(second, cancel, topics.JOB_QUEUED)
    [ended] = [
        e for t_, e in third if t_ == topics.JOB_FINISHED and e["payload"]["job_id"] == cancel
    ]
    assert ended["payload"]["outcome"] == "canceled"
    assert when(ended["occurred_at"]) < when(backing_off["not_before"])
    assert jobs[cancel]["state"] == "canceled"


def payloads(got: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    return [(t, env["payload"]) for t, env in got]
