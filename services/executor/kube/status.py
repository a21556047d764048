"""What a gang's pods say about its run (pure): still pending, running, succeeded, failed
(with a failure class the queue's retry policy reads), or refused back to the scheduler."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from services.executor.kube import names

Obj = dict[str, Any]

# Waiting reasons that mean the container will not start by itself.
IMAGE_ERRORS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})
CONFIG_ERRORS = frozenset({"CreateContainerConfigError", "CreateContainerError"})
# status.reason of a pod the kubelet refused or threw out.
POD_REASONS = {
    "Evicted": "evicted",
    "UnexpectedAdmissionError": "admission_error",
    "DeadlineExceeded": "max_runtime_exceeded",
    "NodeAffinity": "admission_error",
    "NodeLost": "node_lost",
    "Shutdown": "node_shutdown",
    "Terminated": "node_shutdown",
}


class GangPhase(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REFUSED = "refused"  # never started: back to the scheduler (placement.refused)
    LOST = "lost"  # its pods are gone without an end (deleted behind our back)


@dataclass(frozen=True)
class Failure:
    reason_code: str
    message: str
    exit_code: int | None = None


@dataclass(frozen=True)
class GangState:
    phase: GangPhase
    failure: Failure | None = None
    nodes: tuple[str, ...] = ()


def _meta(pod: Obj) -> Obj:
    return pod.get("metadata") or {}


def replica_of(pod: Obj) -> int:
    try:
        return int((_meta(pod).get("labels") or {}).get(names.REPLICA, "0"))
    except ValueError:
        return 0


def _container_states(pod: Obj) -> list[tuple[str, Obj]]:
    out = []
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        for kind, state in (status.get("state") or {}).items():
            if state:
                out.append((kind, {**state, "container": status.get("name", "")}))
    return out


def pod_failure(pod: Obj) -> Failure | None:
    """Why this pod failed, or None if it has not (yet)."""
    status = pod.get("status") or {}
    name = _meta(pod).get("name", "?")
    phase = status.get("phase")
    reason = status.get("reason") or ""
    if phase == "Failed" and reason in POD_REASONS:
        message = status.get("message") or reason
        return Failure(POD_REASONS[reason], f"pod {name}: {reason}: {message}")
    for kind, state in _container_states(pod):
        why = state.get("reason") or ""
        if kind == "waiting" and why in IMAGE_ERRORS:
            detail = state.get("message") or why
            return Failure("image_pull_error", f"pod {name}: {why}: {detail}")
        if kind == "waiting" and why in CONFIG_ERRORS:
            detail = state.get("message") or why
            return Failure("config_error", f"pod {name}: {why}: {detail}")
    if phase != "Failed":
        return None
    terminated = [s for k, s in _container_states(pod) if k == "terminated"]
    bad = [s for s in terminated if s.get("exitCode", 0) != 0] or terminated
    if not bad:
        return Failure("admission_error" if reason else "unknown", f"pod {name} failed: {reason}")
    state = bad[0]
    code = state.get("exitCode")
    if state.get("reason") == "OOMKilled":
        return Failure(
            "out_of_memory",
            f"pod {name}: container {state['container']} was OOMKilled (exit {code})",
            code,
        )
    return Failure(
        "application_error",
        f"pod {name}: container {state['container']} exited with code {code}"
        + (f" ({state['reason']})" if state.get("reason") else ""),
        code,
    )


def unschedulable(pod: Obj) -> tuple[datetime, str] | None:
    """Since when kube-scheduler has found no node for this pod, and its words, if so."""
    status = pod.get("status") or {}
    if status.get("phase") not in (None, "Pending"):
        return None
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            if c.get("reason") != "Unschedulable":
                return None
            since = datetime.fromisoformat(str(c.get("lastTransitionTime")))
            return since, c.get("message") or "no node fits"
    return None


def gang_state(
    pods: Sequence[Obj],
    replicas: int,
    *,
    now: datetime,
    unschedulable_after_s: float,
    complete: bool,
) -> GangState:
    """The run of a gang of `replicas` from its pods. `complete`: every pod was created (a
    missing pod is then lost, not yet to come). Pods being deleted are on their way out."""
    live = sorted((p for p in pods if not _meta(p).get("deletionTimestamp")), key=replica_of)
    nodes = tuple(sorted({n for p in live if (n := (p.get("spec") or {}).get("nodeName"))}))
    for pod in live:
        failure = pod_failure(pod)
        if failure is not None:
            return GangState(GangPhase.FAILED, failure, nodes)
    phases = [(p.get("status") or {}).get("phase") for p in live]
    if complete and len(live) < replicas:
        if len(pods) > len(live):
            return GangState(GangPhase.PENDING, None, nodes)  # a teardown we ordered
        missing = replicas - len(live)
        return GangState(
            GangPhase.LOST, Failure("pods_lost", f"{missing} of {replicas} pods are gone"), nodes
        )
    if len(live) == replicas and all(ph == "Succeeded" for ph in phases):
        return GangState(GangPhase.SUCCEEDED, None, nodes)
    if len(live) == replicas and all(ph in ("Running", "Succeeded") for ph in phases):
        return GangState(GangPhase.RUNNING, None, nodes)
    for pod in live:
        stuck = unschedulable(pod)
        if stuck is not None and (now - stuck[0]).total_seconds() >= unschedulable_after_s:
            name = _meta(pod).get("name", "?")
            return GangState(
                GangPhase.REFUSED,
                Failure("unschedulable", f"pod {name} is unschedulable: {stuck[1]}"),
                nodes,
            )
    return GangState(GangPhase.PENDING, None, nodes)
