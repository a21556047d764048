"""The preemptor on the real broker and PostgreSQL: a valid request is signaled, then ordered
once its (capped) grace is over; guards refuse with reasons; a tenant's budget holds; a
requester that ends during the grace calls the stop off; a kill -9 during the grace still
ends in a stop order on time; poison is dead-lettered without blocking what follows.

Time runs 60x (20x for the restart): the policy's 120 fleet-second grace cap is 2 s of wall
time, its 600 fleet-second minimum runtime 10 s."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import yaml

from cli.infra import free_port
from schemas import topics
from schemas.envelope import Envelope
from services.preemptor.app import create_app
from services.preemptor.settings import PreemptorSettings
from tests.integration.conftest import running
from tests.integration.kafka_tools import collect, produce
from tests.unit.services.builders import POLICY_DOC

ROOT = Path(__file__).resolve().parents[2]
OUT = (topics.JOB_CHECKPOINT_REQUESTED, topics.JOB_PREEMPT_ORDERED, topics.PREEMPTION_CANCELED)
SCALE = 60.0
GRACE_CAP_S = 120.0
EPOCH = 100  # every request here comes from this leader epoch, unless it tests a stale one

POLICY = {
    **POLICY_DOC,
    "priority_classes": [
        {"name": "low", "rank": 0},
        {"name": "normal", "rank": 10},
        {"name": "high", "rank": 50, "preempting": True},
    ],
    "preemption": {
        "min_runtime_s": 600,
        "grace_cap_s": GRACE_CAP_S,
        "max_preemptions_per_tenant": 2,
        "budget_window_s": 36000,
    },
}


@pytest.fixture(scope="module")
def env(service_env: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("preemptor") / "policy.yaml"
    path.write_text(yaml.safe_dump(POLICY))
    return {**service_env, "policy_file": path}


def settings(env: dict[str, Any], **overrides: Any) -> PreemptorSettings:
    return PreemptorSettings(**{"time_scale": SCALE, **env, **overrides})


# --- what the scheduler, the executors and the queue would write ---------------------------


def message(event_type: str, key: str, **payload: Any) -> tuple[str, bytes]:
    env = Envelope(type=event_type, producer="test", tenant=payload.get("tenant"), payload=payload)
    return key, env.model_dump_json().encode()


def started(job_id: str, ran_fleet_s: float, attempt: int = 1) -> tuple[str, bytes]:
    at = datetime.now(UTC) - timedelta(seconds=ran_fleet_s / SCALE)
    return message(
        "JobStarted",
        job_id,
        job_id=job_id,
        attempt=attempt,
        cluster="c1",
        nodes=["n1"],
        started_at=at.isoformat(),
    )


def request(victim: str, for_job: str, tenant: str, **fields: Any) -> tuple[str, bytes]:
    body: dict[str, Any] = {
        "job_id": victim,
        "attempt": 1,
        "cluster": "c1",
        "tenant": tenant,
        "priority_class": "low",
        "claim": {"rank": 0, "guaranteed": False, "level": 0},
        "for_job": for_job,
        "for_tenant": "nlp",
        "for_priority_class": "high",
        "for_claim": {"rank": 50, "guaranteed": True, "level": 0},
        "reason_code": "preempted_for_priority",
        "message": f"room for {for_job}",
        "grace_s": 600,  # more than the policy's cap of 120
        "epoch": EPOCH,
        "leader": "scheduler-test",
        **fields,
    }
    return message("PreemptionRequested", victim, **body)


def about(run: str) -> Callable[[str, dict[str, Any]], bool]:
    def keep(_topic: str, env: dict[str, Any]) -> bool:
        return run in json.dumps(env["payload"])

    return keep


async def outputs(
    bootstrap: str, run: str, count: int, timeout_s: float = 30
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """victim job id -> topic -> envelopes, for this test's jobs."""
    got = await collect(bootstrap, OUT, about(run), count=count, timeout_s=timeout_s)
    by_job: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for topic, env in got:
        by_job.setdefault(env["payload"]["job_id"], {}).setdefault(topic, []).append(env)
    return by_job


