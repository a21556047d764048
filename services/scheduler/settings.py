"""Scheduler settings (env prefix QM_)."""

from services.common.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    # A cycle runs as soon as new events make one worthwhile, but no sooner than this after
    # the previous one (so a burst is decided in one cycle) and no later than cycle_interval_s.
    min_cycle_gap_s: float = 0.01
    cycle_interval_s: float = 0.1
    # A cycle runs at least this often even when nothing changed (time-based policy).
    idle_cycle_s: float = 5.0
    lease_name: str = "qm:scheduler:leader"
    lease_ttl_ms: int = 3000
    seed: int = 0
