"""Submit -> placement.decided through the real running stack: latency at a fixed offered
rate, then the sustained rate under overload; and what the stack costs with nothing to do.

Uses the running stack when QM_KAFKA_BOOTSTRAP (and QM_GATEWAY_URL for --via rest) are set;
otherwise starts the whole platform as processes in a temporary directory and stops it after.

    python bench/e2e_throughput.py                 # defaults: 200/s for 20 s, then 8000 jobs
    python bench/e2e_throughput.py --via rest      # submit over HTTP instead of Kafka
    python bench/e2e_throughput.py --profile DIR   # and py-spy every process during the burst
    python bench/e2e_throughput.py --profile DIR --profile-phase fixed   # ... at the fixed rate

When the bench starts the stack itself it also reports CPU seconds per 1,000 jobs for every
process (each service, the broker, PostgreSQL) in both phases, the cores each keeps busy while
nothing is submitted (`idle_cores`; polling the broker is most of it), and per job in each
phase PostgreSQL's commits, row writes (by table too), HOT updates and WAL (the whole
server's: meaningful when the stack has the server to itself) and every consumer group's batches
and fetches (`counts_per_job`, bench/counters.py), and each process's resident memory after the
burst and the most it held (`rss_mb`, `peak_rss_mb`). In every case it reports, per phase, the
cores the whole machine kept busy and the CPU its own client took (`machine`), which tell
whether a phase was bound by the cores; with --profile, the top frames of each service
(bench/cpu.py) are printed and written to DIR/summary.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.counters import StackCounters, per_job, print_counts
from bench.cpu import (
    CpuMeter,
    MachineMeter,
    Profiler,
    is_python,
    memory_mb,
    per_thousand,
    pids_of,
    print_summary,
    summarise,
)
from bench.machine import describe, percentile
from schemas import topics
from schemas.envelope import Envelope
from schemas.ids import new_id

TENANTS = ("vision", "nlp", "speech")
IDLE_SETTLE_S = 8.0  # quiet before the idle reading: the warm-up's runs end, consumers settle
TOKENS = {"vision": "dev-vision", "nlp": "dev-nlp", "speech": "dev-speech"}


def job(i: int, run: str) -> dict[str, Any]:
    # Small, short jobs so the fleet never fills: the bench measures the pipeline.
    return {
        "tenant": TENANTS[i % 3],
        "name": f"bench-{run}-{i}",
        "replicas": 1,
        "resources": {"accelerators": 1},
        "labels": {"sim_duration_s": "30"},
    }


class Observer:
    """Follows placement.decided and job.queued and notes when each of our jobs was placed
    and queued (the queue's hop, to tell which stage limits the rate)."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.placed: dict[str, float] = {}
        self.queued: dict[str, float] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(
            topics.PLACEMENT_DECIDED,
            topics.JOB_QUEUED,
            bootstrap_servers=self.bootstrap,
            auto_offset_reset="latest",
            fetch_max_wait_ms=10,
            enable_auto_commit=False,
        )
        await self._consumer.start()
        await self._consumer.seek_to_end()
        self._task = asyncio.create_task(self._run())

    def set_poll_ms(self, ms: int) -> None:
        """How often the observer polls (its own polls would count in an idle reading)."""
        assert self._consumer is not None
        self._consumer._fetcher._fetch_max_wait_ms = ms  # aiokafka has no public setter

    async def _run(self) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(timeout_ms=100)
            now = time.perf_counter()
            for records in batches.values():
                for r in records:
                    env = json.loads(r.value)
                    if env["type"] == topics.LEADER_FENCE:
                        continue  # a new scheduler leader's fence, no placement
                    seen = self.queued if r.topic == topics.JOB_QUEUED else self.placed
                    seen.setdefault(env["payload"]["job_id"], now)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer:
            await self._consumer.stop()


class KafkaSubmitter:
    def __init__(self, bootstrap: str) -> None:
        self.producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap, linger_ms=1, max_batch_size=1 << 20
        )

    async def __aenter__(self) -> KafkaSubmitter:
        await self.producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.producer.stop()

    async def submit(self, body: dict[str, Any]) -> str:
        job_id = new_id()
        env = Envelope(
            type="JobSubmitted",
            producer="bench",
            tenant=body["tenant"],
            payload={**body, "job_id": job_id},
        )
        await self.producer.send(
            topics.JOB_SUBMITTED, env.model_dump_json().encode(), key=job_id.encode()
        )
        return job_id


