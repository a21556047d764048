"""Per-service saturation: each service alone, on one core, fed from a pre-filled log; messages
per second and CPU per message. What a deployer needs to size replicas at a target rate
(docs/performance.md, "Capacity model").

Record, then replay:

1. record: a private broker, PostgreSQL and Redis, and the whole stack (time scale 600) as
   e2e_throughput starts it; `--jobs` small jobs offered over Kafka at `--rate` per second;
   wait until they are placed and (nearly) all finished, so every topic holds a realistic
   history. Every service is then stopped (the stores stay up) and every topic is read to the
   high watermark a fetch reports (Tansu's ListOffsets is not the end, shared/INFRA.md).
2. replay, one service at a time (`--repeat` times each, medians reported; a replay during which
   other processes kept the core more than `--max-others` busy is done again, at most
   `--retries` more times, and not counted), each on a fresh broker into which its input topics'
   history is written again (same partitions, order, keys, headers, timestamps; so offsets 0 to
   the marks, and nothing another replay wrote): ONE fresh instance as its own process, pinned
   to one core (`taskset -c CORE`, with PostgreSQL, Redis, its broker and this bench moved to
   the other cores; it first waits a few seconds for the core to be idle of other processes),
   with its own PostgreSQL database, an emptied Redis database index of its own (singleton
   leases free at once; the scheduler's leader lease is held for it, so it follows the log as a
   standby), and a fresh consumer group (QM_GROUP_ID=<service>-sat-<run>; the executor's, fixed
   by its cluster, is new on the new broker), reading its input topics from the earliest offset.
   Group consumers are timed from their first batch (when FastStream's received-messages
   counter was created, read from /metrics afterwards: consumption starts inside start-up,
   before HTTP answers) to the first poll that finds the committed offsets at the marks on
   every input partition (late by up to the committer's 0.1 s and one poll). The scheduler has
   no group: from "service started" to "snapshot caught up" as its log stamps them. CPU
   seconds of the process (psutil, sampled every poll, interpolated) over the same interval;
   also PostgreSQL's and the broker's, and how busy other processes kept the core meanwhile.

    python bench/service_saturation.py                      # 5,000 jobs at 150/s, all services
    python bench/service_saturation.py --jobs 600 --services queue,meter

Prints a table and ends with one JSON line (shared/BENCH.md): `msgs_per_s` and
`cpu_ms_per_msg` per service, `msgs_per_job` (input records per job offered, from the recorded
history), `jobs_per_s` (what one instance sustains: msgs_per_s / msgs_per_job), and more.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (topic, partition): aiokafka's TopicPartition is a NamedTuple of the same shape.
Partition = tuple[str, int]

SERVICES = ("scheduler", "queue", "executor", "meter", "gateway", "preemptor", "health")
# Topics whose volume follows the clock (per node, per running gang, per interval), not the
# number of jobs submitted: their share of msgs_per_job depends on how long the recording ran.
CLOCK_DRIVEN = ("node.heartbeat", "node.probe", "cluster.capacity", "job.progress")
STARTED = "service started"
HEARTBEAT_ENV = "QM_HEARTBEAT_INTERVAL_S"
CAUGHT_UP = "snapshot caught up"


# --- pure arithmetic (tests/unit/bench/test_service_saturation.py) ---------------------------


def per_second(records: int, seconds: float) -> float:
    return records / seconds if seconds > 0 and records > 0 else float("nan")


def cpu_ms_per_msg(cpu_s: float, records: int) -> float:
    return cpu_s * 1000.0 / records if records > 0 else float("nan")


def core_share(cpu_s: float, seconds: float) -> float:
    """Share of one core the process used over the interval (1.0: CPU-bound)."""
    return cpu_s / seconds if seconds > 0 else float("nan")


def records_to_marks(positions: Mapping[Partition, int], marks: Mapping[Partition, int]) -> int:
    """Records from `positions` (committed offsets; a partition missing there is at 0) up to
    the marks: what is left to consume. Offsets past a mark count as the mark."""
    return sum(max(0, mark - min(positions.get(tp, 0), mark)) for tp, mark in marks.items())


def reached(positions: Mapping[Partition, int], marks: Mapping[Partition, int]) -> bool:
    """Whether every partition's position is at or past its mark (an empty one always is)."""
    return all(positions.get(tp, 0) >= mark for tp, mark in marks.items())


def committed_offsets(response: Mapping[Any, Any]) -> dict[Partition, int]:
    """list_consumer_group_offsets' answer as (topic, partition) -> next offset; a partition
    without a commit (offset -1, or absent) is left out."""
    out: dict[Partition, int] = {}
    for tp, meta in response.items():
        offset = getattr(meta, "offset", meta)
        if offset is not None and offset >= 0:
            out[(tp[0], tp[1])] = int(offset)
    return out


def topic_counts(
    marks: Mapping[Partition, int], beginning: Mapping[Partition, int] | None = None
) -> dict[str, int]:
    """Records per topic between the beginning (0 by default) and the marks."""
    counts: dict[str, int] = {}
    for (topic, partition), mark in marks.items():
        start = (beginning or {}).get((topic, partition), 0)
        counts[topic] = counts.get(topic, 0) + max(0, mark - start)
    return counts


def msgs_per_job(counts: Mapping[str, int], inputs: Iterable[str], jobs: int) -> float:
    """Input records of a service in the history per job offered."""
    return sum(counts.get(t, 0) for t in set(inputs)) / jobs if jobs > 0 else float("nan")


