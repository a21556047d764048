"""The health service on the real broker and PostgreSQL: a critical XID, a flapping node,
silence (one node and a whole cluster), recovery after the clean period, a restart that
neither re-alerts nor forgets a quarantine, and stragglers found in job.progress. Timings are
seconds here, minutes in production."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import yaml
from aiokafka import AIOKafkaConsumer, TopicPartition
from fastapi import FastAPI

from schemas import topics
from schemas.envelope import Envelope
from services.health.app import create_app
from services.health.intake import TOPICS
from services.health.settings import HealthSettings
from tests.integration.conftest import ROOT, running
from tests.integration.faults import CommitInDoubt
from tests.integration.kafka_tools import START_S, STOP_S, bounded, collect, every_record, produce

OUT = (topics.NODE_UNHEALTHY, topics.NODE_RECOVERED, topics.ALERT_RAISED)
BEAT_EVERY_S = 0.25


def settings(env: dict[str, Any], **overrides: Any) -> HealthSettings:
    return HealthSettings(
        **{**env, **overrides},
        suspect_after_s=1.0,
        unhealthy_after_s=2.0,
        min_quarantine_s=0.5,
        clean_period_s=1.5,
        check_interval_s=0.1,
        fetch_max_wait_ms=20,
    )


def envelope(event_type: str, **payload: Any) -> bytes:
    return Envelope(type=event_type, producer="test", payload=payload).model_dump_json().encode()


def probe(node: str, kind: str, **extra: Any) -> tuple[str, bytes]:
    return node, envelope(
        "NodeProbe", node_id=node, cluster=node.rsplit("-", 1)[0], kind=kind, **extra
    )


@contextlib.asynccontextmanager
async def heartbeating(bootstrap: str, nodes: set[str]) -> AsyncIterator[set[str]]:
    """Heartbeats for every node in the (mutable) set, every BEAT_EVERY_S, until the block ends.
    The nodes' executor lists them first: health watches only inventoried nodes."""
    await list_nodes(bootstrap, nodes)

    async def beat() -> None:
        while True:
            await produce(
                bootstrap,
                topics.NODE_HEARTBEAT,
                [
                    (
                        n,
                        envelope(
                            "NodeHeartbeat",
                            node_id=n,
                            cluster=n.rsplit("-", 1)[0],
                            accelerators=8,
                            allocated_accelerators=0,
                        ),
                    )
                    for n in sorted(nodes)
                ],
            )
            await asyncio.sleep(BEAT_EVERY_S)

    task = asyncio.create_task(beat())
    try:
        yield nodes
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def list_nodes(bootstrap: str, nodes: Iterable[str]) -> None:
    """What an executor publishes at start: its cluster's inventory (cluster.capacity)."""
    by_cluster: dict[str, list[str]] = {}
    for n in sorted(nodes):
        by_cluster.setdefault(n.rsplit("-", 1)[0], []).append(n)
    info = {
        "block": "b0",
        "rack": "r0",
        "nvlink_domain": "d0",
        "accelerator_type": "a100",
        "generation": "ampere",
        "accelerator_memory_gb": 80,
        "relative_speed": 1.0,
        "accelerators": 8,
        "cpu": 96,
        "memory_gb": 1024,
        "price_tier": "on_demand",
    }
    await produce(
        bootstrap,
        topics.CLUSTER_CAPACITY,
        [
            (
                cluster,
                envelope(
                    "ClusterCapacity",
                    cluster=cluster,
                    location="on_prem",
                    kind="on_prem",
                    prices={},
                    nodes=[{"node_id": n, **info} for n in members],
                ),
            )
            for cluster, members in by_cluster.items()
        ],
    )


def about(run: str) -> Callable[[str, dict[str, Any]], bool]:
    def keep(_topic: str, env: dict[str, Any]) -> bool:
        return run in json.dumps(env["payload"])

    return keep