class RestSubmitter:
    def __init__(self, gateway: str) -> None:
        self.client = httpx.AsyncClient(
            base_url=gateway, timeout=30, limits=httpx.Limits(max_connections=64)
        )

    async def __aenter__(self) -> RestSubmitter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def submit(self, body: dict[str, Any]) -> str:
        r = await self.client.post(
            "/v1/jobs", json=body, headers={"Authorization": f"Bearer {TOKENS[body['tenant']]}"}
        )
        r.raise_for_status()
        return str(r.json()["job_id"])


async def offer(submitter: Any, rate: float, count: int, run: str, sent: dict[str, float]) -> float:
    """Submit `count` jobs at `rate` per second (open loop); returns the seconds it took."""
    start = time.perf_counter()
    inflight: set[asyncio.Task[None]] = set()

    async def one(i: int) -> None:
        t = time.perf_counter()
        job_id = await submitter.submit(job(i, run))
        sent[job_id] = t

    for i in range(count):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(i))
        inflight.add(task)
        task.add_done_callback(inflight.discard)
    await asyncio.gather(*inflight)
    return time.perf_counter() - start


async def wait_placed(observer: Observer, sent: dict[str, float], timeout_s: float) -> None:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if all(j in observer.placed for j in sent):
            return
        await asyncio.sleep(0.1)


def latencies_ms(seen: dict[str, float], sent: dict[str, float]) -> list[float]:
    return sorted((seen[j] - t) * 1000 for j, t in sent.items() if j in seen)


def sustained_rate(done: list[float]) -> float:
    """Completions per second between the 10th and 90th percentile completions, so start-up
    and tail effects do not flatter or punish the figure."""
    lo, hi = int(len(done) * 0.1), int(len(done) * 0.9) - 1
    return (hi - lo) / (done[hi] - done[lo]) if hi > lo else float("nan")


def cpu_report(phase: str, used: dict[str, float], jobs: int) -> dict[str, float]:
    per = per_thousand(used, jobs)
    total = round(sum(per.values()), 2)
    parts = ", ".join(f"{n} {v:.2f}" for n, v in sorted(per.items(), key=lambda kv: -kv[1]))
    print(f"{phase}: CPU s per 1,000 jobs: {total:.2f} in all ({parts})")
    return {**per, "total": total}


def machine_report(phase: str, whole: dict[str, float], jobs: int) -> dict[str, float]:
    """How busy the machine was over a phase, and what the bench's own client (submitting and
    observing) took of it: a phase whose busy cores are near the core count was bound by
    the cores, and the client's share was not the stack's to use."""
    bench_ms = round(whole["bench_cpu_s"] * 1000 / jobs, 2) if jobs > 0 else 0.0
    print(
        f"{phase}: the machine kept {whole['busy_cores']:.2f} of {whole['cores']:.0f} cores busy"
        f" over {whole['seconds']:.1f} s; the bench's own process {bench_ms:.2f} CPU s per"
        " 1,000 jobs"
    )
    return {**whole, "bench_cpu_s_per_1000_jobs": bench_ms}


