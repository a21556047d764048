"""Benchmark: scheduler start-up and failover with a long history in its topics.

Fills a private broker with a history of about `--records` records on the scheduler's topics
(jobs queued, placed and finished, a share still running, on a 200-node fleet), then times, as
real processes (`python -m services.scheduler`):

1. a start with no snapshot: the whole history is read (the way before snapshots);
2. starts from the snapshot the first process took (`--starts` times, the median quoted);
3. failovers: a leader and a standby (both started from the snapshot), the leader killed -9,
   the time until the standby leads (`--failovers` times).

"Start" is from spawning the process to its `qm_scheduler_caught_up` gauge reading 1 (Python
start-up and imports included, about a second here); the process's own figure, from its
start-up hook, is printed beside it. Prints figures, then one JSON line (see shared BENCH.md).

    python bench/scheduler_startup.py [--records 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from aiokafka import AIOKafkaProducer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.inventory import inventory
from bench.machine import describe
from cli import infra
from schemas import topics
from services.common.topics import ensure_topics

ROOT = Path(__file__).resolve().parents[1]
NODES = 200
RUNNING = 1_000  # jobs left running at the end of the history (of 1,600 accelerators)


def envelope(event_type: str, payload: dict[str, Any], i: int) -> bytes:
    return json.dumps(
        {
            "event_id": f"{i:012d}-{uuid.uuid4().hex[:12]}",
            "type": event_type,
            "version": 1,
            "occurred_at": "2026-11-01T00:00:00+00:00",
            "producer": "bench",
            "payload": payload,
        }
    ).encode()


def capacity() -> bytes:
    event = inventory(
        "bench",
        "H100",
        NODES,
        cpu=128,
        memory_gb=1024,
        name="n{i:04d}",
        rack_size=8,
        block_size=32,
    )
    return envelope("ClusterCapacity", event.model_dump(mode="json"), 0)


def history(jobs: int) -> list[tuple[str, bytes, bytes]]:
    """(topic, key, value) for `jobs` jobs: each queued and placed; all but the last RUNNING
    finished. Placements go round the fleet one accelerator each."""
    out: list[tuple[str, bytes, bytes]] = [(topics.CLUSTER_CAPACITY, b"bench", capacity())]
    for i in range(jobs):
        job_id = f"job-{i:08d}"
        spec = {
            "job_id": job_id,
            "tenant": ("vision", "nlp", "speech")[i % 3],
            "name": "bench",
            "image": "registry.example/train:1",
            "resources": {"accelerators": 1, "cpu": 4, "memory_gb": 32},
        }
        queued = {"job_id": job_id, "spec": spec, "submitted_at": "2026-11-01T00:00:00+00:00"}
        node = f"n{i % NODES:04d}"
        placed = {
            "job_id": job_id,
            "attempt": 1,
            "epoch": 1,
            "leader": "bench",
            "cluster": "bench",
            "accelerator_type": "H100",
            "replicas": [
                {"replica": 0, "node_id": node, "accelerators": 1, "cpu": 4, "memory_gb": 32}
            ],
            "spec": spec,
        }
        key = job_id.encode()
        out.append((topics.JOB_QUEUED, key, envelope("JobQueued", queued, i)))
        out.append((topics.PLACEMENT_DECIDED, key, envelope("PlacementDecided", placed, i)))
        if i < jobs - RUNNING:
            ended = {"job_id": job_id, "outcome": "succeeded", "attempt": 1}
            out.append((topics.JOB_FINISHED, key, envelope("JobFinished", ended, i)))
    return out


async def fill(bootstrap: str, records: list[tuple[str, bytes, bytes]]) -> float:
    await ensure_topics(bootstrap)
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=1 << 20, acks=1
    )
    await producer.start()
    started = time.perf_counter()
    try:
        pending = []
        for topic, key, value in records:
            pending.append(await producer.send(topic, value, key=key))
            if len(pending) >= 20_000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return time.perf_counter() - started


def metrics(port: int) -> dict[str, float]:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("qm_scheduler_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class Scheduler:
    def __init__(self, env: dict[str, str], logdir: Path, name: str) -> None:
        self.port = infra.free_port()
        self.started = time.monotonic()
        log = open(logdir / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.scheduler"],
            env={**env, "QM_HTTP_PORT": str(self.port)},
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self._log = log

    def wait(self, name: str, value: float = 1.0, timeout_s: float = 900.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"scheduler exited with {self.process.returncode}")
            seen = metrics(self.port)
            if seen.get(name, 0.0) >= value:
                return seen
            time.sleep(0.02)
        raise TimeoutError(f"{name} did not reach {value}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def start_once(env: dict[str, str], logdir: Path, name: str) -> tuple[float, dict[str, float]]:
    scheduler = Scheduler(env, logdir, name)
    seen = scheduler.wait("qm_scheduler_caught_up")
    wall = time.monotonic() - scheduler.started
    scheduler.stop()
    return wall, seen


def failover(env: dict[str, str], logdir: Path, round_: int) -> float:
    a = Scheduler(env, logdir, f"failover-{round_}-a")
    b = Scheduler(env, logdir, f"failover-{round_}-b")
    try:
        for s in (a, b):
            s.wait("qm_scheduler_caught_up")
        deadline = time.monotonic() + 60
        leader = None
        while leader is None and time.monotonic() < deadline:
            leader = next(
                (s for s in (a, b) if metrics(s.port).get("qm_scheduler_is_leader")), None
            )
            time.sleep(0.02)
        if leader is None:
            raise RuntimeError("no scheduler leads")
        standby = b if leader is a else a
        leader.process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        standby.wait("qm_scheduler_is_leader", timeout_s=60)
        return time.monotonic() - killed
    finally:
        a.stop()
        b.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--failovers", type=int, default=3)
    args = parser.parse_args()
    jobs = max((args.records + RUNNING) // 3, RUNNING)
    with tempfile.TemporaryDirectory(prefix="qm-startup-") as tmp:
        work = Path(tmp)
        kafka = infra.start_kafka(work)
        redis = infra.start_redis(work)
        postgres = infra.ensure_postgres(work, database=f"qm_startup_{uuid.uuid4().hex[:8]}")
        servers = [kafka, redis, postgres]
        try:
            records = history(jobs)
            print(f"history: {len(records):,} records ({jobs:,} jobs, {RUNNING} running)")
            took = asyncio.run(fill(kafka.url, records))
            print(f"produced in {took:.1f} s ({len(records) / took:,.0f} records/s)")
            env = {
                **os.environ,
                "QM_KAFKA_BOOTSTRAP": kafka.url,
                "QM_REDIS_URL": redis.url,
                "QM_DATABASE_URL": postgres.url,
                "QM_LEASE_NAME": f"qm:bench:{uuid.uuid4().hex[:8]}",
                "QM_SNAPSHOT_EVERY_S": "3600",
                "QM_LOG_FORMAT": "json",
            }
            # 1. The whole history, then a snapshot.
            first = Scheduler({**env, "QM_SNAPSHOT_EVERY_S": "1"}, work, "replay")  # then one
            seen = first.wait("qm_scheduler_caught_up")
            replay_s = time.monotonic() - first.started
            replay_records = seen.get("qm_scheduler_start_records", 0.0)
            first.wait('qm_scheduler_snapshots_total{outcome="saved"}')
            snap = metrics(first.port)
            snapshot_bytes = snap.get("qm_scheduler_snapshot_bytes", 0.0)
            capture_s = snap.get("qm_scheduler_snapshot_capture_seconds_sum", 0.0) / max(
                snap.get("qm_scheduler_snapshot_capture_seconds_count", 1.0), 1.0
            )
            first.stop()
            print(
                f"start, whole log: {replay_s:.2f} s ({replay_records:,.0f} records; "
                f"in-process {seen.get('qm_scheduler_start_seconds', 0):.2f} s)"
            )
            print(f"snapshot: {snapshot_bytes / 1e6:.1f} MB, captured in {capture_s * 1000:.0f} ms")
            # 2. From the snapshot.
            walls, inner, read = [], [], []
            for i in range(args.starts):
                wall, seen = start_once(env, work, f"resume-{i}")
                if seen.get("qm_scheduler_resumed_from_snapshot") != 1:
                    raise RuntimeError("the start did not resume from the snapshot")
                walls.append(wall)
                inner.append(seen.get("qm_scheduler_start_seconds", 0.0))
                read.append(seen.get("qm_scheduler_start_records", 0.0))
                print(
                    f"start from snapshot {i + 1}: {wall:.2f} s (in-process {inner[-1]:.2f} s, "
                    f"{read[-1]:,.0f} records read)"
                )
            # 3. Failover with a standby.
            failovers = [failover(env, work, i) for i in range(args.failovers)]
            for i, f in enumerate(failovers):
                print(f"failover {i + 1}: {f:.2f} s")
            result = {
                "bench": "scheduler_startup",
                "records": len(records),
                "start_s": round(statistics.median(walls), 3),
                "start_in_process_s": round(statistics.median(inner), 3),
                "start_records_read": statistics.median(read),
                "start_full_replay_s": round(replay_s, 3),
                "failover_s": round(statistics.median(failovers), 3),
                "snapshot_bytes": int(snapshot_bytes),
                "snapshot_capture_ms": round(capture_s * 1000, 1),
                "setup": {
                    **describe(),
                    "jobs": jobs,
                    "running": RUNNING,
                    "nodes": NODES,
                    "starts": args.starts,
                    "failovers": args.failovers,
                },
            }
            print(f"median: start {result['start_s']} s, failover {result['failover_s']} s")
            print(json.dumps(result))
        finally:
            infra.stop_servers(servers)


if __name__ == "__main__":
    main()
