"""The executor's `kubernetes` backend against the in-repo Kubernetes API double: how many
placements per second it turns into running pods, and how long a 16-replica gang takes from
`placement.decided` to `job.started`.

The executor runs as its own process (`python -m services.executor`, the cluster's fleet entry
saying `backend: {kind: kubernetes, kubeconfig: ..., namespace: ...}`) on a broker, PostgreSQL
and Redis; the API double (tests/kubeapi) runs as another process with its auto kubelet (a
bound, ungated pod is Running at once). The bench adds labelled GPU nodes through the double's
HTTP hooks, produces placements itself (no scheduler) and reads `job.started` back.

1. Throughput: `--pods` single-replica 1-GPU placements on `--nodes` nodes of 8 GPUs, all
   produced at once (a burst, not a paced rate); the time until every `job.started` arrived.
   `pods_per_s` = pods / (first produce -> last job.started). Also the per-placement latency
   (produced -> job.started seen) and the executor's CPU seconds per 1,000 pods (/proc).
2. Gang: a 16-replica gang, 8 GPUs per replica on 16 nodes of its own; produced ->
   job.started, `--rounds` times. Between rounds the gang's pods are marked Succeeded (the
   double's `pod_succeeded` hook), the bench waits for job.finished and for the executor to
   delete the pods, so each round starts on free nodes. The pods of phase 1 stay Running.

Figures beyond the two BENCH.md keys: `pods_per_s_10_90` (between the 10th and 90th percentile
starts), `placement_p50_ms`/`_p99_ms`/`_max_ms` (phase 1, produced -> job.started seen; in a
burst mostly queueing), `to_running_p50_ms` (produced -> the executor's `started_at`),
`pods_created_per_s` and `gang16_created_s` (produced -> the executor's "gang created" log line:
every pod created and ungated), `gang16_finish_s` (the last `pod_succeeded` hook answered ->
job.finished seen), `cpu_s_per_1000_pods` (phase 1, per process, from /proc), RSS in MB.

Servers: QM_KAFKA_BOOTSTRAP, QM_DATABASE_URL (a server URL: a fresh database is created on it
and dropped after), QM_REDIS_URL when set; else a Tansu broker and redis-server of its own and
the local PostgreSQL (else the embedded one).

    python bench/k8s_backend.py                       # 500 pods on 64 nodes, 5 gang rounds
    python bench/k8s_backend.py --pods 1000 --nodes 128
    python bench/k8s_backend.py --profile DIR         # py-spy the executor and the double
                                                      # during phase 1 (bench/cpu.py)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from importlib import metadata
from operator import contains
from pathlib import Path
from typing import Any

import httpx
import yaml
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu import Profiler, print_summary, summarise  # noqa: E402
from bench.machine import describe, percentile  # noqa: E402
from cli import infra  # noqa: E402
from cli.probes import postgres_answers  # noqa: E402
from cli.processes import Target, spawn, stop_all  # noqa: E402
from schemas import topics  # noqa: E402
from schemas.envelope import Envelope  # noqa: E402
from schemas.events import PlacementDecided, ReplicaAssignment  # noqa: E402
from schemas.job import JobSpec  # noqa: E402
from services.common.topics import ensure_topics  # noqa: E402
from tests.kubeapi import write_kubeconfig  # noqa: E402

NAMESPACE = "quartermaster-jobs"
GANG = 16
GANG_GPUS = 8
GPUS_PER_NODE = 8
JOB_ANNOTATION = "quartermaster.io/job"
FAILURES = (topics.PLACEMENT_REFUSED, topics.JOB_RUN_FAILED, topics.JOB_PREEMPTED)
WATCHED = (topics.JOB_STARTED, topics.JOB_FINISHED, *FAILURES)
CLK_TCK = os.sysconf("SC_CLK_TCK")
Obj = dict[str, Any]


# --- /proc --------------------------------------------------------------------------------


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of `pid` so far (nan if it is gone)."""
    if pid is None:
        return float("nan")
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    fields = raw[raw.rfind(")") + 2 :].split()  # fields[0] is field 3 (state)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime: fields 14, 15


