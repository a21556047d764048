"""`qm pools`: the fleet's elastic node pools, the autoscaler's last decisions and the work
waiting for capacity, from the gateway's `GET /v1/pools`."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console, Group
from rich.text import Text

from cli.jobs import gateway
from cli.params import gateway_options, json_option
from cli.render import SafeTable

console = Console()


def pools_view(report: dict[str, Any]) -> Group:
    table = SafeTable(title="elastic pools", title_justify="left", header_style="bold")
    for column in ("cluster", "pool", "type", "tier", "ready", "coming", "busy", "desired"):
        table.add_column(
            column, justify="right" if column in ("ready", "coming", "busy") else "left"
        )
    table.add_column("min..max", justify="right")
    table.add_column("last decision")
    for p in report.get("pools") or []:
        last = (p.get("decisions") or [None])[0]
        said = f"{last['at'][11:19]} {last['reason']}" if last else "-"
        if p.get("failing"):
            said = f"FAILING: {p['failing']}; {said}"
        table.add_row(
            p["cluster"],
            p["pool"],
            f"{p['accelerator_type']} x {p['accelerators_per_node']}",
            p["price_tier"],
            str(p["ready"]),
            str(p["provisioning"]),
            str(p["busy"]),
            str(p["desired_nodes"]),
            f"{p['min_nodes']}..{p['max_nodes']}",
            Text(said, style="red" if p.get("failing") else ""),
        )
    shapes = SafeTable(title="waiting for capacity", title_justify="left", header_style="bold")
    for column in ("replicas", "accelerators each", "types", "jobs"):
        shapes.add_column(column, justify="right" if column != "types" else "left")
    for s in report.get("waiting_for_capacity") or []:
        shapes.add_row(
            str(s["replicas"]),
            f"{s['accelerators']:g}",
            ", ".join(s["accelerator_types"]) or "any",
            str(s["jobs"]),
        )
    footer = Text(
        f"{report.get('waiting_jobs', 0)} of {report.get('pending_jobs', 0)} pending jobs "
        "wait for capacity alone"
    )
    return Group(table, shapes, footer)


@click.command()
@json_option
@gateway_options
def pools(as_json: bool, url: str | None, token: str | None) -> None:
    """Show the elastic node pools: size, nodes coming, last decision, waiting demand."""
    with gateway(url, token) as client:
        report = client.pools()
    if as_json:
        console.print_json(json.dumps(report))
    else:
        console.print(pools_view(report))