def at(env: dict[str, Any], field: str = "occurred_at") -> datetime:
    value = env[field] if field == "occurred_at" else env["payload"][field]
    return datetime.fromisoformat(value)


async def states(database_url: str, run: str) -> dict[str, str]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT job_id, state FROM preemptor.preemptions WHERE job_id LIKE $1 "
            "ORDER BY received_at",
            f"%{run}%",
        )
    finally:
        await conn.close()
    return {r["job_id"]: r["state"] for r in rows}


async def wait_until(check: Callable[[], Any], timeout_s: float = 15) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


# --- the tests ----------------------------------------------------------------------------


async def test_a_valid_request_is_signaled_then_ordered_after_the_capped_grace(
    env: dict[str, Any],
) -> None:
    run = uuid.uuid4().hex[:8]
    victim, asker = f"v-{run}", f"a-{run}"
    bootstrap = env["kafka_bootstrap"]
    app = create_app(settings(env))
    async with running(app):
        await produce(bootstrap, topics.JOB_STARTED, [started(victim, ran_fleet_s=3600)])
        key, raw = request(victim, asker, f"t{run}")
        trace = json.loads(raw)["trace_id"]
        await produce(bootstrap, topics.PREEMPTION_REQUESTED, [(key, raw)])
        got = (await outputs(bootstrap, run, count=2))[victim]
        # The executor reports the run handed back: the preemption is done.
        await produce(
            bootstrap,
            topics.JOB_PREEMPTED,
            [
                message(
                    "JobPreempted",
                    victim,
                    job_id=victim,
                    attempt=1,
                    cluster="c1",
                    reason_code="preempted_for_priority",
                    message="stopped",
                    for_job=asker,
                )
            ],
        )
        await wait_until(lambda: _state_is(env["database_url"], run, victim, "done"))
        metrics = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=metrics, base_url="http://t") as client:
            text = (await client.get("/metrics")).text

    [signal_env] = got[topics.JOB_CHECKPOINT_REQUESTED]
    [order] = got[topics.JOB_PREEMPT_ORDERED]
    assert topics.PREEMPTION_CANCELED not in got
    sig = signal_env["payload"]
    assert (sig["grace_s"], sig["for_job"], sig["attempt"]) == (GRACE_CAP_S, asker, 1)
    # 120 fleet seconds at 60x: stop_at is 2 s after the decision, the moment the signal's
    # envelope is stamped with, and the stop never comes before stop_at, so never sooner than
    # the grace after the signal, however long the batch took. How late it comes is measured
    # (qm_preemptor_order_delay_seconds), not asserted: machines are noisy.
    stop_at = at(signal_env, "stop_at")
    assert stop_at - at(signal_env) == timedelta(seconds=2)
    assert at(order) >= stop_at
    assert order["payload"]["reason_code"] == "preempted_for_priority"
    assert signal_env["trace_id"] == order["trace_id"] == trace
    assert signal_env["tenant"] == f"t{run}"
    assert "qm_preemptor_ordered_total 1.0" in text
    assert 'qm_preemptor_requests_total{outcome="signaled"} 1.0' in text
    assert 'qm_preemptor_done_total{ended_by="job.preempted"} 1.0' in text


