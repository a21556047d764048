"""`qm queues`, `qm nodes`, `qm node` and `qm top`: tenants' queues and the fleet's nodes from
the gateway's `GET /v1/queues`, `/v1/nodes` and `/v1/fleet`, as tables or a live terminal view."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import click
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from cli import out, render
from cli.client import GatewayClient
from cli.errors import GatewayError
from cli.jobs import gateway
from cli.params import gateway_options, json_option
from cli.render import SafeTable

console = Console()

DEVICE_MARKS = {
    "idle": ("·", "green"),
    "allocated": ("■", "yellow"),
    "held": ("□", "blue"),
    "quarantined": ("x", "bold red"),
    "cordoned": ("-", "magenta"),
}
NODE_STYLES = {
    "idle": "green",
    "partial": "yellow",
    "allocated": "yellow",
    "quarantined": "bold red",
    "cordoned": "magenta",
}
ACTIVE_STATES = ("submitted", "queued", "placed", "running", "preempting")
REFRESH_S = 2.0


def _num(value: Any) -> str:
    if value is None:
        return "-"
    number = float(value)
    return str(int(number)) if number.is_integer() else f"{number:.2f}"


def _share(value: Any) -> str:
    return "-" if value is None else f"{float(value):.0%}"


def _duration(seconds: Any) -> str:
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def devices_bar(devices: Sequence[Mapping[str, Any]]) -> Text:
    """One mark per device: · idle, ■ allocated, □ held for a gang, x quarantined, - cordoned."""
    bar = Text()
    for d in devices:
        mark, style = DEVICE_MARKS.get(str(d.get("state")), ("?", ""))
        bar.append(mark, style=style)
    return bar


# --- qm queues ---------------------------------------------------------------------------


def queues_view(report: Mapping[str, Any]) -> Group:
    tenants = report.get("tenants") or []
    summary = SafeTable(title="tenants", title_justify="left", header_style="bold")
    for column in ("tenant", "held", "fair share", "actual", "pending", "pending accel"):
        summary.add_column(column, justify="left" if column == "tenant" else "right")
    for column in ("wait p50", "wait p90", "preempted", "caused"):
        summary.add_column(column, justify="right")
    summary.add_column("pending because")
    for t in tenants:
        wait = t.get("wait") or {}
        reasons = ", ".join(f"{r['code']} {r['jobs']}" for r in t.get("pending_by_reason") or [])
        summary.add_row(
            t["tenant"],
            _num(t.get("usage")),
            _share(t.get("fair_share")),
            _share(t.get("actual_share")),
            str(t.get("pending_jobs", 0)),
            _num(t.get("pending_accelerators")),
            _duration(wait.get("p50_s")),
            _duration(wait.get("p90_s")),
            str(t.get("preemptions_received", 0)),
            str(t.get("preemptions_given", 0)),
            reasons or "-",
        )
    quotas = SafeTable(title="quota by accelerator type", title_justify="left", header_style="bold")
    quotas.add_column("tenant")
    quotas.add_column("type")
    for column in ("nominal", "held", "borrowed", "lent", "pending jobs", "pending accel"):
        quotas.add_column(column, justify="right")
    for t in tenants:
        for q in t.get("types") or []:
            quotas.add_row(
                t["tenant"],
                q["accelerator_type"],
                _num(q.get("nominal")),
                _num(q.get("usage")),
                Text(_num(q.get("borrowed")), style="yellow" if q.get("borrowed") else ""),
                _num(q.get("lent")),
                str(q.get("pending_jobs", 0)),
                _num(q.get("pending_accelerators")),
            )
    hours = float(report.get("window_s") or 0) / 3600
    footer = Text(
        f"wait and preemptions over the last {hours:g} h; fair share is the weight share among "
        "tenants with work, lent is the cohort's borrowing put down to unused quota",
        style="dim",
    )
    return Group(summary, quotas, footer)


@click.command()
@click.option("--hours", type=float, help="Window of wait times and preemptions (default 24).")
@json_option
@gateway_options
def queues(hours: float | None, as_json: bool, url: str | None, token: str | None) -> None:
    """Each tenant's quota, usage, borrowing, pending work, fair share and queue wait."""
    with gateway(url, token) as client:
        report = client.queues(hours)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        console.print(queues_view(report))


