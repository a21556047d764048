"""Payloads of the node-health topics: probes in, quarantine / recovery / alerts out.

`node.probe` is written by executors (or any agent on a node); the health service alone writes
`node.unhealthy`, `node.recovered` and `alert.raised`.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from schemas.events import Payload


class SignalKind(StrEnum):
    """What a node reported about its hardware."""

    GPU_XID = "gpu_xid"  # an NVIDIA XID error; `xid` says which
    ECC_UNCORRECTABLE = "ecc_uncorrectable"
    THERMAL_THROTTLE = "thermal_throttle"
    NVLINK_DOWN = "nvlink_down"
    PCIE_ERROR = "pcie_error"
    DISK_FULL = "disk_full"


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class NodeProbe(Payload):
    """One hardware signal from one node (type NodeProbe, key node_id)."""

    node_id: str
    cluster: str
    kind: SignalKind
    xid: int | None = Field(default=None, description="XID code when kind is gpu_xid.")
    device: int | None = Field(default=None, description="Accelerator index on the node.")
    detail: str = ""


class NodeUnhealthy(Payload):
    """The node is out of scheduling (type NodeUnhealthy, key node_id): place nothing there;
    jobs running on it fail with reason `node_failure`."""

    node_id: str
    cluster: str
    cause: str = Field(description="The rule that fired, e.g. xid_79 or heartbeat_lost.")
    signals: list[str] = Field(description="The signals behind the decision, oldest first.")
    since: datetime
    incident_id: str


class NodeRecovered(Payload):
    """The node is back in scheduling after its clean period (type NodeRecovered, key node_id)."""

    node_id: str
    cluster: str
    cause: str = Field(description="The cause of the incident that ended.")
    unhealthy_since: datetime
    recovered_at: datetime
    incident_id: str
    signals_seen: int = Field(description="Bad signals counted over the incident.")


class AlertRaised(Payload):
    """Something an operator should look at: one per incident, never one per probe
    (type AlertRaised, key subject)."""

    alert_id: str
    severity: Severity
    subject: str = Field(description="The node id, or the cluster name for a cluster alert.")
    node_id: str | None = None
    cluster: str
    cause: str
    suggested_action: str
    first_seen: datetime
    count: int = Field(description="Signals (or silent nodes) behind the alert when raised.")