def jobs_per_s(msgs_per_s: float, per_job: float) -> float:
    """Jobs per second one instance keeps up with, given its messages per job."""
    return msgs_per_s / per_job if per_job > 0 else float("nan")


def replicas_for(
    target_jobs_per_s: float, per_job: float, msgs_per_s: float, utilisation: float = 0.7
) -> int:
    """Instances needed at a target job rate, each kept at `utilisation` of what it sustains."""
    if target_jobs_per_s <= 0:
        return 0
    if not msgs_per_s > 0 or not 0 < utilisation <= 1:
        raise ValueError("need a positive msgs_per_s and 0 < utilisation <= 1")
    return max(1, math.ceil(target_jobs_per_s * per_job / (msgs_per_s * utilisation)))


def cores_for(target_jobs_per_s: float, per_job: float, cpu_ms: float) -> float:
    """CPU cores a service's instances burn together at a target job rate."""
    return target_jobs_per_s * per_job * cpu_ms / 1000.0


def metric_sum(metrics: str, name: str) -> float | None:
    """The sum over labels of one metric in a Prometheus text; None when it is absent."""
    total: float | None = None
    for line in metrics.splitlines():
        if line.startswith((name + "{", name + " ")):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def executor_outcome(metrics: str) -> str:
    """What the replayed executor did with the placements: started or refused (and why)."""
    started = metric_sum(metrics, "qm_executor_jobs_started_total") or 0.0
    reasons: dict[str, float] = {}
    prefix = "qm_executor_placements_refused_total{"
    for line in metrics.splitlines():
        if line.startswith(prefix):
            labels, _, value = line[len(prefix) :].rpartition("} ")
            code = labels.partition('"')[2].partition('"')[0] or "?"
            reasons[code] = reasons.get(code, 0.0) + float(value)
    refused = ", ".join(f"{int(n)} {code}" for code, n in sorted(reasons.items()) if n)
    return f"started {int(started)} runs, refused {refused or 'none'}"


def first_received_at(metrics: str) -> float | None:
    """When the first batch arrived (epoch seconds): the earliest creation time of FastStream's
    received-messages counter, whose child per topic is created by that topic's first batch."""
    times = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("qm_received_messages_created{")
    ]
    return min(times) if times else None


def log_time(event: Mapping[str, Any]) -> float:
    """A structlog line's ISO timestamp as epoch seconds."""
    from datetime import datetime

    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def log_event(line: str) -> dict[str, Any] | None:
    """One structlog JSON line as a dict, or None for anything else (library noise)."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def cpu_jiffies(stat: str, core: int) -> tuple[int, int] | None:
    """(busy, total) jiffies of `cpu<core>` in a /proc/stat text; None if the core is absent."""
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name == f"cpu{core}":
            values = [int(v) for v in rest.split()]
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            total = sum(values[:8])  # guest time is already inside user
            return total - idle, total
    return None


def others_share(
    before: tuple[float, float] | None,
    after: tuple[float, float] | None,
    own_cpu_s: float,
    hz: int,
) -> float:
    """Share of the core used by other processes meanwhile (0: the service had it alone)."""
    if before is None or after is None or after[1] <= before[1]:
        return float("nan")
    busy = (after[0] - before[0]) / hz
    total = (after[1] - before[1]) / hz
    return max(0.0, busy - own_cpu_s) / total


def interpolate(points: Sequence[tuple[float, float]], t: float) -> float:
    """The value at time `t`, linear between the samples around it (clamped at the ends)."""
    if not points:
        return float("nan")
    if t <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in itertools.pairwise(points):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return points[-1][1]


def median(values: Iterable[float]) -> float:
    """Median of the values that are numbers (NaN: none is)."""
    known = [v for v in values if not math.isnan(v)]
    return statistics.median(known) if known else float("nan")


def fmt(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def rounded(values: Mapping[str, float], digits: int) -> dict[str, float | None]:
    return {k: (None if math.isnan(v) else round(v, digits)) for k, v in values.items()}


# --- what each service reads ----------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One service's replay: its module, its consumer groups and their topics (None: the
    scheduler's feed, which has no group), and extra environment."""

    name: str
    module: str
    groups: dict[str | None, tuple[str, ...]]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def topics(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t for ts in self.groups.values() for t in ts))