# --- qm nodes, qm node -------------------------------------------------------------------


def nodes_table(nodes: Sequence[Mapping[str, Any]]) -> Table:
    table = SafeTable(title=f"{len(nodes)} node(s)", title_justify="left", header_style="bold")
    for column in ("node", "cluster", "block/rack", "type", "state", "idle", "devices", "cause"):
        table.add_column(column, justify="right" if column == "idle" else "left")
    for n in nodes:
        state = str(n.get("state"))
        table.add_row(
            n["node_id"],
            n["cluster"],
            f"{n.get('block')}/{n.get('rack')}",
            n["accelerator_type"],
            Text(state, style=NODE_STYLES.get(state, "")),
            f"{n.get('idle', 0)}/{n.get('accelerators', 0)}",
            devices_bar(n.get("devices") or []),
            n.get("cause") or "",
        )
    return table


@click.command()
@click.option("--cluster", help="Only this cluster.")
@click.option("--type", "accelerator_type", help="Only this accelerator type.")
@click.option(
    "--state", help="Only nodes in this state: idle, partial, allocated, quarantined, cordoned."
)
@json_option
@gateway_options
def nodes(
    cluster: str | None,
    accelerator_type: str | None,
    state: str | None,
    as_json: bool,
    url: str | None,
    token: str | None,
) -> None:
    """The fleet's nodes: state, idle devices and one mark per device."""
    with gateway(url, token) as client:
        found = client.nodes(cluster, accelerator_type, state)
    if as_json:
        print(json.dumps(found, indent=2))
    else:
        console.print(nodes_table(found))


def node_view(detail: Mapping[str, Any]) -> Group:
    n = detail["node"]
    grid = SafeTable.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    state = str(n.get("state"))
    grid.add_row("node", n["node_id"])
    grid.add_row("state", Text(state, style=NODE_STYLES.get(state, "")))
    if n.get("cause"):
        since = out.when(detail.get("quarantined_since"))
        grid.add_row("quarantined", f"{n['cause']} since {since}")
    grid.add_row("where", f"{n['cluster']} / {n['block']} / {n['rack']} ({n['nvlink_domain']})")
    grid.add_row("devices", f"{n['accelerators']} x {n['accelerator_type']} ({n['price_tier']})")
    grid.add_row("in use", devices_bar(n.get("devices") or []))
    jobs = SafeTable(title="jobs on it", title_justify="left", header_style="bold")
    for column in ("job", "tenant", "state", "replicas", "accelerators", "devices"):
        jobs.add_column(column)
    for j in detail.get("jobs") or []:
        jobs.add_row(
            j.get("job_id") or "(another tenant's job)",
            j.get("tenant") or "-",
            render.state_text(j.get("state")),
            ", ".join(str(r) for r in j.get("replicas") or []),
            _num(j.get("accelerators")),
            ", ".join(str(d) for d in j.get("devices") or []) or "-",
        )
    health = SafeTable(title="health history", title_justify="left", header_style="bold")
    for column in ("at", "verdict", "cause", "incident", "detail"):
        health.add_column(column)
    for h in detail.get("health") or []:
        style = "red" if h.get("verdict") == "unhealthy" else "green"
        health.add_row(
            out.when(h.get("at")),
            Text(str(h.get("verdict")), style=style),
            h.get("cause") or "-",
            h.get("incident_id") or "-",
            h.get("detail") or "",
        )
    return Group(grid, Text(), jobs, health)


@click.command()
@click.argument("node_id")
@json_option
@gateway_options
def node(node_id: str, as_json: bool, url: str | None, token: str | None) -> None:
    """One node: its devices, the jobs on it and its health history."""
    with gateway(url, token) as client:
        detail = client.node(node_id)
    if as_json:
        print(json.dumps(detail, indent=2))
    else:
        console.print(node_view(detail))


# --- qm top ------------------------------------------------------------------------------


