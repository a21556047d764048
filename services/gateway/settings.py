"""Gateway settings (env prefix QM_)."""

from services.common.settings import ServiceSettings


class GatewaySettings(ServiceSettings):
    group_id: str = "gateway"
    http_port: int = 8080
    # The read model is not on any job's critical path: poll the broker less often.
    fetch_max_wait_ms: int = 100
    # How long `?follow=true` keeps a quiet event stream open before closing it.
    watch_idle_timeout_s: float = 3600.0