def memory_mb(pid: int | None) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak) of `pid`, in MB."""
    out: dict[str, float] = {}
    if pid is None:
        return out
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def created_at(log: Path, jobs: set[str]) -> dict[str, float]:
    """job -> wall time of the executor's "gang created" log line (every pod created and its
    gate lifted), from its JSON log; empty if the log says nothing of the kind."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            if '"gang created"' not in line:
                continue
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                entry = json.loads(line)
                if entry.get("event") == "gang created" and entry.get("job_id") in jobs:
                    stamp = datetime.fromisoformat(entry["timestamp"]).timestamp()
                    out.setdefault(entry["job_id"], stamp)
    return out


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- what the bench produces ----------------------------------------------------------------


def placement(
    job_id: str, cluster: str, nodes: list[str], gpus: int, epoch: int
) -> PlacementDecided:
    spec = JobSpec.model_validate(
        {
            "tenant": "vision",
            "job_id": job_id,
            "image": "trainer:1",
            "replicas": len(nodes),
            "resources": {"accelerators": gpus, "cpu": 2, "memory_gb": 8},
        }
    )
    return PlacementDecided(
        job_id=job_id,
        attempt=1,
        epoch=epoch,
        leader="bench",
        cluster=cluster,
        accelerator_type="H100",
        spec=spec,
        replicas=[
            ReplicaAssignment(replica=i, node_id=n, accelerators=gpus, cpu=2, memory_gb=8)
            for i, n in enumerate(nodes)
        ],
    )


def encoded(p: PlacementDecided) -> bytes:
    env = Envelope(type="PlacementDecided", producer="bench", payload=p.model_dump(mode="json"))
    return env.model_dump_json().encode()


def node_body(name: str, index: int) -> Obj:
    """The `add_node` hook's arguments: an 8-GPU H100 node as the executor reads one."""
    return {
        "name": name,
        "labels": {
            "quartermaster.io/accelerator": "H100",
            "kubernetes.io/hostname": f"host-{name}",
            "topology.kubernetes.io/rack": f"rack-{index // 8}",
            "topology.kubernetes.io/zone": f"block-{index // 32}",
            "quartermaster.io/price-tier": "reserved",
        },
        "allocatable": {"nvidia.com/gpu": str(GPUS_PER_NODE), "cpu": "96", "memory": "1024Gi"},
        "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}],
    }


def write_fleet(workdir: Path, cluster: str, kubeconfig: Path) -> Path:
    """A fleet file of one cluster on Kubernetes: no nodes here, its Node objects are the
    inventory (also the e2e flows' fleet)."""
    fleet = {
        "clusters": [
            {
                "name": cluster,
                "location": "us-east-dc2",
                "kind": "on_prem",
                "prices": {"H100": {"reserved": 2.10, "on_demand": 4.50}},
                "backend": {
                    "kind": "kubernetes",
                    "kubeconfig": kubeconfig.name,  # relative to the fleet file
                    "namespace": NAMESPACE,
                },
            }
        ]
    }
    path = workdir / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    return path


# --- what comes back ----------------------------------------------------------------------


