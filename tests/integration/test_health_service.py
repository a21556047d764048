"""The health service on the real broker and PostgreSQL: a critical XID, a flapping node,
silence (one node and a whole cluster), recovery after the clean period, and a restart that
neither re-alerts nor forgets a quarantine. Timings are seconds here, minutes in production."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg

from schemas import topics
from schemas.envelope import Envelope
from services.health.app import create_app
from services.health.settings import HealthSettings
from tests.integration.conftest import running
from tests.integration.kafka_tools import collect, produce

OUT = (topics.NODE_UNHEALTHY, topics.NODE_RECOVERED, topics.ALERT_RAISED)
BEAT_EVERY_S = 0.25


def settings(env: dict[str, Any]) -> HealthSettings:
    return HealthSettings(
        **env,
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
    """Heartbeats for every node in the (mutable) set, every BEAT_EVERY_S, until the block ends."""

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
