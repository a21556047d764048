"""Scheduler settings (env prefix QM_)."""

from pydantic import Field

from services.common.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    # A cycle runs as soon as new events make one worthwhile, but no sooner than this after
    # the previous one (so a burst is decided in one cycle) and no later than cycle_interval_s.
    min_cycle_gap_s: float = 0.01
    cycle_interval_s: float = 0.1
    # A cycle runs at least this often even when nothing changed (time-based policy).
    idle_cycle_s: float = 5.0
    # A standby only follows the log to be ready to take over: it polls the broker this
    # slowly (the leader polls at fetch_max_wait_ms). Two replicas polling ~45 partitions
    # every 10 ms were most of an idle broker's CPU; a take-over reads to the end at the fast
    # rate, so this adds at most this much to a failover.
    standby_fetch_max_wait_ms: int = 250
    # The leader polls new work (job.queued) at fetch_max_wait_ms and the rest of its topics
    # (capacity, run ends, refusals, preemptions, health, budgets) at this rate.
    cold_fetch_max_wait_ms: int = 100
    # While records flow, a standby's consumers gather them for standby_linger_ms into one
    # batch (common/consumer.py, Linger); taking the lead ends the linger at once and reads to
    # the end without lingering. The leader lingers on neither: its second consumer carries
    # the run ends that free capacity, which a full fleet waits on (cold_linger_ms, 0 by
    # default; docs/consumers.md, "Lingering", has what 100 ms cost).
    cold_linger_ms: int = Field(default=0, ge=0, le=10_000)
    standby_linger_ms: int = Field(default=250, ge=0, le=10_000)
    lease_name: str = "qm:scheduler:leader"
    lease_ttl_ms: int = 3000
    # Every this many cycles the kept working set is compared with one rebuilt from the state
    # (a rebuild costs ~10 ms plus ~15 ms per 1,000 running allocations); a difference is
    # logged, counted (qm_scheduler_working_set_drifts) and repaired. 0 turns the check off.
    working_set_check_every: int = 600
    # Snapshots of the state (services/scheduler/snapshot.py) in PostgreSQL: a start reads the
    # latest and then only the records after it. Taken every snapshot_every_s once at least
    # snapshot_min_records were read since the last; the broker's retention must comfortably
    # exceed the interval (schemas.topics: a week).
    snapshots: bool = True
    snapshot_every_s: float = 60.0
    snapshot_min_records: int = 1000
    # Without a usable snapshot, a start replays the topics only while none is truncated by
    # retention; otherwise it waits for one. This starts it anyway, knowing nothing of the
    # records before the logs' start (old pending or running jobs are then unknown to it).
    replay_truncated_log: bool = False
