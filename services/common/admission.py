"""Whether a job spec is admissible under the shared policy file (queue and gateway). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from core.policy import Policy
from schemas.events import RejectReason
from schemas.job import JobSpec
from schemas.validation import spec_problems


@dataclass(frozen=True)
class Rejection:
    reason: RejectReason
    message: str


def check_admission(spec: JobSpec, policy: Policy) -> Rejection | None:
    """The first reason the job cannot be admitted, or None. Each message says what to change."""
    problems = spec_problems(spec)
    if problems:
        reason, _message = problems[0]
        return Rejection(reason, "; ".join(m for _, m in problems))
    tenant = policy.tenant(spec.tenant)
    if tenant is None:
        known = ", ".join(sorted(policy.tenants)) or "none"
        return Rejection(
            RejectReason.UNKNOWN_TENANT,
            f"tenant {spec.tenant!r} is not known to Quartermaster (known tenants: {known})",
        )
    if spec.queue not in tenant.queues:
        return Rejection(
            RejectReason.UNKNOWN_QUEUE,
            f"queue {spec.queue!r} does not exist for tenant {spec.tenant!r} "
            f"(its queues: {', '.join(tenant.queues)})",
        )
    if spec.priority_class not in policy.priority_classes:
        return Rejection(
            RejectReason.UNKNOWN_PRIORITY_CLASS,
            f"priority class {spec.priority_class!r} is not defined "
            f"(defined: {', '.join(sorted(policy.priority_classes))})",
        )
    unknown = [t for t in spec.resources.accelerator_types if t not in policy.accelerator_types]
    if unknown:
        return Rejection(
            RejectReason.UNKNOWN_ACCELERATOR_TYPE,
            f"accelerator type(s) {', '.join(unknown)} are not in the fleet "
            f"(known: {', '.join(sorted(policy.accelerator_types))})",
        )
    if spec.replicas > tenant.max_replicas:
        return Rejection(
            RejectReason.GANG_TOO_LARGE,
            f"gang of {spec.replicas} replicas exceeds tenant {spec.tenant!r}'s limit of "
            f"{tenant.max_replicas} replicas per job",
        )
    if spec.total_accelerators > tenant.max_accelerators:
        return Rejection(
            RejectReason.TOO_MANY_ACCELERATORS,
            f"job asks for {spec.total_accelerators:g} accelerators in total; tenant "
            f"{spec.tenant!r} may ask for at most {tenant.max_accelerators:g} per job",
        )
    return None