def plan_for(name: str, run: str, cluster: str) -> Plan:
    """The input topics as the services' own code declares them, and the group ids the
    service derives from QM_GROUP_ID (or, for the executor, from its cluster)."""
    from schemas import topics

    gid = f"{name}-sat-{run}"
    groups: dict[str | None, tuple[str, ...]]
    if name == "scheduler":
        from services.scheduler.handlers import FEED_TOPICS

        return Plan(name, "services.scheduler", {None: tuple(FEED_TOPICS)})
    if name == "queue":
        from services.queue.intake import LIFECYCLE_TOPICS, REQUEST_TOPICS

        groups = {gid: tuple(REQUEST_TOPICS), f"{gid}-lifecycle": tuple(LIFECYCLE_TOPICS)}
        return Plan(name, "services.queue", groups, {"QM_GROUP_ID": gid})
    if name == "executor":
        from services.executor.handlers import PAYLOADS

        env = {"QM_EXECUTOR_CLUSTER": cluster}
        return Plan(name, "services.executor", {f"executor-{cluster}": tuple(PAYLOADS)}, env)
    if name == "meter":
        from services.meter.intake import TOPICS as METER_TOPICS

        groups = {gid: tuple(METER_TOPICS)}
        return Plan(name, "services.meter", groups, {"QM_GROUP_ID": gid})
    if name == "gateway":
        from services.gateway.handlers import PROJECTED
        from services.gateway.usage import USAGE_TOPICS

        groups = {
            f"{gid}-usage": tuple(USAGE_TOPICS),
            f"{gid}-explain": (topics.SCHEDULING_EXPLAINED,),
            gid: tuple(PROJECTED),
        }
        return Plan(name, "services.gateway", groups, {"QM_GROUP_ID": gid})
    if name == "preemptor":
        from services.preemptor.intake import TOPICS as PREEMPTOR_TOPICS

        return Plan(
            name, "services.preemptor", {gid: tuple(PREEMPTOR_TOPICS)}, {"QM_GROUP_ID": gid}
        )
    if name == "health":
        from services.health.intake import TOPICS as HEALTH_TOPICS

        groups = {gid: tuple(HEALTH_TOPICS)}
        return Plan(name, "services.health", groups, {"QM_GROUP_ID": gid})
    raise ValueError(f"unknown service {name!r} (one of {', '.join(SERVICES)})")


# --- recording --------------------------------------------------------------------------------


async def offer(bootstrap: str, jobs: int, rate: float, run: str) -> tuple[set[str], float]:
    """Submit `jobs` of e2e_throughput's shape over Kafka at `rate` per second (open loop),
    as that bench does; their ids and the seconds it took."""
    from bench.e2e_throughput import KafkaSubmitter
    from bench.e2e_throughput import offer as offer_at

    sent: dict[str, float] = {}
    async with KafkaSubmitter(bootstrap) as submitter:
        took = await offer_at(submitter, rate, jobs, f"sat-{run}", sent)
    return set(sent), took


class Progress:
    """Follows placement.decided and job.finished from the beginning; which jobs got there."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.placed: set[str] = set()
        self.finished: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Progress:
        from aiokafka import AIOKafkaConsumer

        from schemas import topics

        self._consumer = AIOKafkaConsumer(
            topics.PLACEMENT_DECIDED,
            topics.JOB_FINISHED,
            bootstrap_servers=self.bootstrap,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            fetch_max_wait_ms=50,
        )
        await self._consumer.start()
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        from schemas import topics

        while True:
            batches = await self._consumer.getmany(timeout_ms=200)
            for records in batches.values():
                for r in records:
                    env = json.loads(r.value)
                    job_id = (env.get("payload") or {}).get("job_id")
                    if not job_id:
                        continue  # a leader's fence
                    (self.placed if r.topic == topics.PLACEMENT_DECIDED else self.finished).add(
                        job_id
                    )

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.stop()


async def record(
    bootstrap: str, jobs: int, rate: float, run: str, settle_s: float, timeout_s: float
) -> dict[str, Any]:
    async with Progress(bootstrap) as progress:
        ids, took = await offer(bootstrap, jobs, rate, run)
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            placed, finished = len(ids & progress.placed), len(ids & progress.finished)
            if placed == len(ids) and finished >= 0.99 * len(ids):
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(settle_s)  # the meter's lagged ticks, the gateway's read model
        placed, finished = len(ids & progress.placed), len(ids & progress.finished)
    print(
        f"recorded: {len(ids)} jobs offered at {rate:.0f}/s over {took:.1f} s; "
        f"{placed} placed, {finished} finished"
    )
    return {"offered": len(ids), "offer_s": round(took, 1), "placed": placed, "finished": finished}


@dataclass(frozen=True)
class Rec:
    """One recorded message, as it is written again into a replay's broker."""

    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int


Archive = dict[Partition, list[Rec]]


