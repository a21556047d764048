"""Serving settings (env prefix QM_)."""

from pydantic import Field

from services.common.settings import ServiceSettings


class ServingSettings(ServiceSettings):
    group_id: str = "serving"
    # How often every service is looked at (wall seconds): scale, rollout step, replacements.
    decide_every_s: float = 1.0
    # A running replica its agent (the executor) has not reported for this long (wall
    # seconds; it reports every 2 s) is failed and replaced.
    silent_after_s: float = 20.0
    # Replica lifecycle and reports are not on a batch job's critical path.
    fetch_max_wait_ms: int = 100
    # While records flow, each batch gathers what came in for this long (common/consumer.py).
    batch_linger_ms: int = Field(default=100, ge=0, le=10_000)