def idle_report(used: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores each process keeps busy with nothing submitted."""
    per = {name: round(s / seconds, 3) for name, s in used.items()}
    total = round(sum(per.values()), 3)
    parts = ", ".join(f"{n} {v:.3f}" for n, v in sorted(per.items(), key=lambda kv: -kv[1]))
    print(f"idle for {seconds:.0f} s: {total:.3f} cores in all ({parts})")
    return {**per, "total": total}


def memory_report(pids: dict[str, int]) -> dict[str, dict[str, float]]:
    """Each process's resident memory after the burst, and the most it ever held."""
    memory = memory_mb(pids)
    if memory:
        total = sum(m["rss"] for m in memory.values())
        parts = ", ".join(
            f"{n} {m['rss']:.0f} (peak {m['peak']:.0f})"
            for n, m in sorted(memory.items(), key=lambda kv: -kv[1]["peak"])
        )
        print(f"memory after the burst, MB resident: {total:.0f} in all ({parts})")
    return memory


@contextlib.contextmanager
def profiling(args: argparse.Namespace, pids: dict[str, int], phase: str) -> Iterator[bool]:
    """py-spy on every Python process of the stack during `phase`, if that is the phase
    --profile asked for; yields whether it profiles."""
    if not args.profile or args.profile_phase != phase:
        yield False
        return
    profiled = {n: p for n, p in pids.items() if is_python(p)}
    with Profiler(profiled, Path(args.profile)):
        yield bool(profiled)


def write_summary(out_dir: str, cpu: dict[str, float]) -> None:
    text = print_summary(summarise(Path(out_dir)), cpu)
    (Path(out_dir) / "summary.txt").write_text(text + "\n")


async def measure(
    bootstrap: str,
    gateway: str | None,
    args: argparse.Namespace,
    pids: dict[str, int],
    counters: StackCounters,
) -> dict[str, Any]:
    observer = Observer(bootstrap)
    await observer.start()
    submitter: Any = (
        RestSubmitter(gateway) if args.via == "rest" and gateway else KafkaSubmitter(bootstrap)
    )
    try:
        async with submitter:
            # Warm-up: connections, consumer positions, first cycles.
            warm: dict[str, float] = {}
            await offer(submitter, 50, 50, "warm", warm)
            await wait_placed(observer, warm, 30)

            cpu: dict[str, dict[str, float]] = {}
            meter = CpuMeter(pids)
            idle: dict[str, float] = {}
            if pids and args.idle_s > 0:
                # Nothing submitted, once the warm-up's jobs are through: what polling,
                # heartbeats and clocks cost at every rate. (After the burst the gateway and
                # PostgreSQL are still catching up for tens of seconds.)
                observer.set_poll_ms(1000)  # the bench's own 10 ms polls are not the stack's
                await asyncio.sleep(IDLE_SETTLE_S)
                meter.start()
                await asyncio.sleep(args.idle_s)
                idle = idle_report(meter.stop(), args.idle_s)
                observer.set_poll_ms(10)
                await asyncio.sleep(1.0)  # its slow fetch in flight has come back
            fixed: dict[str, float] = {}
            count = int(args.rate * args.seconds)
            counted: dict[str, Any] = {}
            machine: dict[str, dict[str, float]] = {}
            whole = MachineMeter()
            before = await counters.read()
            meter.start()
            whole.start()
            with profiling(args, pids, "fixed") as profiled:
                t_fixed = time.perf_counter()
                took = await offer(submitter, args.rate, count, "fixed", fixed)
                await wait_placed(observer, fixed, 60)
                fixed_s = time.perf_counter() - t_fixed  # before the profiler's write-up
                machine["fixed"] = machine_report("fixed rate", whole.stop(), count)
            if pids:
                cpu["fixed"] = cpu_report("fixed rate", meter.stop(), count)
            counted["fixed"] = per_job(before, await counters.read(), count, fixed_s)
            print_counts("fixed rate", counted["fixed"])
            if profiled:
                write_summary(args.profile, cpu.get("fixed", {}))
            lat = latencies_ms(observer.placed, fixed)
            queued = latencies_ms(observer.queued, fixed)
            print(
                f"offered {args.rate:.0f}/s for {took:.1f} s: {len(lat)}/{count} placed, "
                f"p50 {percentile(lat, 0.5):.1f} ms, p99 {percentile(lat, 0.99):.1f} ms, "
                f"max {lat[-1] if lat else float('nan'):.1f} ms; queued (the queue's hop) "
                f"p50 {percentile(queued, 0.5):.1f} ms, p99 {percentile(queued, 0.99):.1f} ms"
            )

            burst: dict[str, float] = {}
            before = await counters.read()
            meter.start()
            whole.start()
            with profiling(args, pids, "burst") as profiled:
                t0 = time.perf_counter()
                await offer(submitter, args.burst_rate, args.burst, "burst", burst)
                await wait_placed(observer, burst, 300)
                burst_s = time.perf_counter() - t0
                machine["burst"] = machine_report("overload", whole.stop(), args.burst)
            if pids:
                cpu["burst"] = cpu_report("overload", meter.stop(), args.burst)
            counted["burst"] = per_job(before, await counters.read(), args.burst, burst_s)
            print_counts("overload", counted["burst"])
            if profiled:
                write_summary(args.profile, cpu.get("burst", {}))
            memory = memory_report(pids)
            done = sorted(observer.placed[j] for j in burst if j in observer.placed)
            sustained = sustained_rate(done)
            queued_rate = sustained_rate(
                sorted(observer.queued[j] for j in burst if j in observer.queued)
            )
            overall = len(done) / (done[-1] - t0) if done else float("nan")
            print(
                f"overload {args.burst} jobs offered at {args.burst_rate:.0f}/s: "
                f"{len(done)} placed, sustained {sustained:.0f} jobs/s "
                f"(overall {overall:.0f} jobs/s incl. ramp); the queue's hop alone "
                f"sustained {queued_rate:.0f} jobs/s"
            )
    finally:
        await observer.stop()
    return {
        "jobs_per_s": round(sustained, 1),
        "p50_ms": round(percentile(lat, 0.5), 1),
        "p99_ms": round(percentile(lat, 0.99), 1),
        "queued_p50_ms": round(percentile(queued, 0.5), 1),
        "queued_p99_ms": round(percentile(queued, 0.99), 1),
        "offered_per_s": args.rate,
        "placed_fixed": len(lat),
        "submitted_fixed": count,
        "placed_burst": len(done),
        "overall_jobs_per_s": round(overall, 1),
        "queued_per_s": round(queued_rate, 1),
        "cpu_s_per_1000_jobs": cpu,
        "machine": machine,
        "counts_per_job": counted,
        "idle_cores": idle,
        "peak_rss_mb": {name: m["peak"] for name, m in memory.items()},
        "rss_mb": {name: m["rss"] for name, m in memory.items()},
    }


@contextlib.contextmanager
def platform_urls() -> Iterator[tuple[str, str | None, str, dict[str, int], StackCounters]]:
    """(kafka, gateway, where, pids, counters): the running stack's (pids and services'
    metrics unknown: no CPU or batch figures; PostgreSQL's counts when QM_DATABASE_URL is set),
    or a private stack started here (pids of every service and of the broker)."""
    if os.environ.get("QM_KAFKA_BOOTSTRAP"):
        kafka = os.environ["QM_KAFKA_BOOTSTRAP"]
        counters = StackCounters(os.environ.get("QM_DATABASE_URL"), {})
        yield kafka, os.environ.get("QM_GATEWAY_URL"), "running stack", {}, counters
        return
    from cli import infra
    from cli.stack import Stack

    with tempfile.TemporaryDirectory(prefix="qm-bench-") as tmp:
        kafka = infra.start_kafka(Path(tmp) / "kafka")
        env = {"QM_KAFKA_BOOTSTRAP": kafka.url}
        try:
            stack = Stack.start(
                Path(tmp) / "state",
                gateway_port=infra.free_port(),
                env=env,
                time_scale=600.0,
                reset_database=True,  # stored state of another broker's log must not leak in
            )
            try:
                pids = pids_of(stack, kafka)
                counters = StackCounters(
                    stack.server_env()["QM_DATABASE_URL"],
                    {s.name: f"http://127.0.0.1:{s.port}/metrics" for s in stack.services},
                )
                where = "stack started by the bench"
                yield kafka.url, stack.gateway_url, where, pids, counters
            finally:
                stack.stop()
        finally:
            infra.stop(kafka)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--via", choices=("kafka", "rest"), default="kafka")
    parser.add_argument("--rate", type=float, default=200.0, help="fixed offered rate, jobs/s")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--burst", type=int, default=8000, help="jobs in the overload phase")
    parser.add_argument("--burst-rate", type=float, default=2000.0)
    parser.add_argument(
        "--idle-s",
        type=float,
        default=10.0,
        help="seconds of CPU reading with nothing submitted, after the warm-up (0: none)",
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="py-spy every service during one phase (--profile-phase)"
    )
    parser.add_argument(
        "--profile-phase",
        choices=("burst", "fixed"),
        default="burst",
        help="the phase --profile samples: the overload (default) or the fixed rate",
    )
    args = parser.parse_args()
    with platform_urls() as (bootstrap, gateway, where, pids, counters):
        print(f"e2e_throughput via {args.via} against the {where} ({bootstrap})")
        figures = asyncio.run(measure(bootstrap, gateway, args, pids, counters))
    setup = {
        **describe(),
        "via": args.via,
        "fixed_seconds": args.seconds,
        "idle_seconds": args.idle_s,
        "burst_jobs": args.burst,
        "burst_offered_per_s": args.burst_rate,
        "job": "1 accelerator, 30 virtual s, time scale 600",
    }
    print(json.dumps({"bench": "e2e_throughput", **figures, "setup": setup}))


if __name__ == "__main__":
    main()