async def read_history(bootstrap: str) -> Archive:
    """Every record of every registry topic, partition by partition in offset order, up to the
    high watermark a fetch reports (ListOffsets(latest) on Tansu is the last batch's base)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from schemas.topics import TOPICS

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=20,
        max_partition_fetch_bytes=8 << 20,
    )
    await consumer.start()
    try:
        tps = [TopicPartition(t.name, p) for t in TOPICS for p in range(t.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        history: Archive = {(tp.topic, tp.partition): [] for tp in tps}
        deadline = time.monotonic() + 120
        while True:
            batches = await consumer.getmany(timeout_ms=100, max_records=50_000)
            for tp, records in batches.items():
                history[(tp.topic, tp.partition)].extend(
                    Rec(r.key, r.value, tuple(r.headers or ()), r.timestamp) for r in records
                )
            pending = []
            for tp in tps:
                high = consumer.highwater(tp)
                if high is None or await consumer.position(tp) < high:
                    pending.append(tp)
            if not pending:
                return history
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not read to the high watermark of {pending[:3]}")
    finally:
        await consumer.stop()


async def write_history(bootstrap: str, history: Archive, topic_names: Iterable[str]) -> None:
    """The recorded records of `topic_names` into a fresh broker: same partitions, same order
    within each, same keys, headers and timestamps; so the same offsets, 0 to the mark."""
    from aiokafka import AIOKafkaProducer

    from services.common.topics import ensure_topics

    await ensure_topics(bootstrap)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, max_batch_size=1 << 20)
    await producer.start()
    try:
        wanted = set(topic_names)
        pending = []
        for (topic, partition), records in history.items():
            if topic not in wanted:
                continue
            for r in records:
                pending.append(
                    await producer.send(
                        topic,
                        r.value,
                        key=r.key,
                        partition=partition,
                        headers=list(r.headers),
                        timestamp_ms=r.timestamp_ms,
                    )
                )
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


# --- replaying --------------------------------------------------------------------------------


def pin_elsewhere(pids: Iterable[int], core: int) -> None:
    """Keep processes (0: this one) and their children off `core`: on every other CPU."""
    import psutil

    rest = sorted(set(range(os.cpu_count() or 1)) - {core})
    if not rest:
        return
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid or os.getpid())
            for p in [proc, *proc.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    p.cpu_affinity(rest)


def cpu_s(pid: int) -> float:
    import psutil

    from bench.cpu import cpu_seconds

    return cpu_seconds(psutil.Process(pid))


def tree_cpu_s(pid: int | None) -> float:
    """CPU seconds of a process and its children now (PostgreSQL: postmaster and backends;
    a backend that ended meanwhile is missed, so deltas are a lower bound)."""
    import psutil

    if not pid:
        return float("nan")
    try:
        root = psutil.Process(pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total
    except psutil.Error:
        return float("nan")


def read_stat() -> str:
    try:
        return Path("/proc/stat").read_text()
    except OSError:
        return ""


@dataclass
class Sample:
    """What the bench reads every poll, at wall-clock time `at` (time.time(), the clock the
    services' log timestamps and metrics use)."""

    at: float
    cpu: float  # the instance's CPU seconds
    db_cpu: float  # PostgreSQL's (postmaster and backends)
    broker_cpu: float
    core_busy: float  # jiffies of the pinned core: busy, and all
    core_total: float


@dataclass
class Result:
    service: str
    topics: tuple[str, ...]
    records: int
    seconds: float
    cpu_s: float
    db_cpu_s: float
    broker_cpu_s: float
    others_share: float
    note: str = ""

    @property
    def msgs_per_s(self) -> float:
        return per_second(self.records, self.seconds)

    @property
    def cpu_ms(self) -> float:
        return cpu_ms_per_msg(self.cpu_s, self.records)

    @property
    def share(self) -> float:
        return core_share(self.cpu_s, self.seconds)


class LogTail:
    """New JSON lines of a service's log, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pos = 0
        self._rest = ""

    def events(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open() as fh:
            fh.seek(self._pos)
            text = fh.read()
            self._pos = fh.tell()
        text, self._rest = self._rest + text, ""
        lines = text.split("\n")
        self._rest = lines.pop()  # a line not finished yet
        return [e for line in lines if (e := log_event(line)) is not None]


class Replay:
    """Starts one instance, samples its progress and CPU, stops it."""

    def __init__(
        self,
        plan: Plan,
        env: Mapping[str, str],
        log: Path,
        core: int | None,
        pg_pid: int | None,
        broker_pid: int | None,
    ) -> None:
        self.plan = plan
        self.env = dict(env)
        self.log = log
        self.core = core
        self.pg_pid = pg_pid
        self.broker_pid = broker_pid
        self.process: subprocess.Popen[bytes] | None = None
        self.poll_s = 0.02
        self.series: list[Sample] = []

    def start(self) -> None:
        from cli.processes import spawn

        argv = [sys.executable, "-m", self.plan.module]
        if self.core is not None:
            argv = ["taskset", "-c", str(self.core), *argv]  # taskset execs: same pid
        self.log.unlink(missing_ok=True)
        self.process = spawn(argv, log=self.log, env=self.env, cwd=Path(__file__).parents[1])

    def stop(self) -> None:
        from cli.processes import Target, stop_all

        if self.process is not None:
            stop_all([Target(self.process.pid, signal.SIGTERM, process=self.process)], timeout=10)

    def sample(self) -> Sample:
        assert self.process is not None
        core = cpu_jiffies(read_stat(), self.core) if self.core is not None else None
        sample = Sample(
            time.time(),
            cpu_s(self.process.pid),
            tree_cpu_s(self.pg_pid),
            tree_cpu_s(self.broker_pid),
            float(core[0]) if core else float("nan"),
            float(core[1]) if core else float("nan"),
        )
        self.series.append(sample)
        return sample

    def at(self, t: float) -> Sample:
        """Every figure at time `t`, from the samples around it."""
        s = self.series
        return Sample(
            t,
            *(
                interpolate([(x.at, getattr(x, name)) for x in s], t)
                for name in ("cpu", "db_cpu", "broker_cpu", "core_busy", "core_total")
            ),
        )

    def _check_alive(self) -> None:
        assert self.process is not None
        if self.process.poll() is not None:
            from cli.probes import log_tail

            raise RuntimeError(
                f"{self.plan.name} exited ({self.process.returncode}); last lines of "
                f"{self.log}:\n{log_tail(self.log)}"
            )

    def result(self, t0: float, t1: float, records: int, note: str = "") -> Result:
        """The figures between `t0` and `t1` (wall clock), from the samples."""
        first, last = self.at(t0), self.at(t1)
        own = last.cpu - first.cpu
        if t1 - t0 < 10 * self.poll_s:
            note = "; ".join(n for n in (note, "too short to time: record more jobs") if n)
        others = others_share(
            (first.core_busy, first.core_total),
            (last.core_busy, last.core_total),
            own,
            os.sysconf("SC_CLK_TCK"),
        )
        return Result(
            self.plan.name,
            self.plan.topics,
            records,
            t1 - t0,
            own,
            last.db_cpu - first.db_cpu,
            last.broker_cpu - first.broker_cpu,
            others,
            note,
        )

    async def watch_feed(
        self, marks: Mapping[Partition, int], poll_s: float, timeout_s: float
    ) -> Result:
        """The scheduler: from "service started" to "snapshot caught up", as its log stamps
        them. Its feed is a background loop that starts only once start-up is over (no record
        is read before the first line); the second says it has read to the end it found at
        start: the marks, on a broker holding only the history."""
        tail = LogTail(self.log)
        t0: float | None = None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.sample()
            for event in tail.events():
                name = event.get("event")
                if name == STARTED:
                    t0 = log_time(event)
                elif name == CAUGHT_UP and t0 is not None:
                    t1 = log_time(event)
                    self.sample()
                    expected = records_to_marks({}, marks)
                    logged = event.get("records")
                    if not isinstance(logged, int):
                        return self.result(t0, t1, expected, "no record count logged")
                    note = (
                        "" if logged == expected else f"feed read {logged}, marks hold {expected}"
                    )
                    return self.result(t0, t1, logged, note)
            self._check_alive()
            await asyncio.sleep(poll_s)
        raise TimeoutError(f"{self.plan.name}: feed not caught up after {timeout_s:.0f} s")

    async def watch_groups(
        self, bootstrap: str, marks: Mapping[Partition, int], poll_s: float, timeout_s: float
    ) -> Result:
        """Group consumers: from the first batch received to the first poll that finds the
        committed offsets at the marks on every input partition.

        The start is the creation time of FastStream's received-messages counter (its first
        batch), read from /metrics once it is over: consumption starts inside the start-up
        hook (broker.start()), before the HTTP server answers and before the committer runs,
        so nothing outside can see it begin. Every record is counted. The end is late by the
        commit (the committer waits up to 0.1 s between commits) and one poll."""
        import httpx
        from aiokafka import TopicPartition
        from aiokafka.admin import AIOKafkaAdminClient

        groups = {
            g: [TopicPartition(tp[0], tp[1]) for tp in marks if tp[0] in topic_names]
            for g, topic_names in self.plan.groups.items()
        }
        start = dict.fromkeys(marks, 0)  # a fresh broker: every partition starts at 0
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        await admin.start()
        try:
            # The first poll that saw a commit: the start if the metric is missing.
            seen: tuple[float, dict[Partition, int]] | None = None
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                positions: dict[Partition, int] = {}
                for group, tps in groups.items():
                    with contextlib.suppress(Exception):  # a group not known yet
                        got = await admin.list_consumer_group_offsets(group, partitions=tps)
                        positions.update(committed_offsets(got))
                now = self.sample()
                if seen is None and records_to_marks(start, positions) > 0:
                    seen = (now.at, {**start, **positions})
                if reached(positions, marks):
                    async with httpx.AsyncClient(timeout=5.0) as http:
                        metrics = await self._metrics(http)
                    note = executor_outcome(metrics) if self.plan.name == "executor" else ""
                    t0 = first_received_at(metrics)
                    if t0 is not None:
                        return self.result(t0, now.at, records_to_marks(start, marks), note)
                    assert seen is not None
                    note = "; ".join(n for n in (note, "no received counter: from 1st commit") if n)
                    return self.result(seen[0], now.at, records_to_marks(seen[1], marks), note)
                self._check_alive()
                await asyncio.sleep(poll_s)
        finally:
            await admin.close()
        raise TimeoutError(f"{self.plan.name}: offsets short of the marks after {timeout_s:.0f} s")

    async def _metrics(self, http: Any) -> str:
        answer = await http.get(f"http://127.0.0.1:{self.env['QM_HTTP_PORT']}/metrics")
        answer.raise_for_status()
        return str(answer.text)


def redis_db(url: str, index: int) -> str:
    """The same Redis server, database `index`."""
    base, _, last = url.rstrip("/").rpartition("/")
    return f"{base}/{index}" if last.isdigit() else f"{url.rstrip('/')}/{index}"


async def wait_for_quiet(core: int, max_busy: float, timeout_s: float) -> float:
    """Wait (up to `timeout_s`) until other processes leave `core` mostly idle, so that a
    replay does not start in the middle of someone else's burst; the share last seen busy."""
    hz = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + timeout_s
    while True:
        before = cpu_jiffies(read_stat(), core)
        await asyncio.sleep(0.25)
        busy = others_share(before, cpu_jiffies(read_stat(), core), 0.0, hz)
        if math.isnan(busy) or busy <= max_busy or time.monotonic() >= deadline:
            return busy


