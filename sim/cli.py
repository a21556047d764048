"""`qm sim`: replay a trace through several policies on a fleet and write figures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from core.policy import Policy
from sim.fleet import pool_fleet, read_fleet
from sim.report import offered_load, write_outputs
from sim.runner import compare, vc_entitlement
from sim.workload import SimJob, Window, WorkloadError, load_generic, load_philly

sim_app = typer.Typer(help="Discrete-event simulation on the scheduling core.")
console = Console()


def load_jobs(trace: Path, window: str | None) -> list[SimJob]:
    """A Philly-format trace when it has a `timestamp` column, else our generic CSV."""
    with trace.open() as handle:
        header = handle.readline()
    if "timestamp" in header:
        return load_philly(trace, Window.parse(window))
    return load_generic(trace)


@sim_app.callback(invoke_without_command=True)
def sim(
    trace: Annotated[Path, typer.Option(help="philly.csv or a generic workload CSV")],
    policy: Annotated[Path, typer.Option(help="policy YAML")] = Path("examples/policy.yaml"),
    fleet: Annotated[Path | None, typer.Option(help="fleet YAML (else --pool)")] = None,
    pool: Annotated[str, typer.Option(help="uniform pool NODESxACCELERATORS")] = "64x8",
    policies: Annotated[str, typer.Option(help="comma list")] = "fifo,fifo-backfill,default,las",
    window: Annotated[str | None, typer.Option(help="YYYY-MM-DD:YYYY-MM-DD")] = None,
    quotas: Annotated[
        Path | None, typer.Option(help="philly_vc_nodes.csv: per-tenant quotas scaled to fleet")
    ] = None,
    interval: Annotated[float, typer.Option(help="seconds between cycles")] = 60.0,
    out: Annotated[Path, typer.Option(help="output directory")] = Path("sim-out"),
) -> None:
    base = Policy.from_dict(yaml.safe_load(policy.read_text()) or {})
    try:
        jobs = load_jobs(trace, window)
    except WorkloadError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None

    def fleet_for(pol: Policy) -> tuple[dict, dict]:  # type: ignore[type-arg]
        return read_fleet(fleet, pol) if fleet else pool_fleet(pool, pol)

    _, nodes = fleet_for(base)
    capacity = float(sum(n.accelerators for n in nodes.values()))
    load = offered_load(jobs, capacity)
    console.print(
        f"{len(jobs)} jobs on {len(nodes)} nodes / {capacity:g} accelerators; "
        f"offered load {load:.3f}"
    )
    entitlement = (
        vc_entitlement(quotas, [j.request.tenant for j in jobs], capacity) if quotas else None
    )
    names = [p.strip() for p in policies.split(",") if p.strip()]
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        tasks = {n: bar.add_task(n, total=1.0) for n in names}
        result = compare(
            fleet_for,
            base,
            jobs,
            names,
            interval,
            entitlement,
            lambda n, f: bar.update(tasks[n], completed=f),
        )
    _print(result.summaries)
    meta = {
        "jobs": len(jobs),
        "offered_load": load,
        "accelerators": capacity,
        "window": window,
        "interval_s": interval,
    }
    for path in write_outputs(out, result.summaries, result.records, result.traces, meta):
        console.print(f"wrote {path}")


def _print(summaries: dict[str, dict]) -> None:  # type: ignore[type-arg]
    fifo = summaries.get("fifo", {}).get("avg_jct_s")
    table = Table(
        "policy",
        "avg JCT s",
        "p50",
        "p99",
        "vs fifo",
        "avg queue s",
        "util",
        "util backlog",
        "preempt",
        "lost acc-s",
        "overcommit",
        "wall s",
    )
    for name, s in summaries.items():
        ratio = f"{s['avg_jct_s'] / fifo:.3f}" if fifo else "-"
        table.add_row(
            name,
            f"{s['avg_jct_s']:.0f}",
            f"{s['p50_jct_s']:.0f}",
            f"{s['p99_jct_s']:.0f}",
            ratio,
            f"{s['avg_queueing_s']:.0f}",
            f"{s['utilization']:.3f}",
            f"{s['utilization_backlog']:.3f}",
            str(s["preemptions"]),
            f"{s['lost_work_accelerator_s']:.0f}",
            str(s["overcommit"]),
            f"{s['wall_s']:.1f}",
        )
    console.print(table)
    for name, s in summaries.items():
        shares = ", ".join(
            f"{t} {v['share']:.3f}/{v['entitlement']:.3f}" for t, v in s["tenants"].items()
        )
        console.print(f"[bold]{name}[/bold] tenant share/entitlement: {shares}")
