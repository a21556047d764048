"""Scheduler settings (env prefix QM_)."""

from services.common.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    cycle_interval_s: float = 0.1
    # A cycle runs at least this often even when nothing changed (time-based policy).
    idle_cycle_s: float = 5.0
    lease_name: str = "qm:scheduler:leader"
    lease_ttl_ms: int = 3000
    seed: int = 0