async def prepare_redis(url: str, plan: Plan, hold_s: float) -> None:
    """An empty Redis database for the replay (singleton leases, the gateway's cache). The
    scheduler's finds its leader lease held by someone else, so it stands by and only follows
    the log: as leader it would fence the placement topics, and the executor's replay would
    then refuse the history's placements as stale instead of running them."""
    from redis.asyncio import Redis

    from services.scheduler.settings import SchedulerSettings

    client = Redis.from_url(url)
    try:
        await client.flushdb()
        if plan.name == "scheduler":
            lease = SchedulerSettings.model_fields["lease_name"].default
            await client.set(f"{lease}:holder", "service_saturation", px=int(hold_s * 2000))
    finally:
        await client.aclose()


async def replay_one(
    plan: Plan,
    index: int,
    base_env: Mapping[str, str],
    pg_url: str,
    redis_url: str,
    history: Archive,
    args: argparse.Namespace,
    workdir: Path,
    pg_pid: int | None,
    core: int | None,
    run: str,
) -> Result:
    """One replay on a broker of its own holding the recorded inputs: what other replays wrote
    never lies past its marks, where a partition read to its mark would go on consuming it
    while the others catch up, within the timed interval."""
    from cli import infra

    db = f"sat_{plan.name}_{run}"
    kafka = await asyncio.to_thread(infra.start_kafka, workdir / f"kafka-{plan.name}-{run}")
    try:
        if core is not None:
            pin_elsewhere([kafka.pid or 0], core)
        await write_history(kafka.url, history, plan.topics)
        marks = {tp: len(recs) for tp, recs in history.items() if tp[0] in plan.topics}
        db_url = await asyncio.to_thread(infra.create_database, pg_url, db)
        redis_url = redis_db(redis_url, index)
        await prepare_redis(redis_url, plan, args.timeout)
        env = {
            **base_env,
            "QM_KAFKA_BOOTSTRAP": kafka.url,
            "QM_DATABASE_URL": db_url,
            "QM_REDIS_URL": redis_url,
            "QM_HTTP_PORT": str(infra.free_port()),
            **plan.env,
        }
        log = workdir / "state" / "logs" / f"sat-{plan.name}-{run}.log"
        replay = Replay(plan, env, log, core, pg_pid, kafka.pid)
        replay.poll_s = args.poll_ms / 1000
        if core is not None:
            await wait_for_quiet(core, args.quiet_busy, args.quiet_wait)
        replay.start()
        try:
            if None in plan.groups:
                return await replay.watch_feed(marks, replay.poll_s, args.timeout)
            return await replay.watch_groups(kafka.url, marks, replay.poll_s, args.timeout)
        finally:
            await asyncio.to_thread(replay.stop)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(infra.drop_database, pg_url, db)
    finally:
        await asyncio.to_thread(infra.stop, kafka)


