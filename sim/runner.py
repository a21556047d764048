"""One comparison run: the same workload and fleet through several policies, with figures."""

from __future__ import annotations

import csv
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.model import JobId
from core.policy import Policy
from sim.engine import JobRecord, Simulation, Trace
from sim.fleet import Fleet
from sim.report import summarize
from sim.variants import variant, with_quotas
from sim.workload import SimJob


@dataclass
class Comparison:
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    records: dict[str, Mapping[JobId, JobRecord]] = field(default_factory=dict)
    traces: dict[str, Trace] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)


def compare(
    fleet_for: Callable[[Policy], Fleet],
    base: Policy,
    jobs: list[SimJob],
    policies: list[str],
    cycle_interval_s: float = 60.0,
    entitlement: Mapping[str, float] | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> Comparison:
    """Runs each named policy variant; with `entitlement` (nominal accelerators per tenant)
    every variant also gets those quotas, in one cohort."""
    result = Comparison()
    for name in policies:
        pol = variant(base, name)
        if entitlement:
            pol = with_quotas(pol, entitlement)
        clusters, nodes = fleet_for(pol)
        tick = None if progress is None else (lambda f, n=name: progress(n, f))
        started = time.perf_counter()
        sim = Simulation(clusters, nodes, pol, jobs, cycle_interval_s, tick)
        records = sim.run()
        result.wall_s[name] = time.perf_counter() - started
        result.records[name] = records
        result.traces[name] = sim.trace
        result.summaries[name] = summarize(records, sim.trace, entitlement)
        result.summaries[name]["wall_s"] = result.wall_s[name]
    return result


def vc_entitlement(path: Path, tenants: list[str], pool_accelerators: float) -> dict[str, float]:
    """Nominal quotas from philly_vc_nodes.csv, in proportion to each VC's nodes, scaled so that
    the quotas of the tenants present sum to the pool (a VC absent from the trace must not hold
    capacity nobody can use); tenants without a row get 0 and run only on what is lent."""
    with path.open(newline="") as handle:
        nodes = {row["vc"]: float(row["node num"]) for row in csv.DictReader(handle)}
    present = sorted(set(tenants))
    total = sum(nodes.get(t, 0.0) for t in present) or 1.0
    return {t: pool_accelerators * nodes.get(t, 0.0) / total for t in present}
