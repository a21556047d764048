"""The executor's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ExecutorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.started = Counter("qm_executor_jobs_started_total", "Gangs started", registry=registry)
        self.tombstones = Gauge(
            "qm_executor_tombstones",
            "Stop orders kept for jobs not running here (pruned past their retention)",
            registry=registry,
        )
        self.refused = Counter(
            "qm_executor_placements_refused_total",
            "Placements refused",
            ["reason"],
            registry=registry,
        )
        self.finished = Counter(
            "qm_executor_jobs_finished_total", "Jobs ended", ["outcome"], registry=registry
        )
        self.runs_failed = Counter(
            "qm_executor_runs_failed_total",
            "Runs failed by the job itself (retryable)",
            ["reason"],
            registry=registry,
        )
        self.checkpoints = Counter(
            "qm_executor_checkpoints_signalled_total",
            "Runs signalled to checkpoint",
            registry=registry,
        )
        self.allocated = Gauge(
            "qm_executor_allocated_accelerators", "Accelerators in use", registry=registry
        )
        self.overcommitted = Gauge(
            "qm_executor_overcommitted_nodes",
            "Nodes allocated beyond capacity (must be 0)",
            registry=registry,
        )