@dataclass
class Observer:
    """Reads the outcome topics from the start (no consumer group, so no join wait) and notes
    when each of this run's jobs was first seen starting, finishing or failing."""

    bootstrap: str
    prefix: str
    started: dict[str, float] = field(default_factory=dict)  # job -> perf_counter seen
    started_at: dict[str, float] = field(default_factory=dict)  # job -> payload started_at
    finished: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # job -> "topic: reason"
    _consumer: AIOKafkaConsumer | None = None
    _task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, enable_auto_commit=False, fetch_max_wait_ms=10
        )
        await consumer.start()
        self._consumer = consumer
        await consumer.topics()  # the cluster metadata partitions_for_topic reads
        parts = [
            TopicPartition(t, p) for t in WATCHED for p in consumer.partitions_for_topic(t) or ()
        ]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        self._task = asyncio.create_task(self._run(consumer))

    async def _run(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=100, max_records=5000)
            seen = time.perf_counter()
            for tp, records in batches.items():
                for r in records:
                    self._note(tp.topic, r.value, seen)

    def _note(self, topic: str, value: bytes | None, seen: float) -> None:
        try:
            env = json.loads(value or b"")
        except ValueError:
            return
        payload = env.get("payload") if isinstance(env, dict) else None
        job_id = payload.get("job_id") if isinstance(payload, dict) else None
        if not isinstance(job_id, str) or not job_id.startswith(self.prefix):
            return
        assert isinstance(payload, dict)
        if topic == topics.JOB_STARTED:
            if job_id not in self.started:
                self.started[job_id] = seen
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    self.started_at[job_id] = datetime.fromisoformat(
                        payload["started_at"]
                    ).timestamp()
        elif topic == topics.JOB_FINISHED:
            self.finished.setdefault(job_id, seen)
        else:
            reason = payload.get("reason_code") or payload.get("reason") or "?"
            self.failed.setdefault(job_id, f"{topic}: {reason} {payload.get('message', '')}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()


async def wait_for(
    done: Callable[[], bool],
    what: str,
    timeout_s: float,
    observer: Observer,
    jobs: set[str],
    alive: Callable[[], None],
) -> None:
    """Poll `done`; fail early when one of `jobs` failed or a process died, or at timeout."""
    deadline = time.perf_counter() + timeout_s
    while not done():
        bad = {j: observer.failed[j] for j in jobs if j in observer.failed}
        if bad:
            first = sorted(bad.items())[:3]
            raise RuntimeError(f"{len(bad)} job(s) failed while waiting for {what}: {first}")
        alive()
        if time.perf_counter() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.02)


# --- the processes ------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    process: Any  # subprocess.Popen[bytes]
    log: Path
    port: int

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def check(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited ({self.process.returncode}); last lines of {self.log}:\n"
                f"{log_tail(self.log)}"
            )


def child_env(extra: dict[str, str]) -> dict[str, str]:
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath, **extra}


def start_double(workdir: Path, procs: list[Proc]) -> tuple[Proc, str]:
    port = infra.free_port()
    log = workdir / "logs" / "kubeapi.log"
    argv = [sys.executable, "-m", "tests.kubeapi", "--port", str(port), "--auto-kubelet"]
    proc = Proc("kubeapi double", spawn(argv, log=log, env=child_env({}), cwd=ROOT), log, port)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    with httpx.Client(timeout=1.0) as client:
        while True:
            proc.check()
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/healthz").status_code == 200:
                    return proc, url
            if time.monotonic() > deadline:
                raise TimeoutError(f"the double did not answer; {log_tail(log)}")
            time.sleep(0.05)


def start_executor(
    workdir: Path, procs: list[Proc], servers: dict[str, str], cluster: str, fleet: Path
) -> Proc:
    port = infra.free_port()
    log = workdir / "logs" / "executor.log"
    env = child_env(
        {
            "QM_KAFKA_BOOTSTRAP": servers["kafka"],
            "QM_DATABASE_URL": servers["postgres"],
            "QM_REDIS_URL": servers["redis"],
            "QM_FLEET_FILE": str(fleet),
            "QM_POLICY_FILE": str(ROOT / "examples" / "policy.yaml"),
            "QM_AUTH_FILE": str(ROOT / "examples" / "auth.yaml"),
            "QM_EXECUTOR_CLUSTER": cluster,
            "QM_HTTP_PORT": str(port),
            "QM_TIME_SCALE": "1",
            "QM_LOG_FORMAT": "json",
            "QM_LOG_LEVEL": "info",
        }
    )
    argv = [sys.executable, "-m", "services.executor"]
    proc = Proc("executor", spawn(argv, log=log, env=env, cwd=ROOT), log, port)
    procs.append(proc)
    return proc


