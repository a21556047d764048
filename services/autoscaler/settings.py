"""Autoscaler settings (env prefix QM_). Pools come from the fleet file (`node_pools:`)."""

from pydantic import Field

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
    # A fleet-wide cloud budget per calendar month for all elastic pools together (unset: none);
    # the autoscaler buys no node whose cost would take this month's spend past it.
    cloud_budget_per_month: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    # Inventories and demand are not on any job's critical path.
    fetch_max_wait_ms: int = 100
    # While records flow, each batch gathers what came in for this long (common/consumer.py).
    batch_linger_ms: int = Field(default=100, ge=0, le=10_000)
