"""Fuzz the running platform with hostile records, seeded and reproducible, then audit it.

For every topic some service consumes (bench/fuzz_topology.py reads the services' own
subscriptions), every class of hostile record and every partition, records are written with
a plain aiokafka producer choosing the partition, as a foreign platform would
(bench/fuzz_records.py, fuzz_submissions.py, fuzz_ghosts.py). Then a valid probe job goes to
each partition of `job.submitted`, then valid traffic: bare JobSpec JSON on every partition
and some jobs through the gateway's REST API. Then the log is read from the start.

What must become of each record (Expect), on `job.submitted` / on every other consumed topic:

- unparseable, wrong_types, nan_infinity, control_chars, oversized (2 MiB: the bound is 1 MiB),
  deep_nesting (64 levels: the bound is 32; and 100,000, which breaks parsers):
  refused. On job.submitted: dead-lettered (matched by source topic, partition and offset) or
  a `job.rejected` with a reason code (matched by job id). Elsewhere: dead-lettered by at
  least one consumer.
- unknown_type (an unknown type, another event's type, version 99): on job.submitted never
  queued (ignored, dead-lettered or rejected); elsewhere tolerated.
- unknown_entity: on job.submitted rejected with its exact reason (unknown_tenant,
  unknown_queue, unknown_priority_class, unknown_accelerator_type, gang_too_large);
  elsewhere tolerated: a valid event about a job, run or node nobody knows
  (bench/fuzz_ghosts.py) may be ignored.
- duplicate: on job.submitted the job runs once and ends; the same job id from another tenant
  is rejected `duplicate_job_id`, a reused idempotency key `duplicate_submission`; elsewhere
  the same record twice is tolerated.
- out_of_order: a submission claiming year 1, 1970 or 9999 runs and ends; on
  job.cancel.requested a cancel written before its job makes the job end `canceled`;
  elsewhere (the later event first, times far off) tolerated.

"Tolerated" records must not stall anything, which the other checks catch. Pass: every valid
job (probes, bare, REST) ends `succeeded`; every record got what its class requires; no
service process died or restarted and no background loop crashed; every consumer group has
committed, on every partition it consumes, the end that partition had once the traffic was
done; the probe written after the hostile records to each partition of `job.submitted` was
answered.

    python bench/fuzz.py                       # 2 rounds, 200 valid jobs, seed 7
    python bench/fuzz.py --rounds 5 --jobs 1000 --seed 3 --keep /tmp/qm-fuzz
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
import zlib
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from aiokafka import AIOKafkaProducer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fuzz_audit import (
    ANSWER_TOPICS,
    TRAIL_TOPICS,
    Coords,
    Evidence,
    Tail,
    Verdict,
    judge,
    locate,
)
from bench.fuzz_health import (
    GroupReport,
    ServiceReport,
    check_services,
    partition_counts,
    wait_groups_caught_up,
)
from bench.fuzz_records import HostileRecord, generate_round
from bench.fuzz_report import failure_details, failure_lines, report
from bench.fuzz_submissions import valid_spec
from bench.fuzz_topology import clusters_with_types, consumed_topics, consumer_groups
from bench.fuzz_wire import Expect, HostileClass, dump
from bench.machine import describe
from cli import infra
from cli.probes import postgres_answers
from cli.stack import REGISTRY_PARTITIONS, Stack
from schemas import topics

TENANTS = {"vision": "dev-vision", "nlp": "dev-nlp", "speech": "dev-speech"}
TIME_SCALE = 600.0


class Fuzz:
    """One run against a started stack: write, wait, audit."""

    def __init__(self, stack: Stack, opts: argparse.Namespace) -> None:
        self.stack = stack
        self.opts = opts
        self.bootstrap = stack.server("kafka").url
        self.records: list[tuple[HostileRecord, Coords]] = []
        self.valid: set[str] = set()  # jobs that must end succeeded
        self.answered: dict[str, str | None] = {}  # job -> required outcome (None: any end)
        self.probes: dict[str, tuple[int, float]] = {}  # job -> (partition, written at)
        self.probe_answer_s: dict[str, float] = {}  # probe job -> seconds to its end
        self.evidence = Evidence()

    async def run(self) -> dict[str, Any]:
        opts = self.opts
        groups = consumer_groups()
        consumed = consumed_topics()
        counts = await partition_counts(self.bootstrap, (*consumed, topics.DEAD_LETTER))
        pids = {s.name: s.pid for s in self.stack.services}
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            max_request_size=2 * opts.oversize_bytes + (1 << 20),
            max_batch_size=1 << 20,
            linger_ms=5,
        )
        await producer.start()
        skip: set[Coords] = set()
        try:
            async with Tail(self.bootstrap, (*ANSWER_TOPICS, *TRAIL_TOPICS), skip) as tail:
                pre = [
                    await self._submit(producer, f"pre-{p}", p)
                    for p in range(counts[topics.JOB_SUBMITTED])
                ]
                await self._wait_jobs(tail, set(pre), opts.drain_s)
                missing = [j for j in pre if not self.evidence.terminal(j)]
                if missing:
                    raise RuntimeError(f"the stack did not run its warm-up jobs: {missing}")
                started = time.monotonic()
                watcher = asyncio.create_task(self._watch(tail))
                try:
                    await self._write_all(producer, consumed, counts, skip)
                finally:
                    watcher.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watcher
                written_s = time.monotonic() - started
                wanted = set(self.valid) | set(self.answered)
                await self._wait_jobs(tail, wanted, opts.drain_s)
                terminal_s = time.monotonic() - started
                report = await wait_groups_caught_up(self.bootstrap, groups, counts, opts.drain_s)
                drained_s = time.monotonic() - started
                verdicts = await self._settle(tail, opts.settle_s)
            located = await self._locate(skip)
        finally:
            await producer.stop()
        services = check_services(self.stack, pids)
        timings = {"write_s": written_s, "terminal_s": terminal_s, "drain_s": drained_s}
        return self._figures(verdicts, report, services, timings, located)

    async def _write_all(
        self,
        producer: AIOKafkaProducer,
        consumed: tuple[str, ...],
        counts: dict[str, int],
        skip: set[Coords],
    ) -> None:
        opts = self.opts
        clusters = clusters_with_types()
        per_round = max(1, opts.jobs // opts.rounds)
        rest = max(0, opts.rest_jobs // opts.rounds)
        partitions = counts[topics.JOB_SUBMITTED]
        for r in range(opts.rounds):
            rnd = generate_round(
                opts.seed,
                r,
                {t: counts[t] for t in consumed},
                clusters,
                datetime.now(UTC),
                opts.oversize_bytes,
            )
            sent = [
                await producer.send(x.topic, x.value, key=x.key, partition=x.partition)
                for x in rnd.records
            ]
            for record, meta in zip(rnd.records, await asyncio.gather(*sent), strict=True):
                coords = (record.topic, record.partition, meta.offset)
                skip.add(coords)
                self.records.append((record, coords))
                if record.expect is Expect.ANSWERED and record.job_id:
                    self.answered[record.job_id] = record.outcome
            print(f"round {r}: {len(rnd.records)} hostile records written", flush=True)
            for p in range(partitions):
                job_id = await self._submit(producer, f"probe-{r}-{p}", p)
                self.probes[job_id] = (p, time.monotonic())
            for i in range(per_round - rest):
                await self._submit(producer, f"valid-{r}-{i}", i % partitions)
            await self._submit_rest(rest, r)
            for late in rnd.late_jobs:
                await producer.send_and_wait(
                    topics.JOB_SUBMITTED,
                    late.value,
                    key=late.job_id.encode(),
                    partition=late.partition,
                )
                self.answered[late.job_id] = late.outcome
        await producer.flush()

    async def _submit(self, producer: AIOKafkaProducer, name: str, partition: int) -> str:
        job_id = f"fz{self.opts.seed}-{name}"
        tenant = sorted(TENANTS)[zlib.crc32(name.encode()) % len(TENANTS)]
        value = dump(valid_spec(job_id, tenant)).encode()
        await producer.send_and_wait(
            topics.JOB_SUBMITTED, value, key=job_id.encode(), partition=partition
        )
        self.valid.add(job_id)
        return job_id

    async def _submit_rest(self, count: int, round_no: int) -> None:
        async with httpx.AsyncClient(base_url=self.stack.gateway_url, timeout=30) as client:
            for i in range(count):
                tenant = sorted(TENANTS)[i % len(TENANTS)]
                body = valid_spec(f"unused-{i}", tenant)
                body.pop("job_id")
                body["name"] = f"fuzz-rest-{round_no}-{i}"
                r = await client.post(
                    "/v1/jobs", json=body, headers={"Authorization": f"Bearer {TENANTS[tenant]}"}
                )
                r.raise_for_status()
                self.valid.add(str(r.json()["job_id"]))

    async def _read(self, tail: Tail) -> None:
        self.evidence.add(await tail.read())
        now = time.monotonic()
        for job_id, (_partition, at) in self.probes.items():
            if job_id not in self.probe_answer_s and self.evidence.terminal(job_id):
                self.probe_answer_s[job_id] = now - at

    async def _watch(self, tail: Tail) -> None:
        """Follows the answers while records are still being written (probe answer times)."""
        while True:
            await self._read(tail)
            await asyncio.sleep(0.3)

    def _not_succeeded(self) -> dict[str, str | None]:
        """Valid jobs that did not end succeeded, with how they ended (None: no end seen)."""
        ends = {j: self.evidence.terminal(j) for j in self.valid}
        return {j: end for j, end in ends.items() if end != "succeeded"}

    async def _locate(self, skip: set[Coords]) -> dict[str, list[str]]:
        """The diagnosis of each valid job that did not succeed (fuzz_audit.locate); a failure
        to read it is reported in its place, never raised over the run's figures."""
        jobs = set(self._not_succeeded())
        if not jobs:
            return {}
        try:
            return await locate(self.bootstrap, topics.JOB_FINISHED, jobs, skip, self.evidence.seen)
        except Exception as exc:
            return {j: [f"not read afresh: {exc!r}"] for j in jobs}

    async def _wait_jobs(self, tail: Tail, job_ids: set[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            await self._read(tail)
            if all(self.evidence.terminal(j) for j in job_ids) or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.5)

    async def _settle(self, tail: Tail, settle_s: float) -> list[Verdict]:
        """Verdicts, reading on for a while if some refusals are still missing (dead letters
        travel through outboxes and may trail the committed offsets a little)."""
        deadline = time.monotonic() + settle_s
        while True:
            self.evidence.add(await tail.read())
            verdicts = [judge(r, c, self.evidence) for r, c in self.records]
            if all(v.ok for v in verdicts) or time.monotonic() > deadline:
                return verdicts
            await asyncio.sleep(2.0)

    def _figures(
        self,
        verdicts: list[Verdict],
        report: GroupReport,
        services: ServiceReport,
        timings: dict[str, float],
        located: dict[str, list[str]],
    ) -> dict[str, Any]:
        by_class: dict[str, dict[str, int]] = {c.value: defaultdict(int) for c in HostileClass}
        for v in verdicts:
            row = by_class[v.record.cls.value]
            row["sent"] += 1
            row[v.how] += 1
            row["failed"] += 0 if v.ok else 1
        failed = self._not_succeeded()
        not_done = sorted(failed)
        failures = {
            "valid_jobs": [
                f"{j}: {failed[j] or 'no terminal state'}; "
                f"last {self.evidence.trail.get(j, [])[-4:]}; "
                f"job.finished read afresh: {located.get(j) or 'none in the broker'}"
                for j in not_done
            ],
            "hostile": failure_lines(verdicts),
            "services": [*services.died, *services.samples],
            "groups": [f"{g} never joined or committed" for g in report.missing]
            + [f"{g} behind: {lag}" for g, lag in sorted(report.behind.items())],
            "probes": [
                f"probe {job_id} on job.submitted[{p}] unanswered; "
                f"last {self.evidence.trail.get(job_id, [])[-4:]}"
                for job_id, (p, _at) in sorted(self.probes.items())
                if job_id not in self.probe_answer_s
            ],
        }
        if services.loop_crashes:
            failures["services"].append(f"background loops crashed: {services.loop_crashes}")
        return {
            "records": len(verdicts),
            "dead_lettered": sum(v.how == "dead_lettered" for v in verdicts),
            "rejected": sum(v.how == "rejected" for v in verdicts),
            "ignored": sum(v.how == "ignored" for v in verdicts),
            "unanswered": sum(not v.ok for v in verdicts) + len(not_done),
            "valid_jobs": len(self.valid),
            "valid_succeeded": len(self.valid) - len(not_done),
            "probe_answer_s_max": round(max(self.probe_answer_s.values(), default=float("nan")), 2),
            **{name: round(seconds, 1) for name, seconds in timings.items()},
            "drain_after_write_s": round(timings["drain_s"] - timings["write_s"], 1),
            "groups": len(report.listed),
            "groups_behind": len(report.behind) + len(report.missing),
            "service_deaths": len(services.died),
            "loop_crashes": sum(services.loop_crashes.values()),
            "net_catches": services.net_catches,
            "retries": services.retries,
            "by_class": {c: dict(row) for c, row in by_class.items()},
            "failures": failures,
            "failed_records": failure_details(verdicts, self.evidence),
        }


@contextlib.contextmanager
def private_servers(workdir: Path) -> Iterator[dict[str, str]]:
    """A broker, a Redis and a fresh database of our own: hostile records must reach no other
    stack, and schedulers on a shared Redis would share one lease."""
    kafka = infra.start_kafka(workdir / "kafka")
    redis = infra.start_redis(workdir / "redis")
    postgres = None
    try:
        server = os.environ.get("QM_DATABASE_URL") or infra.LOCAL_POSTGRES
        if not os.environ.get("QM_DATABASE_URL") and not postgres_answers(server):
            postgres = infra.start_postgres(workdir / "postgres")
            server = postgres.url
        name = f"qm_fuzz_{os.getpid()}_{int(time.time())}"
        database = infra.create_database(server, name)
        try:
            yield {
                "QM_KAFKA_BOOTSTRAP": kafka.url,
                "QM_REDIS_URL": redis.url,
                "QM_DATABASE_URL": database,
                # A deployment's partitions: the hostile records vary by partition, and a
                # probe goes to each (bench/fuzz_records.py).
                **REGISTRY_PARTITIONS,
            }
        finally:
            infra.drop_database(server, name)
    finally:
        for server_ in (postgres, redis, kafka):
            if server_ is not None:
                infra.stop(server_)


def fuzz(
    seed: int = 7,
    rounds: int = 2,
    jobs: int = 200,
    rest_jobs: int | None = None,
    oversize_bytes: int = 2 << 20,
    drain_s: float = 300.0,
    settle_s: float = 20.0,
    keep: Path | None = None,
) -> dict[str, Any]:
    """Start a stack of its own (600x time), fuzz it and return the audited figures. With
    `keep`, the stack's logs stay there (`state/logs/`)."""
    opts = argparse.Namespace(
        seed=seed,
        rounds=max(1, rounds),
        jobs=jobs,
        rest_jobs=jobs // 10 if rest_jobs is None else rest_jobs,
        oversize_bytes=oversize_bytes,
        drain_s=drain_s,
        settle_s=settle_s,
    )
    with contextlib.ExitStack() as scope:
        if keep is None:
            workdir = Path(scope.enter_context(tempfile.TemporaryDirectory(prefix="qm-fuzz-")))
        else:
            keep.mkdir(parents=True, exist_ok=True)
            workdir = keep
        env = scope.enter_context(private_servers(workdir))
        stack = Stack.start(
            workdir / "state", gateway_port=infra.free_port(), env=env, time_scale=TIME_SCALE
        )
        try:
            figures = asyncio.run(Fuzz(stack, opts).run())
        finally:
            stack.stop()
    details = figures.pop("failed_records")
    if keep is not None:
        (keep / "fuzz-failures.json").write_text(json.dumps(details, indent=1) + "\n")
        figures["logs"] = str(workdir / "state" / "logs")
    figures["setup"] = {
        **describe(),
        "seed": seed,
        "rounds": opts.rounds,
        "jobs": jobs,
        "rest_jobs": opts.rest_jobs,
        "oversize_bytes": oversize_bytes,
        "time_scale": TIME_SCALE,
        "topics": len(consumed_topics()),
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of hostile records")
    parser.add_argument("--jobs", type=int, default=200, help="valid jobs, over all rounds")
    parser.add_argument("--rest-jobs", type=int, help="of which through REST (default 10%%)")
    parser.add_argument("--oversize-mib", type=float, default=2.0)
    parser.add_argument("--drain-s", type=float, default=300.0)
    parser.add_argument("--keep", type=Path, help="keep the stack's state and logs here")
    args = parser.parse_args()
    figures = fuzz(
        seed=args.seed,
        rounds=args.rounds,
        jobs=args.jobs,
        rest_jobs=args.rest_jobs,
        oversize_bytes=int(args.oversize_mib * (1 << 20)),
        drain_s=args.drain_s,
        keep=args.keep,
    )
    print(report(figures))
    failures = figures.pop("failures")
    figures["failed_checks"] = sorted(k for k, v in failures.items() if v)
    print(json.dumps({"bench": "fuzz", **figures}))


if __name__ == "__main__":
    main()