async def wait_healthy(proc: Proc, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=1.0) as client:
        while True:
            proc.check()
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"http://127.0.0.1:{proc.port}/healthz")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.name} not healthy; {log_tail(proc.log)}")
            await asyncio.sleep(0.1)


# --- the bench ----------------------------------------------------------------------------


@dataclass
class Run:
    args: argparse.Namespace
    workdir: Path
    servers: dict[str, str]
    procs: list[Proc]
    broker_pid: int | None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:6])

    @property
    def cluster(self) -> str:
        return f"k8s-bench-{self.run_id}"

    def alive(self) -> None:
        for proc in self.procs:
            proc.check()


class Double:
    """The double over HTTP: its test hooks and the REST API."""

    def __init__(self, url: str) -> None:
        self.client = httpx.AsyncClient(base_url=url, timeout=30)

    async def hook(self, hook: str, /, **kwargs: Any) -> Any:
        r = await self.client.post(f"/_double/{hook}", json=kwargs)
        r.raise_for_status()
        return r.json().get("result")

    async def pods_of(self, job_id: str) -> list[str]:
        r = await self.client.get(f"/api/v1/namespaces/{NAMESPACE}/pods")
        r.raise_for_status()
        return sorted(
            p["metadata"]["name"]
            for p in r.json().get("items") or []
            if (p["metadata"].get("annotations") or {}).get(JOB_ANNOTATION) == job_id
        )

    async def close(self) -> None:
        await self.client.aclose()


async def produce(
    producer: AIOKafkaProducer, cluster: str, placements: list[PlacementDecided]
) -> dict[str, float]:
    """Send every placement at once; job -> perf_counter just before its send."""
    sent: dict[str, float] = {}
    futures = []
    headers = [("cluster", cluster.encode())]  # as the scheduler sets it
    for p in placements:
        sent[p.job_id] = time.perf_counter()
        futures.append(
            await producer.send(
                topics.PLACEMENT_DECIDED, encoded(p), key=p.job_id.encode(), headers=headers
            )
        )
    await asyncio.gather(*futures)
    return sent


