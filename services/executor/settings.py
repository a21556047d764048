"""Executor settings (env prefix QM_)."""

from services.common.settings import ServiceSettings


class ExecutorSettings(ServiceSettings):
    executor_cluster: str = "onprem-h100"
    default_duration_s: float = 300.0
    heartbeat_interval_s: float = 5.0
    capacity_interval_s: float = 30.0
    tick_interval_s: float = 0.05
    # Wall seconds between job.progress reports of running gangs (telemetry, not outboxed).
    progress_interval_s: float = 2.0
    # Random fault mode (also started over HTTP: POST /faults/random, `qm fault random`):
    # faults per fleet hour for the whole cluster (0: off), drawn from this seed.
    fault_seed: int | None = None
    fault_rate_per_hour: float = 0.0
    # Placements wait in the broker at most this long. Every poll is a broker round trip and
    # there is an executor per cluster, so they poll less often than the scheduling path.
    fetch_max_wait_ms: int = 100
    # A stop order for a job not running here is kept this long (wall seconds) so that a
    # placement of the canceled job still on its way is refused; pruned every
    # `tombstone_prune_every_s`.
    tombstone_retention_s: float = 3600.0
    tombstone_prune_every_s: float = 300.0
