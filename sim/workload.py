"""Workloads for the simulator: the Philly trace (as derived for Pollux) and our own generic CSV,
both turned into core `JobRequest`s plus the true run time only the simulator knows."""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from core.model import JobId, JobRequest, TenantId, TopologyLevel, WorkloadKind

GENERIC_COLUMNS = (
    "job_id,submit_s,duration_s,tenant,replicas,accelerators,accelerator_type,"
    "priority_class,preemptible"
)


class WorkloadError(ValueError):
    """A trace file is missing or malformed; the message says which and where."""


@dataclass(frozen=True)
class SimJob:
    request: JobRequest
    # Seconds of work at relative speed 1.0; never shown to the scheduler.
    duration_s: float


@dataclass(frozen=True)
class Window:
    """Submission window [start, end) as wall-clock datetimes; None bounds are open."""

    start: datetime | None = None
    end: datetime | None = None

    @classmethod
    def parse(cls, text: str | None) -> Window:
        """'2017-10-01:2017-11-30' (end date inclusive) or empty for the whole trace."""
        if not text:
            return cls()
        first, _, last = text.partition(":")
        start = datetime.fromisoformat(first) if first else None
        end = datetime.fromisoformat(last) if last else None
        if end is not None and len(last) <= 10:
            end = end.replace(hour=23, minute=59, second=59)
        return cls(start, end)

    def contains(self, moment: datetime) -> bool:
        return (self.start is None or moment >= self.start) and (
            self.end is None or moment <= self.end
        )


def gang_shape(gpus: int, node_size: int = 8) -> tuple[int, int]:
    """(replicas, accelerators per replica): up to a node is one replica; beyond, whole-node
    replicas when the count divides, else the largest power-of-two divisor below a node."""
    if gpus <= node_size:
        return 1, gpus
    size = node_size
    while size > 1 and gpus % size:
        size //= 2
    return gpus // size, size


def load_philly(path: Path, window: Window = Window(), node_size: int = 8) -> list[SimJob]:
    """Philly rows in the window, submit times in seconds from the window's first submission."""
    if not path.exists():
        raise WorkloadError(f"trace {path} not found (see shared/traces/README.md)")
    rows = []
    with path.open(newline="") as handle:
        for line, row in enumerate(csv.DictReader(handle), start=2):
            try:
                submitted = datetime.fromisoformat(row["timestamp"])
                duration, gpus = float(row["duration"]), int(float(row["num_gpus"]))
            except (KeyError, ValueError) as exc:
                raise WorkloadError(f"{path}:{line}: {exc}") from None
            if window.contains(submitted) and duration > 0 and gpus > 0:
                rows.append((submitted, line, duration, gpus, row["cluster"]))
    rows.sort()
    if not rows:
        return []
    origin = window.start or rows[0][0]
    jobs = []
    for submitted, line, duration, gpus, vc in rows:
        replicas, per = gang_shape(gpus, node_size)
        request = _request(
            f"philly-{line:06d}", (submitted - origin).total_seconds(), vc, replicas, per
        )
        jobs.append(SimJob(request, duration))
    return jobs


def load_generic(path: Path) -> list[SimJob]:
    """Our own CSV format; header: """ + GENERIC_COLUMNS
    if not path.exists():
        raise WorkloadError(f"workload {path} not found")
    jobs = []
    with path.open(newline="") as handle:
        for line, row in enumerate(csv.DictReader(handle), start=2):
            try:
                request = _request(
                    row["job_id"],
                    float(row["submit_s"]),
                    row["tenant"],
                    int(row["replicas"]),
                    float(row["accelerators"]),
                    types=(row["accelerator_type"],) if row.get("accelerator_type") else (),
                    priority=row.get("priority_class") or "normal",
                    preemptible=(row.get("preemptible") or "true").lower() != "false",
                )
                jobs.append(SimJob(request, float(row["duration_s"])))
            except (KeyError, ValueError) as exc:
                raise WorkloadError(f"{path}:{line}: {exc!r}") from None
    jobs.sort(key=lambda j: (j.request.submit_time, j.request.job_id))
    return jobs


def write_generic(path: Path, jobs: Iterable[SimJob]) -> None:
    with path.open("w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(GENERIC_COLUMNS.split(","))
        for j in jobs:
            r = j.request
            types = r.accelerator_types[0] if r.accelerator_types else ""
            out.writerow(
                [
                    r.job_id,
                    r.submit_time,
                    j.duration_s,
                    r.tenant,
                    r.replicas,
                    r.accelerators,
                    types,
                    r.priority_class,
                    str(r.preemptible).lower(),
                ]
            )


def _request(
    job_id: str,
    submit: float,
    tenant: str,
    replicas: int,
    accelerators: float,
    types: tuple[str, ...] = (),
    priority: str = "normal",
    preemptible: bool = True,
) -> JobRequest:
    return JobRequest(
        job_id=JobId(job_id),
        tenant=TenantId(tenant),
        project=tenant,
        user="trace",
        queue="default",
        priority_class=priority,
        kind=WorkloadKind.TRAINING,
        replicas=replicas,
        accelerators=accelerators,
        accelerator_types=types,
        accelerator_memory_gb=None,
        cpu=0.0,
        memory_gb=0.0,
        topology=TopologyLevel.CLUSTER,
        topology_required=False,
        preemptible=preemptible,
        submit_time=submit,
    )
