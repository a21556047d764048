"""Figures from a finished simulation: JCT, queueing, makespan, utilization, per-tenant share
against entitlement, preemptions and lost work; written as JSON, CSV and PNG."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from core.model import JobId, TenantId
from sim.engine import JobRecord, Trace
from sim.workload import SimJob


def offered_load(jobs: Iterable[SimJob], capacity: float) -> float:
    """Accelerator-seconds demanded over capacity across the submission span."""
    jobs = list(jobs)
    if not jobs or capacity <= 0:
        return 0.0
    submits = [j.request.submit_time for j in jobs]
    span = max(submits) - min(submits)
    demand = sum(j.request.total_accelerators * j.duration_s for j in jobs)
    return demand / (capacity * span) if span > 0 else float("inf")


def summarize(
    records: Mapping[JobId, JobRecord],
    trace: Trace,
    entitlement: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    done = [r for r in records.values() if r.finish is not None]
    jct = np.array([r.finish - r.job.request.submit_time for r in done if r.finish is not None])
    queueing = np.array(
        [r.first_start - r.job.request.submit_time for r in done if r.first_start is not None]
    )
    first_submit = min((r.job.request.submit_time for r in records.values()), default=0.0)
    makespan = max((r.finish or 0.0 for r in done), default=0.0) - first_submit
    return {
        "jobs": len(records),
        "finished": len(done),
        "avg_jct_s": _stat(jct, "mean"),
        "p50_jct_s": _stat(jct, 50),
        "p99_jct_s": _stat(jct, 99),
        "avg_queueing_s": _stat(queueing, "mean"),
        "p99_queueing_s": _stat(queueing, 99),
        "makespan_s": makespan,
        "utilization": trace.busy_integral / (trace.capacity * makespan) if makespan > 0 else 0.0,
        "utilization_backlog": (
            trace.backlog_busy_integral / (trace.capacity * trace.backlog_time)
            if trace.backlog_time > 0
            else 0.0
        ),
        "preemptions": trace.preemptions,
        "lost_work_accelerator_s": trace.lost_work,
        "overcommit": trace.overcommit,
        "cycles": trace.cycles,
        "tenants": tenant_shares(trace, entitlement or {}),
    }


def tenant_shares(trace: Trace, entitlement: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Per tenant: `share` of all accelerator-seconds used (once every job has finished this is
    its share of the demand, whatever the policy), `entitlement` (its quota as a fraction of
    all quotas), and `share_backlogged`, the fraction of the fleet it held on average while
    some of its jobs were waiting: what quotas and fair share actually decide."""
    busy = trace.tenant_busy
    total_busy = sum(busy.values()) or 1.0
    total_quota = sum(entitlement.values()) or 1.0
    names = sorted(set(busy) | set(entitlement))
    out = {}
    for t in names:
        tenant = TenantId(t)
        waited = trace.tenant_backlog_time.get(tenant, 0.0)
        held = trace.tenant_backlog_busy.get(tenant, 0.0)
        out[t] = {
            "share": busy.get(tenant, 0.0) / total_busy,
            "entitlement": entitlement.get(t, 0.0) / total_quota if entitlement else 0.0,
            "share_backlogged": held / (trace.capacity * waited) if waited > 0 else 0.0,
            "backlogged_s": waited,
        }
    return out


def _stat(values: np.ndarray[Any, Any], which: str | int) -> float:
    if values.size == 0:
        return 0.0
    if isinstance(which, str):
        return float(values.mean())
    return float(np.percentile(values, which))


def write_outputs(
    out: Path,
    summaries: Mapping[str, dict[str, Any]],
    records: Mapping[str, Mapping[JobId, JobRecord]],
    traces: Mapping[str, Trace],
    meta: Mapping[str, Any],
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "summary.json", out / "jobs.csv", out / "utilization.csv"]
    (out / "summary.json").write_text(json.dumps({**meta, "policies": summaries}, indent=2))
    with (out / "jobs.csv").open("w", newline="") as handle:
        rows = csv.writer(handle)
        rows.writerow(
            [
                "policy",
                "job_id",
                "tenant",
                "accelerators",
                "submit_s",
                "first_start_s",
                "finish_s",
                "jct_s",
                "preemptions",
            ]
        )
        for name, recs in records.items():
            for r in recs.values():
                req = r.job.request
                jct = "" if r.finish is None else r.finish - req.submit_time
                rows.writerow(
                    [
                        name,
                        req.job_id,
                        req.tenant,
                        req.total_accelerators,
                        req.submit_time,
                        r.first_start,
                        r.finish,
                        jct,
                        r.preemptions,
                    ]
                )
    with (out / "utilization.csv").open("w", newline="") as handle:
        rows = csv.writer(handle)
        rows.writerow(["policy", "hour", "utilization"])
        for name, trace in traces.items():
            for hour, busy in sorted(trace.hourly_busy.items()):
                rows.writerow([name, hour, busy / (3600.0 * trace.capacity)])
    written += _plots(out, summaries, records, traces)
    return written


def _plots(
    out: Path,
    summaries: Mapping[str, dict[str, Any]],
    records: Mapping[str, Mapping[JobId, JobRecord]],
    traces: Mapping[str, Trace],
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, recs in records.items():
        jct = np.sort([r.finish - r.job.request.submit_time for r in recs.values() if r.finish])
        if jct.size:
            ax.plot(jct, np.arange(1, jct.size + 1) / jct.size, label=name)
    ax.set(xscale="log", xlabel="job completion time (s)", ylabel="fraction of jobs")
    ax.legend()
    fig.savefig(out / "jct_cdf.png", dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4))
    for name, trace in traces.items():
        hours = sorted(trace.hourly_busy)
        util = [trace.hourly_busy[h] / (3600.0 * trace.capacity) for h in hours]
        ax.plot(np.array(hours) / 24.0, util, label=name, linewidth=0.7)
    ax.set(xlabel="day", ylabel="utilization", ylim=(0, 1.05))
    ax.legend()
    fig.savefig(out / "utilization.png", dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(len(summaries), 1)
    tenants = sorted({t for s in summaries.values() for t in s["tenants"]})
    x = np.arange(len(tenants))
    for i, (name, summary) in enumerate(summaries.items()):
        held = [summary["tenants"].get(t, {}).get("share_backlogged", 0.0) for t in tenants]
        ax.bar(x + i * width, held, width, label=f"{name}: held while waiting")
    first: Mapping[str, Any] = next(iter(summaries.values()), {"tenants": {}})
    centre = x + 0.4 - width / 2
    demand = [first["tenants"].get(t, {}).get("share", 0.0) for t in tenants]
    ax.scatter(centre, demand, color="grey", marker="o", s=20, label="share of demand")
    ent = [first["tenants"].get(t, {}).get("entitlement", 0.0) for t in tenants]
    if any(ent):
        ax.scatter(centre, ent, color="black", marker="_", s=300, label="entitlement")
    ax.set_xticks(centre, tenants, rotation=45, ha="right")
    ax.set(ylabel="fraction of the fleet")
    ax.legend(fontsize="small")
    fig.savefig(out / "tenant_share.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [out / "jct_cdf.png", out / "utilization.png", out / "tenant_share.png"]
