"""Queue settings (env prefix QM_)."""

from services.common.settings import ServiceSettings


class QueueSettings(ServiceSettings):
    group_id: str = "queue"
    lifecycle_fetch_max_wait_ms: int = 100
