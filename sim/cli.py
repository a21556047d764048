"""`qm sim`: replay a trace through several policies on a fleet and write figures.

`qm` imports this module to list and parse the command, so only what the command's signature
needs is imported here; the simulator itself (numpy, matplotlib, the scheduling core) is
imported when the command runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from sim.workload import SimJob

# ",".join(sim.variants.VARIANTS), spelled out so that `qm` need not import the scheduling core
# to show this default; tests/unit/cli/test_startup.py checks that the two agree.
ALL_VARIANTS = "fifo,fifo-backfill,default,las,learned"

console = Console()
errors = Console(stderr=True)


def load_jobs(trace: Path, window: str | None) -> list[SimJob]:
    """A Philly-format trace when it has a `timestamp` column, else our generic CSV."""
    from sim.workload import Window, WorkloadError, load_generic, load_philly

    if not trace.exists():
        raise WorkloadError(f"trace {trace} not found")
    with trace.open() as handle:
        header = handle.readline()
    if "timestamp" in header:
        return load_philly(trace, Window.parse(window))
    return load_generic(trace)


_PATH = click.Path(path_type=Path)


@click.command("sim", context_settings={"show_default": True})
@click.option("--trace", type=_PATH, required=True, help="philly.csv or a generic workload CSV")
@click.option("--policy", type=_PATH, default="examples/policy.yaml", help="policy YAML")
@click.option("--fleet", type=_PATH, help="fleet YAML (else --pool)")
@click.option("--pool", default="64x8", help="uniform pool NODESxACCELERATORS")
@click.option("--policies", default=ALL_VARIANTS, help="comma list")
@click.option("--window", help="YYYY-MM-DD:YYYY-MM-DD (Philly)")
@click.option("--quotas", type=_PATH, help="philly_vc_nodes.csv: per-tenant quotas scaled to fleet")
@click.option(
    "--interval",
    type=float,
    default=60.0,
    help="least virtual seconds between cycles (0: every event)",
)
@click.option("--out", type=_PATH, default="sim-out", help="output directory")
def sim(
    trace: Path,
    policy: Path,
    fleet: Path | None,
    pool: str,
    policies: str,
    window: str | None,
    quotas: Path | None,
    interval: float,
    out: Path,
) -> None:
    """Replay a trace through several policies on the scheduling core; write figures."""
    import yaml
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from core.errors import CoreError
    from core.policy import Policy
    from sim.fleet import Fleet, pool_fleet, read_fleet
    from sim.report import offered_load, write_outputs
    from sim.runner import compare, vc_entitlement
    from sim.variants import variant

    try:
        base = Policy.from_dict(yaml.safe_load(policy.read_text()) or {})
        names = [p.strip() for p in policies.split(",") if p.strip()]
        for name in names:
            variant(base, name)
        jobs = load_jobs(trace, window)

        def fleet_for(pol: Policy) -> Fleet:
            return read_fleet(fleet, pol) if fleet else pool_fleet(pool, pol)

        _, nodes = fleet_for(base)
    except (OSError, ValueError, CoreError, yaml.YAMLError) as exc:
        # WorkloadError and UnknownVariant are ValueErrors; PolicyError/FleetError CoreErrors.
        errors.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise click.exceptions.Exit(2) from None
    if not jobs:
        errors.print("[red]error:[/red] no jobs in that trace and window")
        raise click.exceptions.Exit(2)
    capacity = float(sum(n.accelerators for n in nodes.values() if n.healthy))
    load = offered_load(jobs, capacity)
    console.print(
        f"{len(jobs)} jobs on {len(nodes)} nodes / {capacity:g} accelerators; "
        f"offered load {load:.3f}; cycle interval {interval:g} s"
    )
    entitlement = (
        vc_entitlement(quotas, [j.request.tenant for j in jobs], capacity) if quotas else None
    )
    with Progress(
        TextColumn("{task.description:14s}"), BarColumn(), TimeElapsedColumn(), console=console
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
    print_summaries(result.summaries, console)
    meta = {
        "jobs": len(jobs),
        "offered_load": load,
        "accelerators": capacity,
        "window": window,
        "interval_s": interval,
        "quotas": str(quotas) if quotas else None,
    }
    for path in write_outputs(out, result.summaries, result.records, result.traces, meta):
        console.print(f"wrote {path}")


def print_summaries(summaries: Mapping[str, Mapping[str, Any]], out: Console) -> None:
    """Two narrow tables (job times, fleet) and one per-tenant table, to fit 80 columns (wall
    times are in the progress bars and in summary.json)."""
    fifo = summaries.get("fifo", {}).get("avg_jct_s")
    times = Table("policy", "avg JCT s", "p50 s", "p99 s", "vs fifo", "avg queue s", title="jobs")
    fleet = Table(
        "policy", "util", "util backlog", "preempt", "lost acc-h", "overcommit", title="fleet"
    )
    for name, s in summaries.items():
        ratio = f"{s['avg_jct_s'] / fifo:.3f}" if fifo else "-"
        times.add_row(
            name,
            f"{s['avg_jct_s']:.0f}",
            f"{s['p50_jct_s']:.0f}",
            f"{s['p99_jct_s']:.0f}",
            ratio,
            f"{s['avg_queueing_s']:.0f}",
        )
        fleet.add_row(
            name,
            f"{s['utilization']:.3f}",
            f"{s['utilization_backlog']:.3f}",
            str(s["preemptions"]),
            f"{s['lost_work_accelerator_s'] / 3600:.0f}",
            str(s["overcommit"]),
        )
    out.print(times)
    out.print(fleet)
    out.print(tenant_table(summaries))


def tenant_table(summaries: Mapping[str, Mapping[str, Any]]) -> Table:
    """Per tenant: quota as a share of all quotas, its share of the demand, and per policy the
    fraction of the fleet it held while some of its jobs waited."""
    table = Table("tenant", "entitled", "demand", title="fleet share held while waiting")
    for name in summaries:
        table.add_column(name)
    first: Mapping[str, Any] = next(iter(summaries.values()), {"tenants": {}})
    for tenant, figures in first["tenants"].items():
        row = [
            tenant,
            f"{figures['entitlement']:.3f}" if figures["entitlement"] else "-",
            f"{figures['share']:.3f}",
        ]
        for s in summaries.values():
            row.append(f"{s['tenants'].get(tenant, {}).get('share_backlogged', 0.0):.3f}")
        table.add_row(*row)
    return table