async def test_a_stop_order_nobody_answers_raises_one_alert(env: dict[str, Any]) -> None:
    """No executor ends the run after its stop order (wedged, or gone): after the timeout an
    alert names the cluster, the run and the job waiting for it, once; a late answer still
    ends the preemption."""
    run = uuid.uuid4().hex[:8]
    victim, asker = f"v-{run}", f"a-{run}"
    bootstrap = env["kafka_bootstrap"]
    app = create_app(settings(env, stop_answer_timeout_s=0.5, answer_check_s=0.1))
    async with running(app):
        await produce(bootstrap, topics.JOB_STARTED, [started(victim, ran_fleet_s=3600)])
        await produce(bootstrap, topics.PREEMPTION_REQUESTED, [request(victim, asker, "vision")])
        await wait_until(lambda: _state_is(env["database_url"], run, victim, "ordered"))
        alerts = await collect(bootstrap, (topics.ALERT_RAISED,), about(run), count=1)
        await asyncio.sleep(1.0)  # several more checks: no second alert for the same order
        again = await collect(bootstrap, (topics.ALERT_RAISED,), about(run), count=2, timeout_s=2)
        answer = message(
            "JobPreempted",
            victim,
            job_id=victim,
            attempt=1,
            cluster="c1",
            reason_code="preempted_for_priority",
            message="stopped at last",
            for_job=asker,
        )
        await produce(bootstrap, topics.JOB_PREEMPTED, [answer])
        await wait_until(lambda: _state_is(env["database_url"], run, victim, "done"))
    [(_, alert)] = alerts
    body = alert["payload"]
    assert (body["cause"], body["severity"], body["cluster"]) == (
        "stop_order_unanswered",
        "warning",
        "c1",
    )
    assert victim in body["suggested_action"] and asker in body["suggested_action"]
    assert len(again) == 1


async def _state_is(database_url: str, run: str, job_id: str, state: str) -> bool:
    return (await states(database_url, run)).get(job_id) == state


async def test_guards_refuse_with_reasons_and_a_late_start_is_waited_for(
    env: dict[str, Any],
) -> None:
    run = uuid.uuid4().hex[:8]
    young, equal, late, stale = (f"{n}-{run}" for n in ("young", "equal", "late", "stale"))
    bootstrap = env["kafka_bootstrap"]
    tenant = f"t{run}"
    async with running(create_app(settings(env))):
        await produce(
            bootstrap,
            topics.JOB_STARTED,
            [started(young, ran_fleet_s=60), started(equal, 3600), started(stale, 3600)],
        )
        await produce(
            bootstrap,
            topics.PREEMPTION_REQUESTED,
            [
                request(young, f"a-{run}", tenant),
                request(
                    equal,
                    f"a-{run}",
                    tenant,
                    for_priority_class="low",
                    for_claim={"rank": 0, "guaranteed": False, "level": 0},
                ),
                # Its job.started comes later (another topic): the request is held.
                request(late, f"a-{run}", tenant),
            ],
        )
        first = await outputs(bootstrap, run, count=2)
        await asyncio.sleep(0.5)
        await produce(bootstrap, topics.JOB_STARTED, [started(late, 3600)])
        # A deposed leader's late request: epoch 7, while 100 leads. Then 3 refusals and the
        # late one's signal and stop order.
        await produce(
            bootstrap, topics.PREEMPTION_REQUESTED, [request(stale, f"a-{run}", tenant, epoch=7)]
        )
        got = await outputs(bootstrap, run, count=5)

    assert set(first) == {young, equal}  # nothing for `late` before its start was seen
    [refused] = got[young][topics.PREEMPTION_CANCELED]
    assert refused["payload"]["reason_code"] == "min_runtime"
    # Started 60 fleet seconds before it was sent, plus the time it took to get there.
    assert re.search(r"has run \d+ s of its guaranteed 600 s", refused["payload"]["message"])
    [refused] = got[equal][topics.PREEMPTION_CANCELED]
    assert refused["payload"]["reason_code"] == "claim_not_higher"
    assert "strictly higher claim" in refused["payload"]["message"]
    [refused] = got[stale][topics.PREEMPTION_CANCELED]
    assert refused["payload"]["reason_code"] == "stale_epoch"
    # Held until its start was seen, then judged (ran 3600 s) and preempted.
    assert sorted(got[late]) == [topics.JOB_CHECKPOINT_REQUESTED, topics.JOB_PREEMPT_ORDERED]
    assert (await states(env["database_url"], run))[late] == "ordered"


