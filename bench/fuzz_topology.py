"""Which consumer group reads which topic, taken from the services themselves, so the fuzz
covers every topic some service consumes and audits every group that consumes it.

The scheduler reads its topics without a group (services/scheduler/feed.py): its topics are
consumed, but there is no committed offset to audit for them; the probes show it kept up.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from cli.stack import PROJECT_ROOT, cluster_names
from schemas import topics
from services.common.settings import ServiceSettings
from services.executor.handlers import PAYLOADS as EXECUTOR_TOPICS
from services.gateway.handlers import PROJECTED as GATEWAY_TOPICS
from services.gateway.settings import GatewaySettings
from services.gateway.usage import USAGE_TOPICS
from services.health.intake import TOPICS as HEALTH_TOPICS
from services.health.settings import HealthSettings
from services.meter.intake import TOPICS as METER_TOPICS
from services.meter.settings import MeterSettings
from services.preemptor.intake import TOPICS as PREEMPTOR_TOPICS
from services.preemptor.settings import PreemptorSettings
from services.queue.intake import LIFECYCLE_TOPICS, REQUEST_TOPICS
from services.queue.settings import QueueSettings
from services.scheduler.handlers import FEED_TOPICS

FLEET_FILE = PROJECT_ROOT / "examples" / "fleet.yaml"


def _group(settings: type[ServiceSettings], default: str) -> str:
    # The defaults the services start with (the stack sets no QM_GROUP_ID).
    field = settings.model_fields.get("group_id")
    return str(field.default) if field is not None else default


def consumer_groups(fleet_file: Path = FLEET_FILE) -> dict[str, tuple[str, ...]]:
    """Group id -> the topics it consumes, as the services subscribe (services/*/app.py)."""
    gateway = _group(GatewaySettings, "gateway")
    queue = _group(QueueSettings, "queue")
    groups: dict[str, tuple[str, ...]] = {
        gateway: tuple(GATEWAY_TOPICS),
        f"{gateway}-usage": tuple(USAGE_TOPICS),
        f"{gateway}-explain": (topics.SCHEDULING_EXPLAINED,),
        queue: tuple(REQUEST_TOPICS),
        f"{queue}-lifecycle": tuple(LIFECYCLE_TOPICS),
        _group(HealthSettings, "health"): tuple(HEALTH_TOPICS),
        _group(MeterSettings, "meter"): tuple(METER_TOPICS),
        _group(PreemptorSettings, "preemptor"): tuple(PREEMPTOR_TOPICS),
    }
    for cluster in cluster_names(fleet_file):
        groups[f"executor-{cluster}"] = tuple(EXECUTOR_TOPICS)
    return groups


def consumed_topics(fleet_file: Path = FLEET_FILE) -> tuple[str, ...]:
    """Every topic some service consumes (groups and the scheduler's feed), registry order."""
    wanted = {t for group in consumer_groups(fleet_file).values() for t in group}
    wanted |= set(FEED_TOPICS)
    return tuple(t.name for t in topics.TOPICS if t.name in wanted)


def clusters_with_types(fleet_file: Path = FLEET_FILE) -> dict[str, str]:
    """Each cluster of the fleet file with the accelerator type of its first node group."""
    fleet = yaml.safe_load(fleet_file.read_text()) or {}
    return {
        str(c["name"]): str(c["node_groups"][0]["accelerator_type"])
        for c in fleet.get("clusters") or []
        if c.get("node_groups")
    }
