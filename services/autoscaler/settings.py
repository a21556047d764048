"""Autoscaler settings (env prefix QM_). Pools come from the fleet file (`node_pools:`)."""

from services.common.settings import ServiceSettings


class AutoscalerSettings(ServiceSettings):
    group_id: str = "autoscaler"
    # How often the pools are looked at (wall seconds).
    decide_every_s: float = 2.0
    # The same decision is not sent again within this long unless the executor shows it.
    resend_after_s: float = 15.0
    # Demand older than this (the scheduler fell silent) grows nothing.
    demand_stale_s: float = 120.0
    # A pool whose last request failed (stockout, quota) gets no demand this long (wall
    # seconds); the demand goes to the next cheapest pool meanwhile.
    failing_pause_s: float = 300.0
    # Inventories and demand are not on any job's critical path.
    fetch_max_wait_ms: int = 100
