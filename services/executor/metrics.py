"""The executor's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# From a pod that starts at once to a big gang waiting for images and nodes.
STARTUP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class ExecutorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.started = Counter("qm_executor_jobs_started_total", "Gangs started", registry=registry)
        self.startup = Histogram(
            "qm_executor_startup_seconds",
            "From a placement's decision to its gang running (job.started), wall seconds",
            ["tenant", "queue", "priority_class"],
            buckets=STARTUP_BUCKETS,
            registry=registry,
        )
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
