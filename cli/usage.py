"""`qm usage`: accelerator-hours and cost from the gateway's usage API, as a table, CSV or JSON."""

from __future__ import annotations

import csv
import json
import sys
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from cli.jobs import gateway
from cli.params import gateway_options, json_option
from cli.render import SafeTable

console = Console()

NUMBERS = ("accelerator_hours", "cost", "runs")


def _money(value: Any) -> str:
    return f"{float(value):,.2f}"


def _hours(value: Any) -> str:
    return f"{float(value):,.3f}"


def usage_table(report: dict[str, Any]) -> Table:
    """One row per group, a total line; hours to the thousandth, money to the cent."""
    dims = list(report.get("group_by") or [])
    total = report.get("total") or {}
    currency = total.get("currency") if isinstance(total.get("currency"), str) else ""
    table = SafeTable(
        title=f"usage {report.get('from', '?')} .. {report.get('to', '?')}",
        header_style="bold",
        show_footer=bool(report.get("rows")),
    )
    footers = {"accelerator_hours": _hours(total.get("accelerator_hours", 0))}
    footers["cost"] = _money(total.get("cost", 0))
    for i, dim in enumerate(dims):
        table.add_column(dim.replace("_", " "), footer="total" if i == 0 else "")
    table.add_column("accelerator-hours", justify="right", footer=footers["accelerator_hours"])
    table.add_column(f"cost {currency}".strip(), justify="right", footer=footers["cost"])
    table.add_column("runs", justify="right")
    for row in report.get("rows") or []:
        table.add_row(
            *(str(row.get(d) if row.get(d) is not None else "-") for d in dims),
            _hours(row["accelerator_hours"]),
            _money(row["cost"]),
            str(row.get("runs", "")),
        )
    return table


def efficiency_table(report: dict[str, Any]) -> Table:
    table = SafeTable(
        title=f"fleet efficiency {report.get('from', '?')} .. {report.get('to', '?')}",
        header_style="bold",
    )
    for column in ("cluster", "type"):
        table.add_column(column)
    for column in ("allocated acc-h", "idle acc-h", "efficiency", "idle cost"):
        table.add_column(column, justify="right")
    for r in report.get("rows") or []:
        eff = r.get("efficiency")
        table.add_row(
            r["cluster"],
            r["accelerator_type"],
            _hours(r["allocated_accelerator_seconds"] / 3600),
            _hours(r["idle_accelerator_seconds"] / 3600),
            "-" if eff is None else f"{eff:.1%}",
            _money(r["idle_cost"]),
        )
    return table


@click.command()
@click.option("--from", "start", help="Start, ISO date or time (default: start of this month).")
@click.option("--to", "end", help="End, exclusive (default: now).")
@click.option(
    "--group-by",
    "-g",
    default="tenant,project",
    help="Comma-separated: tenant, project, user, cluster, accelerator_type, "
    "price_tier, kind, job_id, day, month.",
)
@click.option("--tenant", help="Only this tenant (finance and admin tokens).")
@click.option("--kind", help="usage (no idle), idle, interval or close.")
@click.option("--efficiency", is_flag=True, help="Fleet efficiency per cluster and type instead.")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV.")
@json_option
@gateway_options
def usage(
    start: str | None,
    end: str | None,
    group_by: str,
    tenant: str | None,
    kind: str | None,
    efficiency: bool,
    as_csv: bool,
    as_json: bool,
    url: str | None,
    token: str | None,
) -> None:
    """Accelerator-hours and cost by tenant, project, user, cluster or type."""
    params = {k: v for k, v in (("from", start), ("to", end)) if v}
    with gateway(url, token) as client:
        if efficiency:
            report = client._call("GET", "/v1/usage/efficiency", params=params)
        else:
            params.update({"group_by": group_by, "format": "json"})
            params.update({k: v for k, v in (("tenant", tenant), ("kind", kind)) if v})
            report = client._call("GET", "/v1/usage", params=params)
    if as_json:
        print(json.dumps(report, indent=2))
    elif as_csv:
        rows = report.get("rows") or []
        columns = list(rows[0]) if rows else [*report.get("group_by", []), *NUMBERS]
        writer = csv.DictWriter(sys.stdout, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    elif efficiency:
        console.print(efficiency_table(report))
    else:
        console.print(usage_table(report))