async def test_a_tenant_budget_caps_preemptions_per_window(env: dict[str, Any]) -> None:
    run = uuid.uuid4().hex[:8]
    victims = [f"b{i}-{run}" for i in range(3)]
    other = f"other-{run}"
    bootstrap = env["kafka_bootstrap"]
    async with running(create_app(settings(env))):
        await produce(bootstrap, topics.JOB_STARTED, [started(v, 3600) for v in [*victims, other]])
        await produce(
            bootstrap,
            topics.PREEMPTION_REQUESTED,
            [request(v, f"a-{run}", f"t{run}") for v in victims]
            + [request(other, f"a-{run}", f"u{run}")],
        )
        # 3 signals (2 of t + 1 of u), 1 refusal, then the 3 stop orders.
        got = await outputs(bootstrap, run, count=7)

    outcome = {v: sorted(got[v]) for v in victims}
    refused = [v for v in victims if topics.PREEMPTION_CANCELED in got[v]]
    assert len(refused) == 1, outcome
    [cancel] = got[refused[0]][topics.PREEMPTION_CANCELED]
    assert cancel["payload"]["reason_code"] == "tenant_budget"
    assert f"tenant t{run} already had 2 runs preempted" in cancel["payload"]["message"]
    for v in victims:
        if v not in refused:
            assert outcome[v] == [topics.JOB_CHECKPOINT_REQUESTED, topics.JOB_PREEMPT_ORDERED]
    # Another tenant's budget is its own.
    assert sorted(got[other]) == [topics.JOB_CHECKPOINT_REQUESTED, topics.JOB_PREEMPT_ORDERED]


async def test_a_requester_ending_during_the_grace_calls_the_stop_off(
    env: dict[str, Any],
) -> None:
    run = uuid.uuid4().hex[:8]
    victim, asker = f"v-{run}", f"a-{run}"
    bootstrap = env["kafka_bootstrap"]
    async with running(create_app(settings(env))):
        await produce(bootstrap, topics.JOB_STARTED, [started(victim, 3600)])
        await produce(bootstrap, topics.PREEMPTION_REQUESTED, [request(victim, asker, f"t{run}")])
        await outputs(bootstrap, run, count=1)  # signaled
        # The requester is canceled while still queued: the queue ends it with no attempt.
        await produce(
            bootstrap,
            topics.JOB_FINISHED,
            [message("JobFinished", asker, job_id=asker, outcome="canceled")],
        )
        got = await outputs(bootstrap, run, count=2)
        await asyncio.sleep(1.0)  # any stop order would have come by now
        got = await outputs(bootstrap, run, count=3, timeout_s=1.5)

    assert sorted(got[victim]) == [topics.JOB_CHECKPOINT_REQUESTED, topics.PREEMPTION_CANCELED]
    [cancel] = got[victim][topics.PREEMPTION_CANCELED]
    assert cancel["payload"]["reason_code"] == "requester_gone"
    assert "keeps running" in cancel["payload"]["message"]
    # Called off at the stop time, not before: the grace period ran its course.
    [signal_env] = got[victim][topics.JOB_CHECKPOINT_REQUESTED]
    assert at(cancel) >= at(signal_env, "stop_at")


