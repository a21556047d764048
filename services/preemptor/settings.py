"""Preemptor settings (env prefix QM_). The guards' limits are in the policy file
(`preemption:`); these are the service's own timings."""

from pydantic import Field

from services.common.settings import ServiceSettings


class PreemptorSettings(ServiceSettings):
    group_id: str = "preemptor"
    # How often the durable timer looks for due stop orders (wall seconds): the most a stop
    # order is late, besides one outbox hop.
    timer_interval_s: float = 0.05
    timer_batch: int = 100
    # A request whose victim has not been seen starting is held this long (wall seconds)
    # before it is given up as victim_gone: job.started and preemption.requested are
    # different topics, read in no particular order.
    victim_wait_s: float = 30.0
    # A stop order that no run end has answered after this long (wall seconds) raises an
    # alert: the executor may be wedged, and the job the room is for waits.
    stop_answer_timeout_s: float = 60.0
    # How often the timer looks for such orders (wall seconds).
    answer_check_s: float = 1.0
    # Finished preemptions (the audit record) and the job facts of finished jobs are pruned
    # after this long (wall seconds); never sooner than the budget window needs them.
    audit_retention_s: float = 30 * 86400
    # Placements and lifecycle events are the bulk of what is read; requests are rare.
    fetch_max_wait_ms: int = 100
    # While records flow, each batch gathers what came in for this long (common/consumer.py).
    batch_linger_ms: int = Field(default=100, ge=0, le=10_000)
