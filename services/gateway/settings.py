"""Gateway settings (env prefix QM_)."""

from pathlib import Path

from pydantic import Field

from services.common.settings import REPO_ROOT, ServiceSettings


class GatewaySettings(ServiceSettings):
    group_id: str = "gateway"
    http_port: int = 8080
    # The read model is not on any job's critical path: poll the broker less often.
    fetch_max_wait_ms: int = 100
    # While records flow, each batch gathers what came in for this long (common/consumer.py).
    batch_linger_ms: int = Field(default=100, ge=0, le=10_000)
    # Lifecycle events read before their job (kept until it is heard of, a day at most) are
    # at most this many rows and bytes; the oldest beyond either are dropped with a warning.
    early_events_max: int = Field(default=100_000, ge=1)
    early_events_max_bytes: int = Field(default=256 << 20, ge=1 << 20)
    # How long `?follow=true` keeps a quiet event stream open before closing it.
    watch_idle_timeout_s: float = 3600.0
    # The dashboard's session cookies are signed with this key. Every gateway replica must
    # share it; when empty, each process draws its own at start (sessions end with a restart).
    ui_session_secret: str = ""
    ui_session_hours: float = 12.0
    # Mark the session cookie Secure (set it when the dashboard is served over HTTPS).
    ui_secure_cookie: bool = False
    # name=url of each service's /metrics, comma-separated: the dashboard's scheduler health
    # page reads them (the dev stack fills it in; Kubernetes lists the Services).
    metrics_targets: str = ""
    # The meter's budgets file: the cost page shows each budget and its thresholds.
    budgets_file: Path = REPO_ROOT / "examples" / "budgets.yaml"