def stack_cpu(stack: Any) -> dict[str, float]:
    out = {}
    for s in stack.services:
        with contextlib.suppress(Exception):
            out[s.name] = cpu_s(s.pid)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=5000, help="jobs offered while recording")
    parser.add_argument("--rate", type=float, default=150.0, help="offered jobs/s (recording)")
    parser.add_argument(
        "--services",
        default=",".join(SERVICES),
        help="comma-separated, from: " + ", ".join(SERVICES),
    )
    parser.add_argument("--cluster", default="onprem-h100", help="the executor replayed")
    parser.add_argument("--core", type=int, default=1, help="core each replay is pinned to")
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        default=0.5,
        help="executors' heartbeat interval while recording (default 5 s in the services)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="replays per service (median)")
    parser.add_argument(
        "--max-others",
        type=float,
        default=0.3,
        help="a replay whose core other processes kept busier than this is done again",
    )
    parser.add_argument(
        "--retries", type=int, default=3, help="extra replays per service for contended ones"
    )
    parser.add_argument("--poll-ms", type=float, default=20.0)
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=4.0,
        help="seconds a replay may wait for its core to be idle (other processes)",
    )
    parser.add_argument(
        "--quiet-busy", type=float, default=0.3, help="busy share of the core that counts as idle"
    )
    parser.add_argument("--logs", type=Path, help="copy every service's log here at the end")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after the last job")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per replay")
    args = parser.parse_args()
    wanted = {s.strip() for s in args.services.split(",") if s.strip()}
    unknown = wanted - set(SERVICES)
    if unknown:
        parser.error(f"unknown services: {', '.join(sorted(unknown))}")
    chosen = [s for s in SERVICES if s in wanted]  # the scheduler first: see the docstring
    core: int | None = args.core
    pinning = f"taskset -c {args.core}"
    if shutil.which("taskset") is None:
        core, pinning = None, "not pinned: taskset not found"
    elif args.core >= (os.cpu_count() or 1):
        parser.error(f"--core {args.core}: this machine has {os.cpu_count()} cores")
    run_with(args, chosen, core, pinning)