def top_frame(fleet: Mapping[str, Any], report: Mapping[str, Any], *, source: str = "") -> Group:
    """One frame of `qm top`: accelerators by type, jobs by state, the tenants holding the most,
    the oldest pending jobs and where common gang shapes fit now."""
    stamp = datetime.now(UTC).astimezone().strftime("%H:%M:%S")
    head = Text(f"Quartermaster  {source}  {stamp}", style="bold")
    types = SafeTable(title="accelerators", title_justify="left", header_style="bold", box=None)
    types.add_column("type")
    for column in ("total", "allocated", "held", "idle", "unhealthy", "use"):
        types.add_column(column, justify="right")
    for t in fleet.get("totals") or []:
        total = t.get("total") or 0
        types.add_row(
            t["accelerator_type"],
            str(total),
            str(t.get("allocated", 0)),
            str(t.get("held", 0)),
            str(t.get("idle", 0)),
            Text(str(t.get("unhealthy", 0)), style="red" if t.get("unhealthy") else ""),
            _share(t.get("allocated", 0) / total if total else None),
        )
    tenants = list(report.get("tenants") or [])
    counts: dict[str, int] = {}
    for t in tenants:
        for state, n in (t.get("jobs_by_state") or {}).items():
            counts[state] = counts.get(state, 0) + int(n)
    states = Text("jobs  ")
    for state in (*ACTIVE_STATES, *sorted(set(counts) - set(ACTIVE_STATES))):
        states.append_text(render.state_text(state)).append(f" {counts.get(state, 0)}   ")
    busiest = SafeTable(title="top tenants", title_justify="left", header_style="bold", box=None)
    busiest.add_column("tenant")
    for column in ("held", "fair share", "actual", "pending", "wait p50"):
        busiest.add_column(column, justify="right")
    for t in sorted(tenants, key=lambda t: (-float(t.get("usage") or 0), t["tenant"]))[:8]:
        busiest.add_row(
            t["tenant"],
            _num(t.get("usage")),
            _share(t.get("fair_share")),
            _share(t.get("actual_share")),
            str(t.get("pending_jobs", 0)),
            _duration((t.get("wait") or {}).get("p50_s")),
        )
    oldest = SafeTable(title="oldest pending", title_justify="left", header_style="bold", box=None)
    for column in ("job", "tenant", "waiting", "because"):
        oldest.add_column(column)
    waiting = [(t["tenant"], t["oldest_pending"]) for t in tenants if t.get("oldest_pending")]
    for tenant, job in sorted(waiting, key=lambda w: -float(w[1].get("waiting_s") or 0))[:5]:
        oldest.add_row(
            job.get("job_id") or "(not yours to see)",
            tenant,
            _duration(job.get("waiting_s")),
            ", ".join(job.get("codes", [])),
        )
    fits = Text("fits now  ")
    for f in fleet.get("fragmentation") or []:
        fits.append(f"{f['devices']}x{f['accelerator_type']}:{f['fits']}  ")
    return Group(head, Text(), types, Text(), states, Text(), busiest, Text(), oldest, fits)


def _frame(client: GatewayClient) -> Group:
    return top_frame(client.fleet(cells=False), client.queues(), source=client.base)


def _frame_or_error(client: GatewayClient) -> Group:
    # A live view outlasts a gateway restart: the error shows until the gateway answers again.
    try:
        return _frame(client)
    except GatewayError as exc:
        return Group(Text(f"Quartermaster  {client.base}", style="bold"), Text(str(exc), "red"))


def live(
    draw: Callable[[], Group], *, every_s: float = REFRESH_S, sleep: Callable[[float], None]
) -> None:
    """Redraw in place until Ctrl-C (the terminal keeps the last frame)."""
    from rich.live import Live

    with Live(draw(), console=console, screen=False, auto_refresh=False) as view:
        while True:
            sleep(every_s)
            view.update(draw(), refresh=True)


@click.command()
@click.option("--once", is_flag=True, help="Print one frame and exit.")
@click.option("--every", type=float, default=REFRESH_S, help="Seconds between refreshes.")
@gateway_options
def top(once: bool, every: float, url: str | None, token: str | None) -> None:
    """A live view of the fleet and the queues, refreshed every 2 s; Ctrl-C leaves."""
    with gateway(url, token) as client:
        if once:
            console.print(_frame(client))
            return
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is the way out
            live(lambda: _frame_or_error(client), every_s=max(every, 0.5), sleep=time.sleep)
