"""Executor settings (env prefix QM_)."""

from services.common.settings import ServiceSettings


class ExecutorSettings(ServiceSettings):
    executor_cluster: str = "onprem-h100"
    # Virtual seconds per real second: a job asking for 600 s runs 10 s at 60x.
    time_scale: float = 60.0
    default_duration_s: float = 300.0
    heartbeat_interval_s: float = 5.0
    capacity_interval_s: float = 30.0
    tick_interval_s: float = 0.05
    # Placements wait in the broker at most this long. Every poll is a broker round trip and
    # there is an executor per cluster, so they poll less often than the scheduling path.
    fetch_max_wait_ms: int = 50
