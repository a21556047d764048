"""Why a job is still pending, or why a running job must yield: codes for machines, sentences for
researchers. The core never raises for "does not fit"; it returns one of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ReasonCode(StrEnum):
    # The request itself can never be satisfied as written.
    INVALID_REQUEST = "invalid_request"
    NO_MATCHING_NODES = "no_matching_nodes"
    TOPOLOGY_TOO_SMALL = "topology_too_small"
    # No node, even idle, can hold one replica (accelerators, CPU and memory together).
    REPLICA_TOO_LARGE = "replica_too_large"
    # Could run on this fleet, but not right now.
    INSUFFICIENT_CAPACITY = "insufficient_capacity"
    CAPACITY_RESERVED = "capacity_reserved"
    QUOTA_EXHAUSTED = "quota_exhausted"
    BORROW_LIMIT = "borrow_limit"
    BEHIND_HIGHER_PRIORITY = "behind_higher_priority"
    HEAD_OF_LINE_BLOCKED = "head_of_line_blocked"
    # Victims were chosen; the job is placed once they have left.
    AWAITING_PREEMPTION = "awaiting_preemption"
    # Requeued after its last run ended and waiting out its backoff (live scheduler only).
    BACKING_OFF = "backing_off"
    # Reasons a running job is chosen as a victim.
    PREEMPTED_FOR_PRIORITY = "preempted_for_priority"
    RECLAIMED_BORROWED = "reclaimed_borrowed"
    PREEMPTED_ATTAINED_SERVICE = "preempted_attained_service"
    # Moved to room free elsewhere so that a long-waiting job can start (core/repack.py).
    REPACKED = "repacked"


@dataclass(frozen=True)
class PendingExplanation:
    codes: tuple[ReasonCode, ...]
    message: str


@dataclass(frozen=True)
class Miss:
    """One failed attempt to place a job; cycle turns these into a PendingExplanation."""

    code: ReasonCode
    message: str


def explain(misses: tuple[Miss, ...], higher_priority_waiting: int) -> PendingExplanation:
    """Joins the misses of one job into one explanation, adding its place in the queue."""
    codes = [m.code for m in misses]
    parts = [m.message for m in misses]
    if higher_priority_waiting > 0:
        codes.append(ReasonCode.BEHIND_HIGHER_PRIORITY)
        plural = "job" if higher_priority_waiting == 1 else "jobs"
        parts.append(f"waiting behind {higher_priority_waiting} higher-priority {plural}")
    unique = tuple(dict.fromkeys(codes))
    sentence = "; ".join(dict.fromkeys(parts)) or "not considered in this cycle"
    return PendingExplanation(codes=unique, message=sentence[:1].upper() + sentence[1:] + ".")