@contextlib.asynccontextmanager
async def preemptor_process(
    env: dict[str, Any], scale: float, log: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`python -m services.preemptor` as its own process, as the stack runs it; its log in
    `log`."""
    port = free_port()
    proc_env = {
        **os.environ,
        **{f"QM_{k.upper()}": str(v) for k, v in env.items()},
        "QM_TIME_SCALE": str(scale),
        "QM_HTTP_PORT": str(port),
        "QM_LOG_FORMAT": "json",
    }
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.preemptor",
            cwd=ROOT,
            env=proc_env,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(300):
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/healthz")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"the preemptor process did not start; see {log}")
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await asyncio.wait_for(proc.wait(), 10)


async def test_a_kill_during_the_grace_still_ends_in_a_stop_order_on_time(
    env: dict[str, Any], tmp_path: Path
) -> None:
    """The timer is a row in PostgreSQL, not a task in memory: kill -9 the preemptor during
    the grace period, and the one started after the stop time issues the order at once."""
    run = uuid.uuid4().hex[:8]
    victim, asker = f"v-{run}", f"a-{run}"
    bootstrap = env["kafka_bootstrap"]
    scale = 20.0  # the 120 s grace cap is 6 s of wall time
    async with preemptor_process(env, scale, tmp_path / "preemptor.log") as proc:
        await produce(bootstrap, topics.JOB_STARTED, [started(victim, 36000)])
        await produce(bootstrap, topics.PREEMPTION_REQUESTED, [request(victim, asker, f"t{run}")])
        [signal_env] = (await outputs(bootstrap, run, count=1))[victim][
            topics.JOB_CHECKPOINT_REQUESTED
        ]
        await asyncio.sleep(0.5)  # time enough to misbehave: the timer ticks every 50 ms
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 10)
    stop_at = at(signal_env, "stop_at")
    assert stop_at > datetime.now(UTC)  # killed inside the grace period
    # Down past the stop time: nobody orders anything meanwhile.
    await asyncio.sleep((stop_at - datetime.now(UTC)).total_seconds() + 0.5)
    quiet = await outputs(bootstrap, run, count=2, timeout_s=1.0)
    assert list(quiet[victim]) == [topics.JOB_CHECKPOINT_REQUESTED]
    assert (await states(env["database_url"], run))[victim] == "signaled"

    restarted_at = datetime.now(UTC)
    async with running(create_app(settings(env, time_scale=scale))):
        got = await outputs(bootstrap, run, count=2)
    [order] = got[victim][topics.JOB_PREEMPT_ORDERED]
    assert at(order) >= restarted_at > stop_at
    # On start-up, not after another grace: a generous bound that only catches "never".
    assert (at(order) - restarted_at).total_seconds() < 30.0
    assert order["trace_id"] == signal_env["trace_id"]
    assert got[victim][topics.JOB_CHECKPOINT_REQUESTED] == [signal_env]  # not signaled twice


async def test_poison_is_dead_lettered_and_the_next_request_is_taken(
    env: dict[str, Any],
) -> None:
    run = uuid.uuid4().hex[:8]
    victim = f"v-{run}"
    bootstrap = env["kafka_bootstrap"]
    _, invalid = request(f"bad-{run}", f"a-{run}", f"t{run}")
    doc = json.loads(invalid)
    del doc["payload"]["for_claim"]
    async with running(create_app(settings(env))):
        await produce(bootstrap, topics.JOB_STARTED, [started(victim, 3600)])
        # One key: the valid request comes after the poison in the same partition.
        await produce(
            bootstrap,
            topics.PREEMPTION_REQUESTED,
            [
                (victim, f"not json {run}".encode()),
                (victim, json.dumps(doc).encode()),
                request(victim, f"a-{run}", f"t{run}"),
            ],
        )
        dead = await collect(
            bootstrap,
            (topics.DEAD_LETTER,),
            lambda _t, e: (
                run in e["payload"].get("value", "") and e["payload"].get("consumer") == "preemptor"
            ),
            count=2,
        )
        got = await outputs(bootstrap, run, count=1)

    errors = sorted(d["payload"]["error"] for _, d in dead)
    assert len(errors) == 2
    assert any("for_claim" in e for e in errors), errors
    assert all(d["payload"]["source_topic"] == topics.PREEMPTION_REQUESTED for _, d in dead)
    assert list(got[victim]) == [topics.JOB_CHECKPOINT_REQUESTED]