def run_with(args: argparse.Namespace, chosen: list[str], core: int | None, pinning: str) -> None:
    from cli import infra
    from cli.processes import stop_all
    from cli.stack import REGISTRY_PARTITIONS, Stack

    run = f"{os.getpid()}{int(time.time()) % 100000}"
    plans = [plan_for(name, run, args.cluster) for name in chosen]
    with tempfile.TemporaryDirectory(prefix="qm-sat-") as tmp:
        workdir = Path(tmp)
        servers: list[infra.Server] = []
        stack: Stack | None = None
        try:
            kafka = infra.start_kafka(workdir / "kafka")
            servers.append(kafka)
            postgres = infra.start_postgres(workdir / "pg")
            servers.append(postgres)
            redis = infra.start_redis(workdir / "redis")
            servers.append(redis)
            pg_url = postgres.url  # the maintenance database: replays get their own
            stack_db = infra.create_database(pg_url, "quartermaster")
            env = {
                "QM_KAFKA_BOOTSTRAP": kafka.url,
                "QM_DATABASE_URL": stack_db,
                "QM_REDIS_URL": redis.url,
                # A fleet's heartbeats, at a tenth of the interval: ten times the example
                # fleet's nodes, so the health service has a history worth timing.
                HEARTBEAT_ENV: f"{args.heartbeat_s:g}",
                # The registry's partitions, as a deployment has them (replicas share a
                # service's work by partition); the replays write each partition back as read.
                **REGISTRY_PARTITIONS,
            }
            print(f"service_saturation: recording {args.jobs} jobs at {args.rate:.0f}/s")
            t_stack = time.perf_counter()
            stack = Stack.start(
                workdir / "state",
                gateway_port=infra.free_port(),
                env=env,
                time_scale=600.0,
                reset_database=False,  # a fresh server: nothing to reset
            )
            started_s = time.perf_counter() - t_stack
            cpu_before = stack_cpu(stack)
            t_rec = time.perf_counter()
            recorded = asyncio.run(
                record(kafka.url, args.jobs, args.rate, run, args.settle, args.timeout)
            )
            cpu_after = stack_cpu(stack)
            record_s = time.perf_counter() - t_rec
            stop_all([s.target() for s in stack.services if s.pid])  # stores and broker stay
            history = asyncio.run(read_history(kafka.url))
            infra.stop(kafka)  # each replay gets a broker of its own, holding its inputs
            servers.remove(kafka)
            counts = topic_counts({tp: len(recs) for tp, recs in history.items()})
            # Replays run with the default heartbeat (only the executor sends them).
            base_env = {k: v for k, v in (stack.base_env or {}).items() if k != HEARTBEAT_ENV}
            print(
                "history: "
                + ", ".join(f"{t} {n}" for t, n in sorted(counts.items(), key=lambda kv: -kv[1]))
            )
            if core is not None:
                # What serves the instance (PostgreSQL, Redis, the replay's broker) and this
                # bench keep off its core, as a deployment's would be on other machines.
                pin_elsewhere([0, postgres.pid or 0, redis.pid or 0], core)
            runs: dict[str, list[Result]] = {name: [] for name in chosen}
            contended: dict[str, int] = {name: 0 for name in chosen}
            # Service by service, each on a broker holding only the recorded history. A replay
            # during which other processes kept the core busier than --max-others is done
            # again (at most --retries more times per service): its msgs/s says more about
            # them than about the service.
            for index, name in enumerate(chosen, start=1):
                kept: list[Result] = []
                attempt = 0
                while len(kept) < args.repeat and attempt < args.repeat + args.retries:
                    tag = f"{run}r{attempt}"
                    attempt += 1
                    result = asyncio.run(
                        replay_one(
                            plan_for(name, tag, args.cluster),
                            index,
                            base_env,
                            pg_url,
                            redis.url,
                            history,
                            args,
                            workdir,
                            postgres.pid,
                            core,
                            tag,
                        )
                    )
                    runs[name].append(result)
                    busy = not result.others_share <= args.max_others  # NaN: unpinned, kept
                    if core is not None and busy:
                        contended[name] += 1
                    else:
                        kept.append(result)
                    print(
                        f"  {name}: {result.records} records in {result.seconds:.2f} s, "
                        f"{fmt(result.msgs_per_s, 0)} msgs/s, {fmt(result.cpu_ms, 3)} CPU ms/msg, "
                        f"core {fmt(result.share, 2)}, others on it {fmt(result.others_share, 2)}"
                        + (f" ({result.note})" if result.note else "")
                        + (" - contended, not counted" if core is not None and busy else "")
                    )
                if kept:
                    runs[name] = kept
                else:
                    print(f"  {name}: every replay contended; the medians include them all")
        finally:
            if stack is not None:
                stack.stop()
            infra.stop_servers(list(reversed(servers)))
            if args.logs:
                shutil.copytree(workdir / "state" / "logs", args.logs, dirs_exist_ok=True)
                print(f"logs copied to {args.logs}")
    report(
        args,
        recorded,
        counts,
        plans,
        runs,
        contended,
        cpu_before,
        cpu_after,
        record_s,
        started_s,
        pinning,
    )


@dataclass
class Summary:
    """A service's replays: each figure is the median over the repeats."""

    service: str
    topics: tuple[str, ...]
    runs: list[Result]

    def med(self, figure: Callable[[Result], float]) -> float:
        return median(figure(r) for r in self.runs)

    @property
    def records(self) -> int:
        return int(self.med(lambda r: float(r.records)))

    @property
    def seconds(self) -> float:
        return self.med(lambda r: r.seconds)

    @property
    def msgs_per_s(self) -> float:
        return self.med(lambda r: r.msgs_per_s)

    @property
    def cpu_ms(self) -> float:
        return self.med(lambda r: r.cpu_ms)

    @property
    def share(self) -> float:
        return self.med(lambda r: r.share)

    @property
    def others(self) -> float:
        return self.med(lambda r: r.others_share)

    @property
    def db_cpu_ms(self) -> float:
        return self.med(lambda r: cpu_ms_per_msg(r.db_cpu_s, r.records))

    @property
    def broker_cpu_ms(self) -> float:
        return self.med(lambda r: cpu_ms_per_msg(r.broker_cpu_s, r.records))


