"""The topic registry: every topic's name, partition key, partition count and payload type."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from schemas import events, health, robots, serving, usage
from schemas.job import JobSpec

DAY_MS = 86_400_000


@dataclass(frozen=True)
class Topic:
    name: str
    key: str  # which field the message key holds, so per-entity order holds
    partitions: int
    event_type: str
    payload: type[BaseModel] | None
    description: str
    # How long the broker keeps records. No reader depends on a topic's whole history: service
    # consumers resume from committed offsets and the scheduler from its latest snapshot (taken
    # every minute, see docs/performance.md "Start-up"). Events are kept 30 days, as long as
    # consumers remember processed event ids (QM_PROCESSED_RETENTION_S) so a replay from an
    # old offset is still deduplicated; usage 90 days (finance reads the stream; the meter's
    # ledger is the record); telemetry superseded within seconds a day; probes a week.
    retention_ms: int = 30 * DAY_MS


# The control record a new scheduler leader writes to every partition of FENCED_TOPICS
# (events.LeaderFence); consumers that do not fence skip it by its envelope type.
LEADER_FENCE = "LeaderFence"

JOB_SUBMITTED = "job.submitted"
JOB_CANCEL_REQUESTED = "job.cancel.requested"
JOB_QUEUED = "job.queued"
JOB_REJECTED = "job.rejected"
PLACEMENT_DECIDED = "placement.decided"
PLACEMENT_REFUSED = "placement.refused"
JOB_STARTED = "job.started"
JOB_FINISHED = "job.finished"
JOB_PREEMPTED = "job.preempted"
JOB_STOP_ORDERED = "job.stop.ordered"
PREEMPTION_REQUESTED = "preemption.requested"
PREEMPTION_CANCELED = "preemption.canceled"
JOB_CHECKPOINT_REQUESTED = "job.checkpoint.requested"
JOB_PREEMPT_ORDERED = "job.preempt.ordered"
JOB_RUN_FAILED = "job.run.failed"
JOB_PROGRESS = "job.progress"
NODE_HEARTBEAT = "node.heartbeat"
NODE_PROBE = "node.probe"
NODE_UNHEALTHY = "node.unhealthy"
NODE_RECOVERED = "node.recovered"
CLUSTER_CAPACITY = "cluster.capacity"
AUTOSCALE_DECIDED = "autoscale.decided"
CAPACITY_DEMAND = "capacity.demand"
USAGE_TICK = "usage.tick"
BUDGET_EXCEEDED = "budget.exceeded"
ALERT_RAISED = "alert.raised"
SCHEDULING_EXPLAINED = "scheduling.explained"
SERVICE_DECLARED = "service.declared"
SERVICE_COMMAND = "service.command"
SERVICE_LOAD = "service.load"
SERVICE_STATUS = "service.status"
ROBOT_INVENTORY = "robot.inventory"
DEPLOYMENT_DECLARED = "deployment.declared"
DEPLOYMENT_COMMAND = "deployment.command"
ROBOT_DESIRED = "robot.desired"
DEPLOYMENT_STATUS = "deployment.status"
DEAD_LETTER = "dead.letter"

_JOB = "job_id"
TOPICS: tuple[Topic, ...] = (
    Topic(
        JOB_SUBMITTED,
        _JOB,
        4,
        "JobSubmitted",
        JobSpec,
        "A job asked for, by the gateway or any platform writing JSON.",
    ),
    Topic(
        JOB_CANCEL_REQUESTED,
        _JOB,
        4,
        "JobCancelRequested",
        events.JobCancelRequested,
        "Someone asked to cancel a job.",
    ),
    Topic(
        JOB_QUEUED,
        _JOB,
        4,
        "JobQueued",
        events.JobQueued,
        "The queue accepted a job and it waits for placement.",
    ),
    Topic(
        JOB_REJECTED,
        _JOB,
        4,
        "JobRejected",
        events.JobRejected,
        "The queue refused a job, with a reason code and a sentence.",
    ),
    Topic(
        PLACEMENT_DECIDED,
        _JOB,
        4,
        "PlacementDecided",
        events.PlacementDecided,
        "The scheduler leader bound a job's replicas to nodes of one cluster.",
    ),
    Topic(
        PLACEMENT_REFUSED,
        _JOB,
        4,
        "PlacementRefused",
        events.PlacementRefused,
        "An executor would not honour a placement (stale epoch, no room, cancelled).",
    ),
    Topic(
        JOB_STARTED,
        _JOB,
        4,
        "JobStarted",
        events.JobStarted,
        "All replicas of the gang are running.",
    ),
    Topic(
        JOB_FINISHED,
        _JOB,
        4,
        "JobFinished",
        events.JobFinished,
        "A job reached succeeded, failed or canceled.",
    ),
    Topic(
        JOB_PREEMPTED,
        _JOB,
        4,
        "JobPreempted",
        events.JobPreempted,
        "A run was ended by the platform (node failure, room for a higher claim); requeued.",
    ),
    Topic(
        JOB_STOP_ORDERED,
        _JOB,
        4,
        "JobStopOrdered",
        events.JobStopOrdered,
        "Command: executors stop a job's replicas.",
    ),
    Topic(
        JOB_RUN_FAILED,
        _JOB,
        4,
        "RunFailed",
        events.RunFailed,
        "A run failed by the job's own fault (exit code, OOM); the queue retries or ends it.",
    ),
    Topic(
        PREEMPTION_REQUESTED,
        _JOB,
        4,
        "PreemptionRequested",
        events.PreemptionRequested,
        "The scheduler leader asks that a running job yield to a higher claim (key: victim).",
    ),
    Topic(
        PREEMPTION_CANCELED,
        _JOB,
        4,
        "PreemptionCanceled",
        events.PreemptionCanceled,
        "The preemptor declined or called off a preemption, with the guard that stopped it.",
    ),
    Topic(
        JOB_CHECKPOINT_REQUESTED,
        _JOB,
        4,
        "JobCheckpointRequested",
        events.JobCheckpointRequested,
        "Command: an executor signals a run to checkpoint before it is stopped.",
    ),
    Topic(
        JOB_PREEMPT_ORDERED,
        _JOB,
        4,
        "JobPreemptOrdered",
        events.JobPreemptOrdered,
        "Command: an executor stops a run whose grace period is over and hands it back.",
    ),
    Topic(
        JOB_PROGRESS,
        _JOB,
        4,
        "JobProgress",
        events.JobProgress,
        "Per-replica step times of running gangs; the health service finds stragglers in it.",
        retention_ms=1 * DAY_MS,
    ),
    Topic(
        NODE_HEARTBEAT,
        "node_id",
        4,
        "NodeHeartbeat",
        events.NodeHeartbeat,
        "A node is alive and how much of it is allocated.",
        retention_ms=1 * DAY_MS,
    ),
    Topic(
        NODE_PROBE,
        "node_id",
        4,
        "NodeProbe",
        health.NodeProbe,
        "Hardware signals from a node (XID, ECC, thermal, NVLink).",
        retention_ms=7 * DAY_MS,
    ),
    Topic(
        NODE_UNHEALTHY,
        "node_id",
        2,
        "NodeUnhealthy",
        health.NodeUnhealthy,
        "A node was taken out of scheduling.",
    ),
    Topic(
        NODE_RECOVERED,
        "node_id",
        2,
        "NodeRecovered",
        health.NodeRecovered,
        "A node came back into scheduling.",
    ),
    Topic(
        CLUSTER_CAPACITY,
        "cluster",
        1,
        "ClusterCapacity",
        events.ClusterCapacity,
        "An executor's inventory of its cluster.",
    ),
    Topic(
        AUTOSCALE_DECIDED,
        "cluster",
        1,
        "AutoscaleDecided",
        events.AutoscaleDecided,
        "The size an elastic node pool should have, and which of its nodes go.",
    ),
    Topic(
        CAPACITY_DEMAND,
        "scheduler",
        1,
        "CapacityDemand",
        events.CapacityDemand,
        "Pending work waiting for capacity, by shape (from the leading scheduler).",
        retention_ms=DAY_MS,
    ),
    Topic(
        USAGE_TICK,
        "tenant",
        4,
        "UsageTick",
        usage.UsageTick,
        "Metered accelerator-seconds and cost of one allocation over one interval.",
        retention_ms=90 * DAY_MS,
    ),
    Topic(
        BUDGET_EXCEEDED,
        "tenant",
        1,
        "BudgetExceeded",
        usage.BudgetExceeded,
        "A tenant or project crossed a budget threshold.",
    ),
    Topic(
        ALERT_RAISED,
        "subject",
        1,
        "AlertRaised",
        health.AlertRaised,
        "Something an operator should see.",
    ),
    Topic(
        SCHEDULING_EXPLAINED,
        _JOB,
        4,
        "PendingExplained",
        events.PendingExplained,
        "Why a job is still pending, in codes and a sentence; sent when it changes.",
    ),
    Topic(
        SERVICE_DECLARED,
        "service",
        1,
        "ServiceDeclared",
        serving.ServiceDeclared,
        "An inference service's desired state (model version, replicas, targets, rollout).",
    ),
    Topic(
        SERVICE_COMMAND,
        "service",
        1,
        "ServiceCommand",
        serving.ServiceCommand,
        "Command: scale, pause, resume, undo or delete an inference service.",
    ),
    Topic(
        SERVICE_LOAD,
        "service",
        2,
        "ReplicaReported",
        serving.ReplicaReported,
        "A service replica is ready (and where), and the load and latency it served.",
        retention_ms=1 * DAY_MS,
    ),
    Topic(
        SERVICE_STATUS,
        "service",
        1,
        "ServiceStatus",
        serving.ServiceStatus,
        "A service's replicas, rollout and endpoints after each change, with the reason.",
    ),
    Topic(
        ROBOT_INVENTORY,
        "cluster",
        1,
        "RobotInventory",
        robots.RobotInventory,
        "An edge executor's robots: site, labels, link, the versions they run, their health.",
        retention_ms=1 * DAY_MS,
    ),
    Topic(
        DEPLOYMENT_DECLARED,
        "deployment",
        1,
        "DeploymentDeclared",
        robots.DeploymentDeclared,
        "A model version to deploy to a selection of robots, in waves gated by their health.",
    ),
    Topic(
        DEPLOYMENT_COMMAND,
        "deployment",
        1,
        "DeploymentCommand",
        robots.DeploymentCommand,
        "Command: pause, resume or undo a robot deployment; pin or unpin one robot.",
    ),
    Topic(
        ROBOT_DESIRED,
        "cluster/robot/model",
        1,
        "RobotDesired",
        robots.RobotDesired,
        "The model version a robot should run (newest per robot and model); edge executors "
        "read it from the start, so it is kept a year (compact it on a production broker).",
        retention_ms=365 * DAY_MS,
    ),
    Topic(
        DEPLOYMENT_STATUS,
        "deployment",
        1,
        "DeploymentStatus",
        robots.DeploymentStatus,
        "A robot deployment's waves, robots on the version, and why it waits or rolled back.",
    ),
    Topic(
        DEAD_LETTER,
        "source_topic",
        1,
        "DeadLetter",
        events.DeadLetter,
        "Messages that could not be parsed or validated, with the error.",
    ),
)

BY_NAME: dict[str, Topic] = {t.name: t for t in TOPICS}
BY_EVENT_TYPE: dict[str, Topic] = {t.event_type: t for t in TOPICS}

# Where the scheduler leader decides: a new leader fences each of their partitions.
FENCED_TOPICS: tuple[str, ...] = (PLACEMENT_DECIDED, PREEMPTION_REQUESTED)
