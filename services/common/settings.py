"""Settings every service shares, read from the environment with the `QM_` prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parents[2]


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QM_", extra="ignore")

    kafka_bootstrap: str = "127.0.0.1:9092"
    database_url: str = "postgresql://postgres@127.0.0.1:5432/quartermaster"
    redis_url: str = "redis://127.0.0.1:6379/0"
    http_host: str = "127.0.0.1"
    http_port: int = 0
    policy_file: Path = REPO_ROOT / "examples" / "policy.yaml"
    fleet_file: Path = REPO_ROOT / "examples" / "fleet.yaml"
    auth_file: Path = REPO_ROOT / "examples" / "auth.yaml"
    log_format: str = "auto"  # json | console | auto (console on a terminal)
    log_level: str = "INFO"
    # Tansu answers a waiting fetch only at its deadline, so this is the per-hop latency floor.
    fetch_max_wait_ms: int = 10
    # A consumer that has read nothing for `fetch_idle_after_s` polls `fetch_idle_factor` times
    # less often (at most every `fetch_idle_max_ms`) until its next record (common/pacing.py):
    # idle polling was most of an idle broker's CPU. A factor of 1 turns this off.
    fetch_idle_factor: int = Field(default=5, ge=1)
    fetch_idle_max_ms: int = Field(default=500, ge=1)
    fetch_idle_after_s: float = Field(default=5.0, gt=0, allow_inf_nan=False)
    # Where a quiet consumer spends the part of its long wait beyond the busy one when a fetch
    # finds nothing (common/pacing.py): at the client, which suits Tansu (the broker of the
    # development stack, the tests and the benches: it answers a held fetch only at the deadline
    # and spends CPU the whole time it holds it), or at the broker, which suits Kafka (it
    # answers the moment a record comes; deploy/k8s sets it).
    fetch_wait_at: Literal["broker", "client"] = "client"
    max_batch_records: int = 500
    # While records flow, a consumer starts its batches at most this often (0: the next as
    # soon as the last is done); a service not on a fresh job's way to its placement sets it
    # so that its batches gather what came meanwhile (common/consumer.py, `Linger`).
    batch_linger_ms: int = Field(default=0, ge=0, le=10_000)
    # After start-up, move every object made so far (modules, classes, pydantic's validators,
    # what start-up read) out of the cyclic garbage collector's reach (gc.freeze): a full
    # collection then scans only what the service made since. docs/performance.md measures it.
    gc_freeze: bool = True
    # The collector looks at young objects once this many more were made than freed (Python's
    # own is 700). A batch's records live until it is done, so at 700 they were scanned and
    # promoted again and again while they lived; at 10,000 most die unscanned, and the older
    # generations (which hold a scheduler's whole state) are collected a fourteenth as often.
    # At 50,000 the latency at 200 jobs/s was higher over many runs, for no gain in CPU
    # measured on a fast machine. docs/performance.md, "Young objects collected less often".
    gc_young_threshold: int = Field(default=10_000, ge=100, le=1_000_000)
    # The event loop a service runs on: uvloop (libuv; sockets, timers and callbacks in C) or
    # Python's own asyncio loop (docs/performance.md, "The event loop").
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    # Each shutdown step (open HTTP connections ending, the loops' cancellation, each close
    # hook, the lease's release) gets this long; one that hangs (a broker that never answers a
    # consumer's leave, a pool whose connection is never given back) is cut off with an error
    # naming it, and the steps after it still run (docs/deploy.md, "Stopping").
    shutdown_step_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    # All of those steps together, after the open connections' time, get at most this long:
    # with the 10 s for connections, a service is stopped within 25 s of its SIGTERM, inside
    # Kubernetes' default 30 s grace. A step started past it gets 0.1 s.
    shutdown_deadline_s: float = Field(default=15.0, gt=0, allow_inf_nan=False)
    # A consumer whose batch has failed (retryably) for this long raises one alert.raised
    # (cause consumer_stalled); it goes on retrying with backoff either way.
    stall_alert_after_s: float = 60.0
    # Lease of a service that must run as one instance (health, meter); a standby takes over
    # within this long after the holder stops renewing.
    singleton_ttl_s: float = 10.0
    db_pool_size: int = 4
    # Processed event ids are kept this long to skip redeliveries; housekeeping prunes older
    # ones this often (wall seconds). A record older than this must never be delivered again:
    # consumer groups' committed offsets must be kept longer (Kafka: offsets.retention.minutes,
    # 7 days by default), or a group that comes back after its offsets expired replays from the
    # earliest record and finds those ids gone.
    processed_retention_s: float = 30 * 86400
    housekeeping_every_s: float = 3600
    # Fleet (virtual) seconds per wall-clock second on the simulated fleet; 1 on a real one.
    # Durations in job specs and the policy are fleet seconds: a 600 s job runs 10 s at 60x.
    time_scale: float = 60.0
    # Traces (docs/tracing.md): to an OTLP/HTTP collector when `otlp_endpoint` is set (e.g.
    # http://otel-collector:4318), else as JSON lines under `trace_dir` (the dev stack sets it),
    # else off. New traces are kept with this probability; a continued one follows its parent.
    otlp_endpoint: str = ""
    trace_dir: str = ""
    trace_sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
