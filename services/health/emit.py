"""The events announcing a set of decisions: node.unhealthy / node.recovered keyed by node,
alert.raised keyed by its subject (node, cluster, or slo/<name> for an SLO breach)."""

from __future__ import annotations

from schemas import topics
from schemas.health import AlertRaised, NodeRecovered, NodeUnhealthy
from services.common.kafka import OutMessage, envelope_for
from services.health.book import Changes
from services.health.burn import Breach

PRODUCER = "health"


def messages_for(changes: Changes) -> list[OutMessage]:
    out: list[OutMessage] = []
    for alert_id in changes.alerts:
        inc = changes.incidents[alert_id]
        alert = AlertRaised(
            alert_id=inc.incident_id,
            severity=inc.severity,
            subject=inc.subject,
            node_id=inc.node_id,
            cluster=inc.cluster,
            cause=inc.cause,
            suggested_action=inc.suggested_action,
            first_seen=inc.first_seen,
            count=inc.count,
        )
        out.append(_message(topics.ALERT_RAISED, inc.subject, "AlertRaised", alert))
    for sick in changes.unhealthy:
        node = sick.node
        assert node.quarantined_at is not None and node.incident_id is not None
        quarantined = NodeUnhealthy(
            node_id=node.node_id,
            cluster=node.cluster,
            cause=node.cause or "",
            signals=list(sick.signals),
            since=node.quarantined_at,
            incident_id=node.incident_id,
        )
        out.append(_message(topics.NODE_UNHEALTHY, node.node_id, "NodeUnhealthy", quarantined))
    for back in changes.recovered:
        node = back.node
        assert node.quarantined_at is not None
        recovered = NodeRecovered(
            node_id=node.node_id,
            cluster=node.cluster,
            cause=node.cause or "",
            unhealthy_since=node.quarantined_at,
            recovered_at=back.at,
            incident_id=back.incident.incident_id,
            signals_seen=back.incident.count,
        )
        out.append(_message(topics.NODE_RECOVERED, node.node_id, "NodeRecovered", recovered))
    return out


def slo_alert(breach: Breach) -> OutMessage:
    """The one alert of an SLO breach: about the platform, so no node and no cluster."""
    alert = AlertRaised(
        alert_id=breach.breach_id,
        severity=breach.severity,
        subject=breach.subject,
        cluster="",
        cause=breach.cause,
        suggested_action=breach.suggested_action,
        first_seen=breach.opened_at,
        count=breach.count,
    )
    return _message(topics.ALERT_RAISED, breach.subject, "AlertRaised", alert)


def _message(topic: str, key: str, event_type: str, payload: object) -> OutMessage:
    return OutMessage(topic, key, envelope_for(event_type, payload, producer=PRODUCER))
