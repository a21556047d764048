"""Preemptor settings (env prefix QM_). The guards' limits are in the policy file
(`preemption:`); these are the service's own timings."""

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
    # Placements and lifecycle events are the bulk of what is read; requests are rare.
    fetch_max_wait_ms: int = 20
