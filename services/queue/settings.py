"""Queue settings (env prefix QM_)."""

from services.common.settings import ServiceSettings


class QueueSettings(ServiceSettings):
    group_id: str = "queue"
    # Lifecycle events (runs started, ended, preempted) are not on any job's way to a
    # placement: polled less eagerly, and gathered for this long into one batch (one
    # transaction) while they flow (common/consumer.py, Linger). Submissions never linger.
    lifecycle_fetch_max_wait_ms: int = 100
    lifecycle_linger_ms: int = 100
