"""`qm queues`, `qm nodes`, `qm node` and `qm top` against a fake gateway answering with the
real response models of services/gateway/fleet.py and queues.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import httpx
import pytest
from click.testing import CliRunner
from rich.console import Group
from rich.text import Text

import cli.fleet
from cli.client import GatewayClient
from cli.errors import GatewayError
from cli.main import app
from services.gateway.fleet import (
    DeviceCell,
    FleetView,
    FragmentationLine,
    HealthEntry,
    NodeCell,
    NodeDetail,
    NodeJob,
    NodesView,
    TypeTotals,
)
from services.gateway.occupancy import DeviceState, NodeState
from services.gateway.queues import (
    OldestPending,
    QueuesView,
    ReasonCount,
    TenantQueue,
    TypeQueue,
    WaitStats,
)
from tests.unit.cli.gateway_double import serving
from tests.unit.cli.test_startup import HEAVY, among, loaded_after

AT = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def cell(node_id: str, states: str, state: NodeState, cause: str | None = None) -> NodeCell:
    marks = {".": DeviceState.IDLE, "A": DeviceState.ALLOCATED, "Q": DeviceState.QUARANTINED}
    return NodeCell(
        node_id=node_id,
        cluster="c1",
        block="b0",
        rack="r0",
        nvlink_domain="nv0",
        accelerator_type="H100",
        accelerators=len(states),
        price_tier="on_demand",
        state=state,
        allocated=states.count("A"),
        idle=states.count("."),
        cause=cause,
        devices=[
            DeviceCell(index=i, state=marks[m], used=1.0 if m == "A" else 0.0, jobs=[])
            for i, m in enumerate(states)
        ],
    )


NODES = NodesView(
    nodes=[
        cell("c1-h100-0", "AAAA....", NodeState.PARTIAL),
        cell("c1-h100-1", "QQQQQQQQ", NodeState.QUARANTINED, cause="xid_79"),
    ]
)
DETAIL = NodeDetail(
    node=NODES.nodes[1],
    quarantined_since=AT,
    health=[
        HealthEntry(
            verdict="unhealthy", cause="xid_79", incident_id="inc-2", detail="gpu_xid 79", at=AT
        ),
        HealthEntry(
            verdict="recovered", cause="ecc", incident_id="inc-1", detail="recovered", at=AT
        ),
    ],
    jobs=[
        NodeJob(
            job_id="j-mine", tenant="vision", state="running", replicas=[0], accelerators=4,
            devices=[0, 1, 2, 3],
        ),
        NodeJob(
            job_id=None, tenant=None, state="running", replicas=[1], accelerators=4,
            devices=[4, 5, 6, 7],
        ),
    ],
)  # fmt: skip
FLEET = FleetView(
    clusters=[],
    totals=[
        TypeTotals(
            accelerator_type="H100", total=16, allocated=4, held=0, idle=4, unhealthy=8,
            quarantined=8, cordoned=0, in_use=4,
        )
    ],
    fragmentation=[
        FragmentationLine(accelerator_type="H100", devices=4, fits=1, nodes=1, by_cluster={"c1": 1})
    ],
    at=AT,
)  # fmt: skip


def tenant(name: str, usage: float, **over: Any) -> TenantQueue:
    fields: dict[str, Any] = {
        "tenant": name,
        "weight": 1.0,
        "cohort": "research",
        "usage": usage,
        "fair_share": 0.5,
        "actual_share": usage / 20,
        "types": [
            TypeQueue(
                accelerator_type="H100", nominal=8, usage=usage, borrowed=max(0, usage - 8),
                lent=0, pending_jobs=1, pending_accelerators=8,
            )
        ],
        "pending_jobs": 1,
        "pending_accelerators": 8,
        "pending_by_reason": [ReasonCount(code="quota_exhausted", jobs=1, accelerators=8)],
        "jobs_by_state": {"running": 2, "queued": 1, "succeeded": 4},
        "wait": WaitStats(starts=3, p50_s=42, p90_s=600, p99_s=700, max_s=700),
        "preemptions_received": 1,
        "preemptions_given": 2,
        **over,
    }  # fmt: skip
    return TenantQueue.model_validate(fields)


QUEUES = QueuesView(
    tenants=[
        tenant("vision", 12),
        tenant(
            "nlp",
            8,
            oldest_pending=OldestPending(
                job_id="j-old", submitted_at=AT, waiting_s=5400, codes=["quota_exhausted"]
            ),
        ),
    ],
    window_s=86400,
    since=AT,
    at=AT,
)


def answer(request: httpx.Request) -> httpx.Response:
    path = request.url.path
    if path == "/v1/nodes":
        return httpx.Response(200, json=NODES.model_dump(mode="json"))
    if path == "/v1/nodes/c1-h100-1":
        return httpx.Response(200, json=DETAIL.model_dump(mode="json"))
    if path.startswith("/v1/nodes/"):
        return httpx.Response(404, json={"detail": "no node x in any cluster's inventory"})
    if path == "/v1/fleet":
        return httpx.Response(200, json=FLEET.model_dump(mode="json"))
    if path == "/v1/queues":
        return httpx.Response(200, json=QUEUES.model_dump(mode="json"))
    return httpx.Response(404, json={"detail": "Not Found"})


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[httpx.Request]]:
    monkeypatch.setenv("QM_STATE_DIR", "/nonexistent")
    monkeypatch.setenv("COLUMNS", "200")
    with serving(answer) as double:
        monkeypatch.setenv("QM_GATEWAY_URL", double.url)
        yield double.requests


def run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_nodes_sends_the_filters_and_marks_each_device(seen: list[httpx.Request]) -> None:
    result = run("nodes", "--cluster", "c1", "--type", "H100", "--state", "quarantined")
    assert result.exit_code == 0, result.output
    assert dict(seen[0].url.params) == {"cluster": "c1", "type": "H100", "state": "quarantined"}
    assert "c1-h100-1" in result.output and "xid_79" in result.output
    assert "■■■■····" in result.output and "xxxxxxxx" in result.output
    assert "4/8" in result.output


def test_node_shows_its_jobs_anonymously_when_not_ours_and_its_history(
    seen: list[httpx.Request],
) -> None:
    result = run("node", "c1-h100-1")
    assert result.exit_code == 0, result.output
    assert "j-mine" in result.output and "(another tenant's job)" in result.output
    assert "inc-2" in result.output and "inc-1" in result.output
    assert "xid_79 since" in result.output


def test_an_unknown_node_is_an_error(seen: list[httpx.Request]) -> None:
    result = run("node", "nope")
    assert result.exit_code == 1
    assert "no node x in any cluster's inventory" in result.output


def test_queues_table_and_json(seen: list[httpx.Request]) -> None:
    result = run("queues", "--hours", "6")
    assert result.exit_code == 0, result.output
    assert seen[0].url.params["hours"] == "6.0"
    for text in ("vision", "nlp", "quota_exhausted 1", "42s", "10m", "60%", "50%"):
        assert text in result.output, text
    raw = run("queues", "--json")
    assert json.loads(raw.output) == QUEUES.model_dump(mode="json")


def test_top_once_prints_one_frame(seen: list[httpx.Request]) -> None:
    result = run("top", "--once")
    assert result.exit_code == 0, result.output
    assert [(r.url.path, dict(r.url.params)) for r in seen] == [
        ("/v1/fleet", {"cells": "false"}),
        ("/v1/queues", {}),
    ]
    out = result.output
    assert "H100" in out and "16" in out  # fleet totals
    assert "running 4" in out and "queued 2" in out and "succeeded 8" in out  # summed
    assert out.index("vision") < out.index("nlp")  # most accelerators held first
    assert "j-old" in out and "90m" in out  # the oldest pending job
    assert "4xH100:1" in out


def test_the_live_view_redraws_until_ctrl_c() -> None:
    frames: list[int] = []
    sleeps: list[float] = []

    def draw() -> Group:
        frames.append(len(frames))
        return Group(Text(f"frame {len(frames)}"))

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cli.fleet.live(draw, every_s=2.0, sleep=sleep)
    assert sleeps == [2.0, 2.0, 2.0] and len(frames) == 3


def test_top_leaves_quietly_on_ctrl_c_and_outlasts_a_gateway_error(
    seen: list[httpx.Request], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}

    def sleep(_seconds: float) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    real = cli.fleet._frame

    def flaky(client: GatewayClient) -> Group:
        if calls["n"] == 1:
            raise GatewayError("cannot reach the gateway")
        return real(client)

    monkeypatch.setattr(time, "sleep", sleep)
    monkeypatch.setattr(cli.fleet, "_frame", flaky)
    result = run("top")
    assert result.exit_code == 0, result.output
    assert "cannot reach the gateway" in result.output


def test_qm_top_loads_nothing_heavy(tmp_path: Path) -> None:
    modules = loaded_after(["top", "--once", "--gateway", "http://127.0.0.1:1"], tmp_path=tmp_path)
    assert "cli.fleet" in modules and "http.client" in modules
    assert among(modules, HEAVY) == []


def test_every_command_is_registered() -> None:
    ctx = click.Context(app)
    names = app.list_commands(ctx)
    assert {"queues", "nodes", "node", "top"} <= set(names)
    for name in names:  # each name the help lists runs the command of that name
        command = app.get_command(ctx, name)
        assert command is not None and command.name == name


ROOT = Path(__file__).resolve().parents[3]


def root_help(columns: int) -> str:
    # A fresh interpreter: click's test runner forces 80 columns.
    return subprocess.run(
        [sys.executable, "-c", "from cli.main import app; app(['--help'], prog_name='qm')"],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": str(columns)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


def test_the_root_help_uses_a_wide_terminal_for_whole_summaries() -> None:
    # click reads the terminal's width (COLUMNS here) and stops at the group's maximum.
    wide = root_help(200)
    assert "Start Kafka, PostgreSQL, Redis and every service; Ctrl-C stops everything." in wide
    assert max(len(line) for line in wide.splitlines()) <= 120
    assert "Ctrl-C stops everything" not in root_help(80)  # cut to fit, with "..."
