"""Robot fleets on the wire (issue 13): what an edge executor says about its robots, model
deployments to robots (declared, commanded), the version each robot should run (the desired
state, on the log so a robot or its executor converges after a restart or an outage), and each
deployment's status.

A robot fleet is a cluster of kind `edge`: each robot is a node with an onboard accelerator
(e.g. Jetson Orin), a site and labels, behind an intermittent link. Its edge executor is the
fleet's side of the link: it knows which robots are online, what each runs and how healthy
each is on it.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from schemas.bounds import MAX_LABELS, Identifier, Name, Text
from schemas.events import Payload

# Per fleet: one inventory record holds them all, and must stay under the record limit
# (1 MiB; a robot is about 300 bytes with two models). A bigger fleet is split in several.
MAX_ROBOTS = 2000
RobotId = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
]
DeploymentName = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
]


class ModelHealth(Payload):
    """A robot's verdict on the model version it runs: inference errors, latency and the
    model's own check, judged on the robot; `since` is when the verdict last changed."""

    model: Name
    version: Name
    healthy: bool
    since: datetime
    error_rate: float | None = Field(default=None, ge=0, le=1)
    latency_ms: float | None = Field(default=None, ge=0, le=3.6e6)
    detail: Text = ""


class RobotState(Payload):
    robot: RobotId
    site: Name
    accelerator_type: Name
    labels: dict[Identifier, Text] = Field(default_factory=dict, max_length=MAX_LABELS)
    online: bool
    last_seen: datetime
    # Model -> the version it runs now (one version per model, never two).
    running: dict[Name, Name] = Field(default_factory=dict, max_length=64)
    health: list[ModelHealth] = Field(default_factory=list, max_length=64)


class RobotInventory(Payload):
    """An edge executor's view of its fleet (sent when it changes, and every few seconds)."""

    cluster: Name
    robots: list[RobotState] = Field(default_factory=list, max_length=MAX_ROBOTS)


class RobotSelector(Payload):
    """Which robots a deployment goes to: all of these that are given (empty: every robot)."""

    cluster: Name | None = None
    sites: list[Name] = Field(default_factory=list, max_length=256)
    labels: dict[Identifier, Text] = Field(default_factory=dict, max_length=MAX_LABELS)
    robots: list[RobotId] = Field(default_factory=list, max_length=MAX_ROBOTS)

    def matches(self, cluster: str, robot: RobotState) -> bool:
        if self.cluster is not None and self.cluster != cluster:
            return False
        if self.sites and robot.site not in self.sites:
            return False
        if self.robots and robot.robot not in self.robots:
            return False
        return all(robot.labels.get(k) == v for k, v in self.labels.items())

    @classmethod
    def parse(cls, text: str) -> RobotSelector:
        """`site=lab-a,model=mk2` (site, cluster and robot are fields, any other key a label;
        a key given twice means any of the values for site and robot)."""
        sites: list[str] = []
        robots: list[str] = []
        labels: dict[str, str] = {}
        cluster: str | None = None
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key or not value:
                raise ValueError(f"{part!r}: write key=value (e.g. site=lab-a)")
            if key == "site":
                sites.append(value)
            elif key == "robot":
                robots.append(value)
            elif key == "cluster":
                cluster = value
            else:
                labels[key] = value
        return cls.model_validate(
            {"cluster": cluster, "sites": sites, "robots": robots, "labels": labels}
        )


class RobotDeploymentSpec(Payload):
    """A model version for a selection of robots, rolled out in waves gated by their health.
    Declaring it again with another version rolls that version out the same way."""

    name: DeploymentName
    tenant: Name
    model: Name
    version: Name
    to: RobotSelector = RobotSelector()
    canary_share: float = Field(default=0.1, gt=0, le=1)
    wave_share: float = Field(default=0.3, gt=0, le=1)
    soak_s: float = Field(
        default=300, ge=0, le=7 * 86400, description="Healthy this long before the next wave."
    )
    labels: dict[Identifier, Text] = Field(default_factory=dict, max_length=MAX_LABELS)


class DeploymentDeclared(Payload):
    spec: RobotDeploymentSpec
    declared_by: Name = "unknown"


class DeploymentAction(StrEnum):
    PAUSE = "pause"  # no further wave (robots reached keep the new version)
    RESUME = "resume"
    UNDO = "undo"  # every robot back to the previous version
    PIN = "pin"  # this robot keeps `version` whatever the rollout does
    UNPIN = "unpin"


class DeploymentCommand(Payload):
    deployment: DeploymentName
    tenant: Name
    action: DeploymentAction
    robot: RobotId | None = None
    version: Name | None = None
    requested_by: Name = "unknown"

    @model_validator(mode="after")
    def _pin(self) -> DeploymentCommand:
        if self.action is DeploymentAction.PIN and (self.robot is None or self.version is None):
            raise ValueError("pin needs robot and version")
        if self.action is DeploymentAction.UNPIN and self.robot is None:
            raise ValueError("unpin needs robot")
        return self


class RobotDesired(Payload):
    """The version of `model` this robot should run (the newest per robot and model wins)."""

    robot: RobotId
    cluster: Name
    model: Name
    version: Name
    deployment: DeploymentName
    labels: dict[Identifier, Text] = Field(default_factory=dict, max_length=MAX_LABELS)


class DeploymentPhase(StrEnum):
    ROLLING = "rolling"
    PAUSED = "paused"
    DONE = "done"
    ROLLED_BACK = "rolled_back"


class DeploymentStatus(Payload):
    deployment: DeploymentName
    tenant: Name
    model: Name
    version: Name
    previous_version: Name | None = None
    phase: DeploymentPhase
    wave: int = Field(ge=0)
    waves: int = Field(ge=0)
    selected: int = Field(ge=0)
    online: int = Field(ge=0)
    on_version: int = Field(ge=0, description="Selected robots that run `version` now.")
    pinned: int = Field(ge=0)
    started_at: datetime | None = None
    reason: str = Field(default="", max_length=2000)
    revision: int = Field(default=0, ge=0)