def kinds(got: list[tuple[str, dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {t: [] for t in OUT}
    for topic, env in got:
        out[topic].append(env["payload"])
    return out


async def test_a_critical_xid_quarantines_at_once_and_a_restart_remembers_it(
    service_env: dict[str, Any],
) -> None:
    run = uuid.uuid4().hex[:8]
    bootstrap = service_env["kafka_bootstrap"]
    node = f"x{run}-1"
    async with heartbeating(bootstrap, {node}):
        async with running(create_app(settings(service_env))):
            await asyncio.sleep(0.5)
            await produce(bootstrap, topics.NODE_PROBE, [probe(node, "gpu_xid", xid=79, device=3)])
            first = kinds(await collect(bootstrap, OUT, about(run), count=2, timeout_s=10))
            # More of the same: counted on the incident, no new alert.
            await produce(
                bootstrap, topics.NODE_PROBE, [probe(node, "gpu_xid", xid=79) for _ in range(3)]
            )
            await asyncio.sleep(1.0)
        # A restart: the quarantine (clean period 1800 s for XID 79) must hold, no re-alert.
        async with running(create_app(settings(service_env))):
            await asyncio.sleep(3.0)
    got = kinds(await collect(bootstrap, OUT, about(run), count=99, timeout_s=2))
    [sick] = first[topics.NODE_UNHEALTHY]
    assert (sick["node_id"], sick["cause"]) == (node, "xid_79")
    [alert] = first[topics.ALERT_RAISED]
    assert (alert["subject"], alert["severity"], alert["count"]) == (node, "critical", 1)
    assert alert["alert_id"] == sick["incident_id"] and "bus" in alert["suggested_action"]
    assert len(got[topics.NODE_UNHEALTHY]) == 1 and len(got[topics.ALERT_RAISED]) == 1
    assert got[topics.NODE_RECOVERED] == []
    conn = await asyncpg.connect(service_env["database_url"])
    try:
        count = await conn.fetchval("SELECT count FROM health.incidents WHERE subject = $1", node)
        state = await conn.fetchval("SELECT state FROM health.nodes WHERE node_id = $1", node)
    finally:
        await conn.close()
    assert (count, state) == (4, "unhealthy")


async def test_a_flapping_node_raises_one_alert_is_quarantined_once_then_recovers(
    service_env: dict[str, Any],
) -> None:
    run = uuid.uuid4().hex[:8]
    bootstrap = service_env["kafka_bootstrap"]
    node = f"f{run}-1"
    async with heartbeating(bootstrap, {node}), running(create_app(settings(service_env))):
        for _ in range(15):  # thermal throttling every 0.2 s for 3 s (3 in 300 s quarantines)
            await produce(bootstrap, topics.NODE_PROBE, [probe(node, "thermal_throttle")])
            await asyncio.sleep(0.2)
        # Then calm: back after the 1.5 s clean period.
        got = kinds(await collect(bootstrap, OUT, about(run), count=3, timeout_s=10))
        await asyncio.sleep(1.0)
    got = kinds(await collect(bootstrap, OUT, about(run), count=99, timeout_s=1.5))
    assert [u["cause"] for u in got[topics.NODE_UNHEALTHY]] == ["thermal_throttle"]
    [alert] = got[topics.ALERT_RAISED]
    assert (alert["severity"], alert["count"]) == ("warning", 3)
    [back] = got[topics.NODE_RECOVERED]
    assert back["node_id"] == node and back["signals_seen"] == 15


async def test_silence_quarantines_one_alert_per_dark_cluster_and_recovers_on_return(
    service_env: dict[str, Any],
) -> None:
    run = uuid.uuid4().hex[:8]
    bootstrap = service_env["kafka_bootstrap"]
    solo = f"s{run}-1"
    cluster = f"d{run}"
    dark = {f"{cluster}-{i}" for i in range(3)}
    live = {solo, *dark}
    async with heartbeating(bootstrap, live), running(create_app(settings(service_env))):
        await asyncio.sleep(1.5)
        live.clear()  # every node stops heartbeating
        first = kinds(await collect(bootstrap, OUT, about(run), count=6, timeout_s=10))
        live.update({solo, *dark})  # and comes back
        await collect(bootstrap, OUT, about(run), count=10, timeout_s=10)
    got = kinds(await collect(bootstrap, OUT, about(run), count=99, timeout_s=1.5))
    assert sorted(u["node_id"] for u in first[topics.NODE_UNHEALTHY]) == sorted({solo, *dark})
    assert {u["cause"] for u in first[topics.NODE_UNHEALTHY]} == {"heartbeat_lost"}
    alerts = sorted((a["subject"], a.get("node_id")) for a in got[topics.ALERT_RAISED])
    assert alerts == [(cluster, None), (solo, solo)]
    assert len(got[topics.NODE_UNHEALTHY]) == 4
    assert sorted(r["node_id"] for r in got[topics.NODE_RECOVERED]) == sorted({solo, *dark})


STRAGGLE = (1.0, 1.05, 3.0, 0.98)  # replica 2 runs 3x slower than its peers
STEADY = (1.0, 1.1, 0.95, 1.02)


def progress(job: str, nodes: str, steps: tuple[float, ...]) -> tuple[str, bytes]:
    """A JobProgress of `job` whose replica i runs on `<nodes>-<i>`, keyed by job like the
    executor's."""
    replicas = [
        {"replica": i, "node_id": f"{nodes}-{i}", "step_time_s": s} for i, s in enumerate(steps)
    ]
    return job, envelope("JobProgress", job_id=job, attempt=1, cluster=nodes, replicas=replicas)


async def report_progress(
    bootstrap: str, reports: int, *gangs: tuple[str, str, tuple[float, ...]]
) -> None:
    """`reports` rounds of progress for every gang, a little apart (each has its own time)."""
    for _ in range(reports):
        await produce(bootstrap, topics.JOB_PROGRESS, [progress(*g) for g in gangs])
        await asyncio.sleep(0.05)


async def metrics_of(app: FastAPI) -> dict[str, float]:
    """The app's /metrics, as `name{labels}` -> value."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://health") as client:
        text = (await client.get("/metrics")).text
    return {
        name: float(value)
        for line in text.splitlines()
        if line and not line.startswith("#")
        for name, value in [line.rsplit(" ", 1)]
    }


async def group_at_end(bootstrap: str, group: str) -> None:
    """Commit `group`'s offsets at the current end of the health service's input topics, so a
    service in that group starts with what comes next, not with the shared broker's history
    (earlier tests' progress reports: the executor's slowed node straggles there)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    await bounded(consumer.start(), START_S, "a test consumer's start")
    try:
        await consumer.topics()  # the topics' metadata, for their partitions
        parts = [
            TopicPartition(t, p) for t in TOPICS for p in consumer.partitions_for_topic(t) or ()
        ]
        consumer.assign(parts)
        await consumer.commit(await consumer.end_offsets(parts))
    finally:
        await bounded(consumer.stop(), STOP_S, "a test consumer's stop")


async def until(probe: Callable[[], Any], expected: Any, timeout_s: float = 15.0) -> Any:
    """Poll `probe` until it returns `expected` (or time is up); returns its last value."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        got = await probe()
        if got == expected or asyncio.get_running_loop().time() > deadline:
            return got
        await asyncio.sleep(0.1)


async def test_a_straggler_raises_one_alert_across_reports_and_a_restart_and_a_steady_gang_none(
    service_env: dict[str, Any], fresh_database_url: str
) -> None:
    run = uuid.uuid4().hex[:8]
    bootstrap = service_env["kafka_bootstrap"]
    # The gauges below count the whole service: it gets a database and a consumer group of its
    # own (starting at the topics' end), so only this test's gangs are in them.
    env = {**service_env, "database_url": fresh_database_url, "group_id": f"health-{run}"}
    await group_at_end(bootstrap, env["group_id"])
    slow_job, steady_job, half_job = f"js{run}", f"jh{run}", f"jw{run}"
    gangs = ((slow_job, f"g{run}", STRAGGLE), (steady_job, f"h{run}", STEADY))
    half = (half_job, f"w{run}", STRAGGLE)  # slow twice before the restart, once after
    conn = await asyncpg.connect(env["database_url"])

    async def incident_count() -> Any:
        return await conn.fetchval(
            "SELECT count FROM health.incidents WHERE subject = $1 AND closed_at IS NULL",
            f"g{run}-2",
        )

    async def half_window() -> Any:
        nodes = await conn.fetchval(
            "SELECT nodes FROM health.straggler_tracks WHERE job_id = $1", half_job
        )
        return None if nodes is None else json.loads(nodes)[2]["recent"]

    try:
        async with running(create_app(settings(env))) as app:
            await asyncio.sleep(0.5)
            # A broken report first, on the same partition as the good ones that follow.
            bad = progress(slow_job, f"g{run}", (1.0, -1.0))
            await produce(bootstrap, topics.JOB_PROGRESS, [bad])
            await report_progress(bootstrap, 8, *gangs)
            first = await collect(
                bootstrap, (topics.ALERT_RAISED, topics.DEAD_LETTER), about(run), 2, 10
            )
            # It stays slow: more reports count on the incident, never a second alert.
            await report_progress(bootstrap, 8, *gangs)
            assert await until(incident_count, 16) == 16

            async def all_judged() -> bool:
                # The slow gang's 16th report can be in before the steady gang's last ones.
                scrape = await metrics_of(app)
                return scrape.get('qm_health_progress_reports_total{outcome="judged"}', 0) >= 32

            assert await until(all_judged, True)
            scrape = await metrics_of(app)
            assert scrape['qm_health_straggler_incidents_total{event="opened"}'] == 1
            assert scrape["qm_health_stragglers_detected_total"] == 1
            assert scrape["qm_health_straggling_nodes"] == 1
            assert scrape['qm_health_progress_reports_total{outcome="judged"}'] >= 32
            await report_progress(bootstrap, 2, half)
            assert await until(half_window, "11") == "11"
        # A restart remembers the open incident (no second alert) and the half-filled window
        # (the third slow report after it alerts).
        async with running(create_app(settings(env))):
            await report_progress(bootstrap, 1, half)
            await report_progress(bootstrap, 8, *gangs)
            assert await until(incident_count, 24) == 24
            assert await until(half_window, "111") == "111"
            await asyncio.sleep(0.5)
        tracks = {
            r["job_id"]: json.loads(r["nodes"])
            for r in await conn.fetch(
                "SELECT job_id, nodes FROM health.straggler_tracks WHERE job_id = ANY($1)",
                [slow_job, steady_job],
            )
        }
    finally:
        await conn.close()
    got = await collect(bootstrap, (*OUT, topics.DEAD_LETTER), about(run), count=99, timeout_s=2)
    alerts = [env["payload"] for topic, env in got if topic == topics.ALERT_RAISED]
    dead = [env["payload"] for topic, env in got if topic == topics.DEAD_LETTER]
    assert len([t for t, _ in first if t == topics.ALERT_RAISED]) == 1
    # One for the whole incident: not per report, not after the restart; none for the steady.
    assert sorted(a["subject"] for a in alerts) == [f"g{run}-2", f"w{run}-2"]
    alert = next(a for a in alerts if a["subject"] == f"g{run}-2")
    assert (alert["subject"], alert["node_id"], alert["cluster"]) == (
        f"g{run}-2",
        f"g{run}-2",
        f"g{run}",
    )
    assert (alert["cause"], alert["severity"]) == ("straggler", "warning")
    # The third slow report opens the incident; the alert carries its count as its batch left
    # it, so slow reports read in the same batch (the service lingers 100 ms, these come about
    # 50 ms apart) count too: 3 up to the 8 of that round, depending on how they were batched.
    assert 3 <= alert["count"] <= 8, alert["count"]
    assert f"job {slow_job}'s replica 2 3.0x slower" in alert["suggested_action"]
    [letter] = dead
    assert letter["source_topic"] == topics.JOB_PROGRESS
    assert letter["error"].startswith("replicas.1.step_time_s")
    assert [t for t, _ in got if t in (topics.NODE_UNHEALTHY, topics.NODE_RECOVERED)] == []
    straggling = {
        job: [w["node_id"] for w in windows if w["straggling"]] for job, windows in tracks.items()
    }
    assert straggling == {slow_job: [f"g{run}-2"], steady_job: []}


async def test_with_quarantine_on_a_straggler_is_also_taken_out(
    service_env: dict[str, Any], tmp_path: Path
) -> None:
    run = uuid.uuid4().hex[:8]
    bootstrap = service_env["kafka_bootstrap"]
    doc = yaml.safe_load((ROOT / "examples" / "health.yaml").read_text())
    doc["straggler"]["quarantine"] = True
    rules = tmp_path / "health.yaml"
    rules.write_text(yaml.safe_dump(doc))
    async with running(create_app(settings(service_env, health_file=rules))):
        await asyncio.sleep(0.5)
        await report_progress(bootstrap, 6, (f"jq{run}", f"q{run}", STRAGGLE))
        first = kinds(await collect(bootstrap, OUT, about(run), count=2, timeout_s=10))
        await report_progress(bootstrap, 4, (f"jq{run}", f"q{run}", STRAGGLE))
        await asyncio.sleep(1.0)
    got = kinds(await collect(bootstrap, OUT, about(run), count=99, timeout_s=2))
    [sick] = first[topics.NODE_UNHEALTHY]
    assert (sick["node_id"], sick["cause"]) == (f"q{run}-2", "straggler")
    assert "3.0x slower" in sick["signals"][0]
    [alert] = got[topics.ALERT_RAISED]
    assert alert["alert_id"] == sick["incident_id"] and alert["cause"] == "straggler"
    assert len(got[topics.NODE_UNHEALTHY]) == 1


async def test_a_silence_whose_commit_is_in_doubt_is_announced_once(
    service_env: dict[str, Any],
) -> None:
    """A node goes silent; the database answers the commit of its quarantine with a dropped
    connection although the commit went through. Health reads its book back from the store
    before deciding again, so the node is quarantined and alerted on once (it used to decide
    the same silence again on the next check, with a second incident and alert)."""
    run = uuid.uuid4().hex[:8]
    bootstrap = service_env["kafka_bootstrap"]
    node = f"d{run}-1"
    app = create_app(settings(service_env))
    async with heartbeating(bootstrap, {node}) as beating, running(app):
        await asyncio.sleep(0.5)  # heard of, and heard
        monitor = app.state.monitor["monitor"]
        doubt = CommitInDoubt(
            monitor.relay, when=lambda tx: any(m.topic == topics.NODE_UNHEALTHY for m in tx.out)
        )
        monitor.relay = doubt
        beating.discard(node)  # silence from here on
        async with asyncio.timeout(30):
            await doubt.dropped.wait()
        await asyncio.sleep(1.5)  # fifteen more checks
        await doubt.publish_committed()
        records = await every_record(bootstrap, topics.NODE_UNHEALTHY)
        alerts = await every_record(bootstrap, topics.ALERT_RAISED)
    sick = [e for e in records if e["payload"].get("node_id") == node]
    raised = [e for e in alerts if e["payload"].get("subject") == node]
    assert len(sick) == 1, sick
    assert len(raised) == 1, raised
