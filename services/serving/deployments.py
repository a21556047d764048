"""Robot deployments in the serving service's books: a model version for a selection of robots,
rolled out in waves gated by the robots' health (`core.robots.rollout_robots`), from the edge
executors' inventories. Each round gives the version each robot should run when it changed
(published on `robot.desired`, where the edge executors read it) and each deployment's status.

No I/O here; times are wall seconds, passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from core.robots import Health, Robot, RolloutState, WaveSpec, rollout_robots, waves_of
from schemas.robots import (
    DeploymentAction,
    DeploymentCommand,
    DeploymentPhase,
    DeploymentStatus,
    RobotDeploymentSpec,
    RobotDesired,
    RobotInventory,
    RobotState,
)


class Refused(ValueError):
    """A deployment declaration or command that cannot apply (the reason is in the status)."""


@dataclass
class DeploymentRecord:
    spec: RobotDeploymentSpec
    # The version robots ran before this rollout (None for a model's first deployment: robots
    # not reached yet are left alone), and its labels.
    previous: RobotDeploymentSpec | None = None
    phase: DeploymentPhase = DeploymentPhase.ROLLING
    started_at: float = 0.0
    waves: list[list[str]] | None = None
    reached: int = 0
    pins: dict[str, str] = field(default_factory=dict)
    # What was last published per robot (robot -> version), so only changes go out.
    sent: dict[str, str] = field(default_factory=dict)
    revision: int = 1
    reason: str = ""
    published: str = ""

    def to_json(self) -> dict[str, Any]:
        doc = dict(self.__dict__)
        doc["spec"] = self.spec.model_dump(mode="json")
        doc["previous"] = self.previous.model_dump(mode="json") if self.previous else None
        doc["phase"] = self.phase.value
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> DeploymentRecord:
        previous = doc.get("previous")
        return cls(
            **{
                **doc,
                "spec": RobotDeploymentSpec.model_validate(doc["spec"]),
                "previous": RobotDeploymentSpec.model_validate(previous) if previous else None,
                "phase": DeploymentPhase(doc["phase"]),
            }
        )


@dataclass
class FleetRound:
    desired: list[RobotDesired] = field(default_factory=list)
    statuses: list[DeploymentStatus] = field(default_factory=list)
    changed: set[str] = field(default_factory=set)


class Deployments:
    """`time_scale`: fleet seconds per wall second (a deployment's soak time is in fleet
    seconds; the book runs on the wall clock)."""

    def __init__(self, time_scale: float = 1.0, stale_after_s: float = 30.0) -> None:
        self.time_scale = time_scale
        self.stale_after_s = stale_after_s
        self.records: dict[str, DeploymentRecord] = {}
        # The newest inventory of each robot fleet (not kept: the next one comes in seconds).
        self.inventories: dict[str, RobotInventory] = {}
        self.received: dict[str, float] = {}
        self.dirty: set[str] = set()

    def declare(self, spec: RobotDeploymentSpec, now: float) -> None:
        rec = self.records.get(spec.name)
        other = next(
            (
                r
                for r in self.records.values()
                if r.spec.model == spec.model and r.spec.name != spec.name
            ),
            None,
        )
        if other is not None:
            # Two deployments of one model would tell the same robots different versions.
            raise Refused(
                f"model {spec.model} is deployed by {other.spec.name!r}: deploy its new "
                "versions there"
            )
        if rec is None:
            self.records[spec.name] = DeploymentRecord(
                spec=spec, started_at=now, reason=f"deploying {spec.model} {spec.version}"
            )
            self.dirty.add(spec.name)
            return
        if rec.spec.tenant != spec.tenant:
            raise Refused(f"the deployment name {spec.name!r} is another tenant's")
        if rec.spec.model != spec.model:
            raise Refused(f"deployment {spec.name!r} deploys {rec.spec.model}, not {spec.model}")
        if rec.spec == spec:
            return
        if rec.spec.version != spec.version:
            # The version robots run now goes back to being the one to return to, unless
            # the last rollout did not finish (then the one before it still is).
            if rec.phase is DeploymentPhase.DONE:
                rec.previous = rec.spec
            rec.started_at, rec.waves, rec.reached = now, None, 0
            rec.phase = DeploymentPhase.ROLLING
            rec.reason = f"rolling out {spec.version}"
        rec.spec = spec
        rec.revision += 1
        self.dirty.add(spec.name)

    def command(self, cmd: DeploymentCommand, now: float) -> None:
        rec = self.records.get(cmd.deployment)
        if rec is None or rec.spec.tenant != cmd.tenant:
            raise Refused(f"no deployment {cmd.deployment!r} of tenant {cmd.tenant!r}")
        who = cmd.requested_by
        if cmd.action is DeploymentAction.PAUSE:
            if rec.phase is not DeploymentPhase.ROLLING:
                raise Refused(f"the deployment is {rec.phase.value}, not rolling")
            rec.phase, rec.reason = DeploymentPhase.PAUSED, f"paused by {who}"
        elif cmd.action is DeploymentAction.RESUME:
            if rec.phase is not DeploymentPhase.PAUSED:
                raise Refused(f"the deployment is {rec.phase.value}, not paused")
            rec.phase, rec.reason = DeploymentPhase.ROLLING, f"resumed by {who}"
        elif cmd.action is DeploymentAction.UNDO:
            if rec.previous is None:
                raise Refused("no previous version to go back to")
            rec.phase, rec.reason = DeploymentPhase.ROLLED_BACK, f"undone by {who}"
        elif cmd.action is DeploymentAction.PIN:
            assert cmd.robot is not None and cmd.version is not None
            rec.pins[cmd.robot] = cmd.version
            rec.reason = f"robot {cmd.robot} pinned to {cmd.version} by {who}"
        elif cmd.action is DeploymentAction.UNPIN:
            assert cmd.robot is not None
            rec.pins.pop(cmd.robot, None)
            rec.reason = f"robot {cmd.robot} unpinned by {who}"
        rec.revision += 1
        self.dirty.add(rec.spec.name)

    def inventory(self, inv: RobotInventory, at: float) -> None:
        self.inventories[inv.cluster] = inv
        self.received[inv.cluster] = at

    def _selected(self, spec: RobotDeploymentSpec) -> dict[str, tuple[str, RobotState]]:
        out: dict[str, tuple[str, RobotState]] = {}
        for cluster in sorted(self.inventories):
            for state in self.inventories[cluster].robots:
                if spec.to.matches(cluster, state) and state.robot not in out:
                    out[state.robot] = (cluster, state)
        return out

    def round(self, now: float) -> FleetRound:
        out = FleetRound()
        for name, rec in self.records.items():
            selected = self._selected(rec.spec)
            model = rec.spec.model
            robots = [
                Robot(
                    robot_id,
                    state.site,
                    state.online,
                    state.running.get(model),
                    rec.pins.get(robot_id),
                )
                for robot_id, (_, state) in sorted(selected.items())
            ]
            # The inventory holds each robot's current verdict: one that began before this
            # rollout (the robot already ran the version) counts from the rollout's start.
            health = [
                Health(
                    robot_id,
                    h.version,
                    h.healthy,
                    max(h.since.timestamp(), rec.started_at),
                    h.detail,
                )
                for robot_id, (_, state) in selected.items()
                for h in state.health
                if h.model == model
            ]
            stale = self._stale(selected, now)
            if stale:
                if rec.reason != stale:
                    rec.reason = stale
                    self.dirty.add(name)
                want = None
            else:
                want = self._desired(rec, robots, health, now)
            if want is not None:
                back = rec.phase is DeploymentPhase.ROLLED_BACK
                for robot_id, version in sorted(want.items()):
                    if not version or robot_id not in selected or rec.sent.get(robot_id) == version:
                        continue
                    told = rec.sent.get(robot_id)
                    if version != rec.spec.version and robot_id not in rec.pins and not back:
                        # Only a roll-back sends a robot back: a robot not reached keeps what
                        # it runs (also one a superseded rollout had reached).
                        continue
                    if back and told is None:
                        continue  # never told anything by this deployment: left alone
                    cluster = selected[robot_id][0]
                    source = rec.spec if version == rec.spec.version else rec.previous
                    out.desired.append(
                        RobotDesired(
                            robot=robot_id,
                            cluster=cluster,
                            model=model,
                            version=version,
                            deployment=name,
                            labels=dict(source.labels) if source is not None else {},
                        )
                    )
                    rec.sent[robot_id] = version
                    out.changed.add(name)
            status = self._status(rec, selected, len(robots))
            key = status.model_dump_json(exclude={"reason", "revision"})
            if key != rec.published or name in self.dirty:
                rec.published = key
                out.statuses.append(status)
                out.changed.add(name)
        out.changed |= self.dirty
        self.dirty = set()
        return out

    def _stale(self, selected: dict[str, tuple[str, RobotState]], now: float) -> str:
        """Why the robots' state cannot be trusted now ('' when it can): a fleet's inventory
        is too old (its edge executor is away); the deployment holds until it is back."""
        for cluster in sorted({c for c, _ in selected.values()}):
            age = now - self.received.get(cluster, now)
            if age > self.stale_after_s:
                return f"holding: the inventory of fleet {cluster} is {age:.0f} s old"
        return ""

    def _desired(
        self,
        rec: DeploymentRecord,
        robots: list[Robot],
        health: list[Health],
        now: float,
    ) -> dict[str, str] | None:
        """The version per robot now, or None to leave what was sent as it is (paused)."""
        previous = rec.previous.version if rec.previous is not None else ""
        if rec.phase is DeploymentPhase.ROLLED_BACK:
            back = {r.robot_id: previous for r in robots}
            return {**back, **rec.pins}
        if rec.phase is DeploymentPhase.DONE:
            # A finished rollout gates nothing more: every robot selected (one added since,
            # one that was away) runs the version.
            done = {r.robot_id: rec.spec.version for r in robots}
            return {**done, **rec.pins}
        if not robots:
            rec.reason = "no robot matches the selection (yet)"
            return None
        spec = WaveSpec(
            rec.spec.canary_share, rec.spec.wave_share, rec.spec.soak_s / self.time_scale
        )
        if rec.waves is None:
            rec.waves = waves_of(spec, robots)
            self.dirty.add(rec.spec.name)
        paused = rec.phase is DeploymentPhase.PAUSED
        result = rollout_robots(
            spec,
            rec.spec.version,
            previous,
            robots,
            health,
            now,
            started_at=rec.started_at,
            reached_before=rec.reached,
            waves=rec.waves,
        )
        if paused and result.state is not RolloutState.ROLLED_BACK:
            return None  # no further wave; a failed gate still rolls back
        if result.wave > rec.reached:
            rec.revision += 1  # each wave reached is a step in the history
        if result.wave != rec.reached or result.reason != rec.reason:
            rec.reached = max(rec.reached, result.wave)
            rec.reason = result.reason.replace(
                f"for {spec.soak_s:g} s", f"for {rec.spec.soak_s:g} s"
            )
            self.dirty.add(rec.spec.name)
        if result.state is RolloutState.ROLLED_BACK:
            rec.phase = DeploymentPhase.ROLLED_BACK
            rec.revision += 1
            self.dirty.add(rec.spec.name)
            if rec.previous is None:
                rec.reason += "; no previous version: the robots reached keep what they run"
        elif result.state is RolloutState.DONE:
            rec.phase = DeploymentPhase.DONE
            rec.revision += 1
            self.dirty.add(rec.spec.name)
        return result.desired

    def _status(
        self, rec: DeploymentRecord, selected: dict[str, tuple[str, RobotState]], count: int
    ) -> DeploymentStatus:
        states = [s for _, s in selected.values()]
        return DeploymentStatus(
            deployment=rec.spec.name,
            tenant=rec.spec.tenant,
            model=rec.spec.model,
            version=rec.spec.version,
            previous_version=rec.previous.version if rec.previous else None,
            phase=rec.phase,
            wave=rec.reached,
            waves=len(rec.waves or []),
            selected=count,
            online=sum(1 for s in states if s.online),
            on_version=sum(1 for s in states if s.running.get(rec.spec.model) == rec.spec.version),
            pinned=sum(1 for r in selected if r in rec.pins),
            started_at=datetime.fromtimestamp(rec.started_at, UTC),
            reason=rec.reason[:2000],
            revision=rec.revision,
        )
