"""Health service settings (env prefix QM_). The timing fields, when set, override the rule
file's (tests and demos use seconds where production uses minutes)."""

from pathlib import Path

from pydantic import Field

from services.common.settings import REPO_ROOT, ServiceSettings


class HealthSettings(ServiceSettings):
    group_id: str = "health"
    health_file: Path = REPO_ROOT / "examples" / "health.yaml"
    # How often silence and recovery are judged; well below the heartbeat interval.
    check_interval_s: float = 1.0
    suspect_after_s: float | None = None
    unhealthy_after_s: float | None = None
    min_quarantine_s: float | None = None
    clean_period_s: float | None = None
    # SLOs (docs/slo.md): evaluated only when there are metrics targets to read,
    # `name=url,...` as the gateway's dashboard takes them (the dev stack passes both).
    slo_file: Path = REPO_ROOT / "examples" / "slo.yaml"
    slo_eval_every_s: float = 15.0
    metrics_targets: str = ""
    # Heartbeats are not on any job's critical path: poll the broker less eagerly.
    fetch_max_wait_ms: int = 100
    # While records flow, each batch gathers what came in for this long (common/consumer.py).
    batch_linger_ms: int = Field(default=100, ge=0, le=10_000)