def report(
    args: argparse.Namespace,
    recorded: Mapping[str, Any],
    counts: Mapping[str, int],
    plans: Sequence[Plan],
    runs: Mapping[str, list[Result]],
    contended: Mapping[str, int],
    cpu_before: Mapping[str, float],
    cpu_after: Mapping[str, float],
    record_s: float,
    started_s: float,
    pinning: str,
) -> None:
    from bench.machine import describe

    jobs = int(recorded["offered"])
    per_job = {p.name: msgs_per_job(counts, p.topics, jobs) for p in plans}
    done = [Summary(p.name, p.topics, list(runs[p.name])) for p in plans if runs.get(p.name)]
    rows = [
        [
            "service",
            "input topics",
            "records",
            "seconds",
            "msgs/s",
            "CPU ms/msg",
            "core share",
            "others on core",
            "DB CPU ms/msg",
            "msgs/job",
            "jobs/s",
        ]
    ]
    for r in done:
        rows.append(
            [
                r.service,
                f"{len(r.topics)}: {', '.join(r.topics[:2])}"
                + (", ..." if len(r.topics) > 2 else ""),
                f"{r.records:,}",
                fmt(r.seconds, 2),
                fmt(r.msgs_per_s, 0),
                fmt(r.cpu_ms, 3),
                fmt(r.share, 2),
                fmt(r.others, 2),
                fmt(r.db_cpu_ms, 3),
                fmt(per_job[r.service], 2),
                fmt(jobs_per_s(r.msgs_per_s, per_job[r.service]), 0),
            ]
        )
    print()
    print(
        f"medians of {args.repeat} replay(s) per service (contended ones left out); "
        f"one instance, {pinning}"
    )
    print(table(rows))
    for r in done:
        for n, run in enumerate(r.runs, start=1):
            if run.note:
                print(f"note: {r.service} (replay {n}): {run.note}")
    # Every process of the recording stack (all on two shared cores, trickle batches): CPU per
    # input record there, to compare with the saturated, batched figure. Over the recording
    # (offer, placements, settle), idle polling included; the leading scheduler's decisions too.
    inputs = {p.name: p.topics for p in plans}
    in_stack: dict[str, float] = {}
    for name in sorted(cpu_after):
        kind = name.split("-")[0]
        if kind in inputs and name in cpu_before:
            records = sum(counts.get(t, 0) for t in inputs[kind])
            in_stack[name] = cpu_ms_per_msg(cpu_after[name] - cpu_before[name], records)
    figures = {
        "msgs_per_s": rounded({r.service: r.msgs_per_s for r in done}, 0),
        "cpu_ms_per_msg": rounded({r.service: r.cpu_ms for r in done}, 4),
        # What the core would give a CPU-bound instance: 1000 / cpu_ms_per_msg. Above msgs_per_s
        # when the instance waited (on PostgreSQL, the broker) or shared its core.
        "cpu_ceiling_msgs_per_s": rounded(
            {r.service: 1000.0 / r.cpu_ms if r.cpu_ms > 0 else float("nan") for r in done}, 0
        ),
        "msgs_per_job": rounded(per_job, 3),
        "jobs_per_s": rounded(
            {r.service: jobs_per_s(r.msgs_per_s, per_job[r.service]) for r in done}, 0
        ),
        "core_share": rounded({r.service: r.share for r in done}, 2),
        "others_on_core": rounded({r.service: r.others for r in done}, 2),
        "db_cpu_ms_per_msg": rounded({r.service: r.db_cpu_ms for r in done}, 4),
        "broker_cpu_ms_per_msg": rounded({r.service: r.broker_cpu_ms for r in done}, 4),
        "records": {r.service: r.records for r in done},
        "seconds": rounded({r.service: r.seconds for r in done}, 2),
        "runs_msgs_per_s": {
            r.service: [None if math.isnan(x.msgs_per_s) else round(x.msgs_per_s) for x in r.runs]
            for r in done
        },
        "contended_replays": dict(contended),
        "in_stack_cpu_ms_per_msg": rounded(in_stack, 4),
    }
    setup = {
        **describe(),
        "jobs_offered": jobs,
        "offered_per_s": args.rate,
        "placed": recorded["placed"],
        "finished": recorded["finished"],
        "record_s": round(record_s, 1),
        "stack_start_s": round(started_s, 1),
        "history_records": dict(sorted(counts.items())),
        "clock_driven_topics": list(CLOCK_DRIVEN),
        "inputs": {p.name: list(p.topics) for p in plans},
        "executor_cluster": args.cluster,
        "heartbeat_s_recording": args.heartbeat_s,
        "repeats": args.repeat,
        "max_others_on_core": args.max_others,
        "dependencies": "PostgreSQL, Redis, the replay's broker and the bench pinned off the "
        "replay's core",
        "pinning": pinning,
        "time_scale": 600.0,
        "job": "1 accelerator, 30 virtual s, time scale 600 (e2e_throughput's)",
        "replay_broker": "a fresh one per replay, holding only the service's recorded inputs",
        "measured": "first batch received (/metrics) -> committed offsets at the marks; "
        "scheduler (standing by): service started -> snapshot caught up; "
        f"polled every {args.poll_ms:g} ms",
        "niceness": os.nice(0),
    }
    print(json.dumps({"bench": "service_saturation", **figures, "setup": setup}))


if __name__ == "__main__":
    main()
