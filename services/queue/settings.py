"""Queue settings (env prefix QM_)."""

from pydantic import Field

from services.common.settings import ServiceSettings


class QueueSettings(ServiceSettings):
    group_id: str = "queue"
    # Lifecycle events (runs started, ended, refused, preempted) are polled less eagerly and,
    # while they flow, gathered for this long into one batch (one transaction; common/
    # consumer.py, Linger). A job queued again after a refusal, a failure or a preemption
    # waits up to about twice this longer; submissions never linger.
    lifecycle_fetch_max_wait_ms: int = 100
    lifecycle_linger_ms: int = Field(default=100, ge=0, le=10_000)