async def bench(run: Run, double_url: str, double_proc: Proc) -> dict[str, Any]:
    args = run.args
    await ensure_topics(run.servers["kafka"])
    double = Double(double_url)
    producer = AIOKafkaProducer(
        bootstrap_servers=run.servers["kafka"], linger_ms=2, max_batch_size=1 << 20
    )
    observer = Observer(run.servers["kafka"], f"kb-{run.run_id}-")
    await producer.start()
    try:
        # The cluster: a namespace, the throughput nodes, the gang's nodes, a warm-up node.
        r = await double.client.post("/api/v1/namespaces", json={"metadata": {"name": NAMESPACE}})
        r.raise_for_status()
        t_nodes = [f"t-{i:03d}" for i in range(args.nodes)]
        g_nodes = [f"g-{i:02d}" for i in range(GANG)]
        for i, name in enumerate([*t_nodes, *g_nodes, "w-0"]):
            await double.hook("add_node", **node_body(name, i))
        kubeconfig = write_kubeconfig(run.workdir / "kubeconfig", double_url, NAMESPACE)
        fleet = write_fleet(run.workdir, run.cluster, kubeconfig)
        executor = start_executor(run.workdir, run.procs, run.servers, run.cluster, fleet)
        await wait_healthy(executor)
        await observer.start()
        print(
            f"executor pid {executor.pid} and double pid {double_proc.pid} up; cluster "
            f"{run.cluster}: {args.nodes + GANG + 1} nodes of {GPUS_PER_NODE} GPUs"
        )

        async def until(done: Callable[[], bool], what: str, jobs: set[str]) -> None:
            await wait_for(done, what, args.timeout, observer, jobs, run.alive)

        # Warm-up: the executor's consumer has joined and its clients are connected.
        warm = f"kb-{run.run_id}-warm"
        t = time.perf_counter()
        await produce(producer, run.cluster, [placement(warm, run.cluster, ["w-0"], 1, args.epoch)])
        await until(lambda: warm in observer.started, "the warm-up job to start", {warm})
        took = observer.started[warm] - t
        print(f"warm-up: job.started after {took:.2f} s (the first: consumer join, connections)")
        await asyncio.sleep(1.0)

        # Phase 1: a burst of single-pod placements.
        jobs = [f"kb-{run.run_id}-t{i:05d}" for i in range(args.pods)]
        burst = [
            placement(j, run.cluster, [t_nodes[i % args.nodes]], 1, args.epoch)
            for i, j in enumerate(jobs)
        ]
        payload = [encoded(p) for p in burst[:1]]  # the size, for the setup line
        cpu0 = {"executor": cpu_s(executor.pid), "double": cpu_s(double_proc.pid)}
        cpu0["broker"] = cpu_s(run.broker_pid)
        profile = (
            Profiler({"executor": executor.pid, "double": double_proc.pid}, args.profile)
            if args.profile
            else contextlib.nullcontext()
        )
        with profile:
            wall0, t0 = time.time(), time.perf_counter()
            sent = await produce(producer, run.cluster, burst)
            produced_s = time.perf_counter() - t0
            await until(
                lambda: all(j in observer.started for j in jobs),
                f"{len(jobs)} job.started",
                set(jobs),
            )
        cpu1 = {"executor": cpu_s(executor.pid), "double": cpu_s(double_proc.pid)}
        cpu1["broker"] = cpu_s(run.broker_pid)
        seen = sorted(observer.started[j] for j in jobs)
        window = seen[-1] - t0
        pods_per_s = len(jobs) / window
        lo, hi = int(len(seen) * 0.1), int(len(seen) * 0.9) - 1
        steady = (hi - lo) / (seen[hi] - seen[lo]) if hi > lo and seen[hi] > seen[lo] else math.nan
        lat = sorted((observer.started[j] - sent[j]) * 1000 for j in jobs)
        # started_at is stamped by the executor when it sees the pods running: produce ->
        # there is the executor and the API; there -> seen is the outbox and the broker hop.
        to_running = sorted(
            (observer.started_at[j] - wall0) * 1000 for j in jobs if j in observer.started_at
        )
        per_k = {
            name: round((cpu1[name] - cpu0[name]) * 1000 / len(jobs), 2)
            for name in cpu0
            if not math.isnan(cpu0[name])
        }
        mem1 = memory_mb(executor.pid)
        print(
            f"phase 1: {len(jobs)} single-pod placements produced in {produced_s:.2f} s, all "
            f"started after {window:.2f} s: {pods_per_s:.1f} pods/s "
            f"(10-90%: {steady:.1f}/s); produced -> job.started p50 "
            f"{percentile(lat, 0.5):.0f} ms, p99 {percentile(lat, 0.99):.0f} ms, max "
            f"{lat[-1]:.0f} ms"
        )
        print(
            "phase 1: CPU s per 1,000 pods: "
            + ", ".join(f"{n} {v:.2f}" for n, v in per_k.items())
            + f"; executor RSS {mem1.get('VmRSS', math.nan):.0f} MB"
        )
        if args.profile:
            cpu_used = {n: cpu1[n] - cpu0[n] for n in ("executor", "double")}
            text = print_summary(summarise(args.profile), cpu_used)
            (args.profile / "summary.txt").write_text(text)
        await asyncio.sleep(1.0)

        # Phase 2: a 16-replica gang, round after round on the same freed nodes.
        starts: list[float] = []
        sent_wall: dict[str, float] = {}
        finishes: list[float] = []
        for k in range(args.rounds):
            job = f"kb-{run.run_id}-g{k}"
            p = placement(job, run.cluster, g_nodes, GANG_GPUS, args.epoch)
            c0 = cpu_s(executor.pid)
            sent_wall[job] = time.time()
            sent_g = await produce(producer, run.cluster, [p])
            await until(partial(contains, observer.started, job), f"gang {job} to start", {job})
            took = observer.started[job] - sent_g[job]
            starts.append(took)
            c1 = cpu_s(executor.pid)
            pods = await double.pods_of(job)
            if len(pods) != GANG:
                raise RuntimeError(f"gang {job}: {len(pods)} pods on the double, not {GANG}")
            await asyncio.gather(
                *(double.hook("pod_succeeded", namespace=NAMESPACE, name=n) for n in pods)
            )
            t_done = time.perf_counter()
            await until(partial(contains, observer.finished, job), f"gang {job} to finish", {job})
            finishes.append(observer.finished[job] - t_done)
            deadline = time.perf_counter() + args.timeout
            while await double.pods_of(job):  # the executor deletes them after the end
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"the pods of {job} were not deleted")
                await asyncio.sleep(0.05)
            print(
                f"gang round {k + 1}: placement.decided -> job.started {took:.3f} s "
                f"(executor CPU {c1 - c0:.2f} s); pods Succeeded -> job.finished "
                f"{finishes[-1]:.3f} s"
            )
        mem2 = memory_mb(executor.pid)
        # Where the time goes, from the executor's log: produced -> every pod created and
        # ungated (the executor's consumer, its store, the API calls), and the rest.
        created = created_at(executor.log, {*jobs, *sent_wall})
        t_created = [created[j] for j in jobs if j in created]
        pods_created_per_s = (
            len(t_created) / (max(t_created) - wall0) if len(t_created) == len(jobs) else math.nan
        )
        gang_created = [created[j] - w for j, w in sent_wall.items() if j in created]
        if gang_created:
            print(
                f"gang: produced -> every pod created and ungated (executor log) median "
                f"{statistics.median(gang_created):.3f} s; phase 1 pods created at "
                f"{pods_created_per_s:.1f}/s"
            )
        return {
            "pods_per_s": round(pods_per_s, 1),
            "gang16_start_s": round(statistics.median(starts), 3),
            "gang16_start_samples_s": [round(s, 3) for s in starts],
            "gang16_finish_s": round(statistics.median(finishes), 3),
            "pods_per_s_10_90": round(steady, 1),
            "phase1_window_s": round(window, 2),
            "placement_p50_ms": round(percentile(lat, 0.5), 1),
            "placement_p99_ms": round(percentile(lat, 0.99), 1),
            "placement_max_ms": round(lat[-1], 1),
            "to_running_p50_ms": round(percentile(to_running, 0.5), 1),
            "pods_created_per_s": round(pods_created_per_s, 1),
            "gang16_created_s": (
                round(statistics.median(gang_created), 3) if gang_created else None
            ),
            "cpu_s_per_1000_pods": per_k,
            "executor_rss_mb": mem1.get("VmRSS"),
            "executor_peak_rss_mb": mem2.get("VmHWM"),
            "double_peak_rss_mb": memory_mb(double_proc.pid).get("VmHWM"),
            "refused_or_failed": len(observer.failed),
            "placement_bytes": len(payload[0]),
        }
    finally:
        await observer.stop()
        await producer.stop()
        await double.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pods", type=int, default=500, help="phase 1 placements (1 pod each)")
    parser.add_argument("--nodes", type=int, default=64, help="phase 1 nodes of 8 GPUs")
    parser.add_argument("--rounds", type=int, default=5, help="16-replica gangs, one by one")
    parser.add_argument("--epoch", type=int, default=1, help="leader epoch of the placements")
    parser.add_argument("--timeout", type=float, default=180.0, help="per wait, seconds")
    parser.add_argument("--profile", type=Path, help="py-spy executor and double in phase 1")
    parser.add_argument("--keep", type=Path, help="work here (logs kept) instead of a temp dir")
    args = parser.parse_args()
    if args.pods > args.nodes * GPUS_PER_NODE:
        parser.error(f"--pods {args.pods} do not fit {args.nodes} nodes of {GPUS_PER_NODE} GPUs")
    # SIGTERM cleans up as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    workdir = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="qm-k8s-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    owned: list[infra.Server] = []
    procs: list[Proc] = []
    db: tuple[str, str] | None = None  # (maintenance url, name)
    result: dict[str, Any] | None = None
    setup: dict[str, Any] = {}
    failed = False
    try:
        if url := os.environ.get("QM_KAFKA_BOOTSTRAP"):
            kafka = infra.Server("kafka", url, "env")
        else:
            kafka = infra.start_kafka(workdir / "kafka")
            owned.append(kafka)
        if url := os.environ.get("QM_REDIS_URL"):
            redis_url = url
        else:
            redis = infra.start_redis(workdir / "redis")
            owned.append(redis)
            redis_url = redis.url
        pg_server = os.environ.get("QM_DATABASE_URL")
        if pg_server is None:
            if postgres_answers(infra.LOCAL_POSTGRES):
                pg_server = infra.LOCAL_POSTGRES
            else:
                pg = infra.start_postgres(workdir / "postgres")
                owned.append(pg)
                pg_server = pg.url
        maintenance = infra.with_database(pg_server, "postgres")
        name = f"qm_k8s_bench_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        database = infra.create_database(maintenance, name)
        db = (maintenance, name)
        servers = {"kafka": kafka.url, "postgres": database, "redis": redis_url}
        double_proc, double_url = start_double(workdir, procs)
        run = Run(args, workdir, servers, procs, kafka.pid if kafka.owned else None)
        result = asyncio.run(bench(run, double_url, double_proc))
        versions = describe()
        for dist in ("kubernetes_asyncio", "aiohttp", "fastapi"):
            with contextlib.suppress(metadata.PackageNotFoundError):
                versions["versions"][dist] = metadata.version(dist)
        setup = {
            **versions,
            "pods": args.pods,
            "nodes": args.nodes,
            "gpus_per_node": GPUS_PER_NODE,
            "gang_replicas": GANG,
            "gang_gpus_per_replica": GANG_GPUS,
            "gang_rounds": args.rounds,
            "offered": "phase 1: every placement produced at once (a burst)",
            "kafka": "env" if kafka.how == "env" else "own tansu",
            "api": "tests.kubeapi double in its own process, auto kubelet (run_delay 0)",
            "phase1_pods_running_during_gangs": args.pods + 1,
            "executor_fetch_max_wait_ms": "service default",
        }
    except Exception:
        failed = True
        raise
    finally:
        if failed:
            for proc in procs:
                print(f"--- last lines of {proc.log}:\n{log_tail(proc.log, 15)}", file=sys.stderr)
        # The executor first, so that it does not log the API going away.
        for proc in reversed(procs):
            stop_all([Target(proc.pid, signal.SIGTERM, process=proc.process)])
        if db is not None:
            with contextlib.suppress(Exception):
                infra.drop_database(*db)
        infra.stop_servers(owned)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    assert result is not None
    print(
        f"k8s_backend: {result['pods_per_s']} pods/s over {args.pods} pods; 16-replica gang "
        f"placement.decided -> job.started median {result['gang16_start_s']} s over "
        f"{args.rounds} rounds"
    )
    print(json.dumps({"bench": "k8s_backend", **result, "setup": setup}))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("k8s_backend: interrupted; every process it started is stopped", file=sys.stderr)
        sys.exit(130)
