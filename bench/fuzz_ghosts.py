"""Valid-looking payloads about entities nobody knows (a job never submitted, a run that never
started, a node in no inventory), one builder per consumed topic: what a confused or foreign
producer could write. Each validates against its topic's payload model
(tests/unit/bench/test_fuzz_records.py checks it), so only the entities are wrong.

They are chosen to stay harmless to real work whatever a service does with them: placements
and preemption requests carry epoch 0 (every leader's epoch is higher), nodes are unknown,
an inventory names a cluster nobody runs with an accelerator type nobody asks for, and usage
and budgets belong to a tenant no policy knows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from schemas import topics

GHOST_ACCELERATOR = "FUZZ-X"


@dataclass(frozen=True)
class Ghost:
    """The ids a ghost event talks about."""

    job: str
    node: str
    cluster: str  # a real cluster, so that its executor looks at the event
    accelerator_type: str  # one the real cluster has
    stranger: str  # a cluster nobody runs
    tenant: str  # a real tenant
    outsider: str  # a tenant no policy knows
    attempt: int
    at: datetime

    def stamp(self, seconds: float = 0.0) -> str:
        return (self.at + timedelta(seconds=seconds)).isoformat()


def ghost_spec(g: Ghost) -> dict[str, Any]:
    return {
        "job_id": g.job,
        "tenant": g.tenant,
        "name": "fuzz-ghost",
        "resources": {"accelerators": 1, "accelerator_types": [g.accelerator_type]},
        "labels": {"sim_duration_s": "30"},
    }


def _run(g: Ghost) -> dict[str, Any]:
    return {"job_id": g.job, "attempt": g.attempt, "cluster": g.cluster}


def _queued(g: Ghost) -> dict[str, Any]:
    return {"job_id": g.job, "spec": ghost_spec(g), "submitted_at": g.stamp(), "attempt": 0}


def _placed(g: Ghost) -> dict[str, Any]:
    replica = {"replica": 0, "node_id": g.node, "accelerators": 1, "cpu": 1, "memory_gb": 1}
    return {
        **_run(g),
        "epoch": 0,
        "leader": "fuzz",
        "accelerator_type": g.accelerator_type,
        "replicas": [replica],
        "spec": ghost_spec(g),
    }


def _preemption(g: Ghost) -> dict[str, Any]:
    return {
        **_run(g),
        "tenant": g.tenant,
        "priority_class": "low",
        "claim": {"rank": 0, "guaranteed": False},
        "for_job": f"{g.job}-for",
        "for_tenant": g.tenant,
        "for_priority_class": "critical",
        "for_claim": {"rank": 100, "guaranteed": True},
        "reason_code": "preempted_for_priority",
        "message": "fuzz: make room",
        "grace_s": 30.0,
        "epoch": 0,
        "leader": "fuzz",
    }


def _capacity(g: Ghost) -> dict[str, Any]:
    node = {
        "node_id": f"{g.stranger}-n0",
        "block": "b0",
        "rack": "r0",
        "nvlink_domain": "d0",
        "accelerator_type": GHOST_ACCELERATOR,
        "generation": "fuzz",
        "accelerator_memory_gb": 16.0,
        "relative_speed": 1.0,
        "accelerators": 4,
        "cpu": 16.0,
        "memory_gb": 64.0,
        "price_tier": "spot",
    }
    return {
        "cluster": g.stranger,
        "location": "nowhere",
        "kind": "cloud",
        "prices": {GHOST_ACCELERATOR: {"spot": 1.0}},
        "nodes": [node],
    }


def _tick(g: Ghost) -> dict[str, Any]:
    return {
        "tick_id": f"{g.job}#{g.attempt}/1/spot",
        "kind": "interval",
        "run_id": f"{g.job}#{g.attempt}",
        "job_id": g.job,
        "attempt": g.attempt,
        "tenant": g.outsider,
        "project": "default",
        "user": "fuzz",
        "cluster": g.cluster,
        "accelerator_type": g.accelerator_type,
        "price_tier": "spot",
        "count": 1.0,
        "interval_s": 60.0,
        "interval_index": 1,
        "interval_start": g.stamp(),
        "interval_end": g.stamp(60),
        "start_offset_s": 0.0,
        "end_offset_s": 60.0,
        "seconds": 60.0,
        "accelerator_seconds": 60.0,
        "unit_price": 1.0,
        "cost": 0.0167,
    }


def _budget(g: Ghost) -> dict[str, Any]:
    return {
        "budget_id": f"{g.outsider}-monthly",
        "tenant": g.outsider,
        "month": f"{g.at.year:04d}-{g.at.month:02d}",
        "unit": "currency",
        "limit": 100.0,
        "used": 120.0,
        "threshold_pct": 100.0,
        "enforcement": "block",
        "crossed_at": g.stamp(),
        "message": "fuzz: over budget",
    }


GHOSTS: dict[str, Callable[[Ghost], dict[str, Any]]] = {
    topics.JOB_CANCEL_REQUESTED: lambda g: {
        "job_id": g.job,
        "requested_by": "fuzz",
        "reason": "fuzz",
    },
    topics.JOB_QUEUED: _queued,
    topics.JOB_REJECTED: lambda g: {
        "job_id": g.job,
        "reason_code": "invalid_spec",
        "message": "fuzz: rejected",
    },
    topics.PLACEMENT_DECIDED: _placed,
    topics.PLACEMENT_REFUSED: lambda g: {
        **_run(g),
        "epoch": 0,
        "reason_code": "no_room",
        "message": "fuzz: refused",
    },
    topics.JOB_STARTED: lambda g: {**_run(g), "nodes": [g.node], "started_at": g.stamp()},
    topics.JOB_FINISHED: lambda g: {**_run(g), "outcome": "succeeded", "ran_s": 12.5},
    topics.JOB_PREEMPTED: lambda g: {
        **_run(g),
        "reason_code": "node_failure",
        "message": "fuzz: node lost",
        "failed_nodes": [g.node],
        "ran_s": 12.5,
    },
    topics.JOB_STOP_ORDERED: lambda g: {"job_id": g.job, "reason": "canceled"},
    topics.JOB_RUN_FAILED: lambda g: {
        **_run(g),
        "reason_code": "application_error",
        "message": "fuzz: exit 1",
        "exit_code": 1,
        "ran_s": 12.5,
    },
    topics.PREEMPTION_REQUESTED: _preemption,
    topics.PREEMPTION_CANCELED: lambda g: {
        "job_id": g.job,
        "attempt": g.attempt,
        "for_job": f"{g.job}-for",
        "reason_code": "victim_gone",
        "message": "fuzz: never mind",
    },
    topics.JOB_CHECKPOINT_REQUESTED: lambda g: {
        **_run(g),
        "grace_s": 30.0,
        "stop_at": g.stamp(30),
        "for_job": f"{g.job}-for",
        "reason_code": "preempted_for_priority",
    },
    topics.JOB_PREEMPT_ORDERED: lambda g: {
        **_run(g),
        "for_job": f"{g.job}-for",
        "reason_code": "preempted_for_priority",
        "message": "fuzz: stop",
    },
    topics.JOB_PROGRESS: lambda g: {
        **_run(g),
        "replicas": [{"replica": 0, "node_id": g.node, "step_time_s": 1.5}],
    },
    topics.NODE_HEARTBEAT: lambda g: {
        "node_id": g.node,
        "cluster": g.cluster,
        "healthy": True,
        "accelerators": 8,
        "allocated_accelerators": 0.0,
    },
    topics.NODE_PROBE: lambda g: {
        "node_id": g.node,
        "cluster": g.cluster,
        "kind": "gpu_xid",
        "xid": 79,
        "device": 0,
        "detail": "fuzz: fell off the bus",
    },
    topics.NODE_UNHEALTHY: lambda g: {
        "node_id": g.node,
        "cluster": g.cluster,
        "cause": "xid_79",
        "signals": ["gpu_xid 79"],
        "since": g.stamp(),
        "incident_id": f"{g.node}-i",
    },
    topics.NODE_RECOVERED: lambda g: {
        "node_id": g.node,
        "cluster": g.cluster,
        "cause": "xid_79",
        "unhealthy_since": g.stamp(-60),
        "recovered_at": g.stamp(),
        "incident_id": f"{g.node}-i",
        "signals_seen": 1,
    },
    topics.CLUSTER_CAPACITY: _capacity,
    topics.USAGE_TICK: _tick,
    topics.BUDGET_EXCEEDED: _budget,
    topics.SCHEDULING_EXPLAINED: lambda g: {
        "job_id": g.job,
        "codes": ["no_capacity"],
        "message": "fuzz: waiting",
        "pending_jobs": 1,
    },
}


def ghost_payload(topic: str, g: Ghost) -> dict[str, Any]:
    """The ghost payload for `topic`; a bare `{"job_id": ...}` for a topic without a builder
    (a topic a service started consuming since: it then gets the malformed classes at least)."""
    build = GHOSTS.get(topic)
    return build(g) if build is not None else {"job_id": g.job}


def key_of(topic: str, g: Ghost) -> str:
    """The partition key the registry names for the topic (only a label here: partitions are
    chosen explicitly)."""
    key = topics.BY_NAME[topic].key if topic in topics.BY_NAME else "job_id"
    return {
        "node_id": g.node,
        "cluster": g.stranger if topic == topics.CLUSTER_CAPACITY else g.cluster,
        "tenant": g.outsider,
    }.get(key, g.job)
