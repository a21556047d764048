"""The fuzz's liveness checks: no consumer group left behind (committed offsets against the
true ends of what was written), no service process dead or restarted, and what the service
logs say about crashed loops and records the pipeline's net had to catch."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from cli.stack import Stack


async def partition_counts(bootstrap: str, names: tuple[str, ...]) -> dict[str, int]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        await consumer.topics()
        return {t: len(consumer.partitions_for_topic(t) or ()) for t in names}
    finally:
        await consumer.stop()


async def true_ends(bootstrap: str, parts: list[TopicPartition]) -> dict[TopicPartition, int]:
    """Each partition's end as a fetch's high watermark reports it: ListOffsets on Tansu says
    only where the last batch begins (+1), so read from there to learn where it ends."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        fetch_max_wait_ms=50,
        max_partition_fetch_bytes=8 << 20,
    )
    await consumer.start()
    try:
        consumer.assign(parts)
        listed = await consumer.end_offsets(parts)
        for tp, end in listed.items():
            consumer.seek(tp, max(0, end - 1))
        ends: dict[TopicPartition, int] = {tp: 0 for tp, end in listed.items() if end == 0}
        for _ in range(100):
            if len(ends) == len(parts):
                break
            await consumer.getmany(timeout_ms=200, max_records=1)
            for tp in parts:
                high = consumer.highwater(tp)
                if tp not in ends and high is not None and high >= listed[tp]:
                    ends[tp] = high
        return ends
    finally:
        await consumer.stop()


@dataclass
class GroupReport:
    behind: dict[str, dict[str, int]] = field(default_factory=dict)  # group -> "t[p]" -> n
    missing: list[str] = field(default_factory=list)  # expected groups the broker never saw
    listed: list[str] = field(default_factory=list)
    wait_s: float = 0.0


async def wait_groups_caught_up(
    bootstrap: str,
    groups: dict[str, tuple[str, ...]],
    counts: dict[str, int],
    timeout_s: float,
) -> GroupReport:
    """Wait until every group has committed, on every partition it consumes, at least the
    end that partition had when we started waiting; report what is still behind. `groups`
    are the groups the services declare; any other group the broker lists is audited too."""
    parts_of = {
        g: [TopicPartition(t, p) for t in names for p in range(counts.get(t, 0))]
        for g, names in groups.items()
    }
    marks = await true_ends(bootstrap, sorted({tp for ps in parts_of.values() for tp in ps}))
    report = GroupReport()
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    await admin.start()
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        report.listed = sorted(g for g, _kind in await admin.list_consumer_groups())
        report.missing = sorted(set(groups) - set(report.listed))
        # A group no service here declares (a new consumer): held to the partitions it has
        # committed on at all.
        every = sorted({tp for ps in parts_of.values() for tp in ps})
        for group in set(report.listed) - set(groups):
            committed = await admin.list_consumer_group_offsets(group, partitions=every)
            parts_of[group] = [tp for tp, meta in committed.items() if meta and meta.offset >= 0]
        while True:
            report.behind = {}
            for group, parts in parts_of.items():
                if group in report.missing:
                    continue
                committed = await admin.list_consumer_group_offsets(group, partitions=parts)
                lag = {
                    f"{tp.topic}[{tp.partition}]": marks[tp] - (meta.offset if meta else -1)
                    for tp in parts
                    if marks.get(tp, 0) > 0
                    and ((meta := committed.get(tp)) is None or meta.offset < marks[tp])
                }
                if lag:
                    report.behind[group] = lag
            if not report.behind or loop.time() - started > timeout_s:
                break
            await asyncio.sleep(1.0)
    finally:
        await admin.close()
    report.wait_s = loop.time() - started
    return report


@dataclass
class ServiceReport:
    died: list[str] = field(default_factory=list)  # "name: why"
    loop_crashes: dict[str, int] = field(default_factory=dict)
    net_catches: dict[str, int] = field(default_factory=dict)  # records the pipeline gave up
    retries: dict[str, int] = field(default_factory=dict)
    stalls: dict[str, int] = field(default_factory=dict)
    samples: list[str] = field(default_factory=list)  # a few lines of crashes, to read


def check_services(stack: Stack, pids: dict[str, int | None]) -> ServiceReport:
    report = ServiceReport()
    for service in stack.services:
        if not service.running():
            code = service.process.poll() if service.process is not None else None
            report.died.append(f"{service.name}: exited ({code}); see {service.log}")
        elif service.pid != pids.get(service.name):
            report.died.append(
                f"{service.name}: restarted (pid {pids.get(service.name)} -> {service.pid})"
            )
        events = _log_events(service.log)
        starts = events["service started"]
        if starts > 1:
            report.died.append(f"{service.name}: started {starts} times ({service.log})")
        for counter, event in (
            (report.loop_crashes, "background loop crashed; restarting"),
            (report.net_catches, "record given up and dead-lettered"),
            (report.retries, "consumer failed; retrying"),
            (report.stalls, "consumer stalled; alert raised"),
        ):
            if events[event]:
                counter[service.name] = events[event]
        if events["background loop crashed; restarting"] or events["(traceback)"]:
            report.samples.extend(_crash_lines(service.log, service.name))
    return report


def _log_events(log: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return counts
    for line in lines:
        if line.startswith("Traceback"):
            counts["(traceback)"] += 1
        if not line.startswith("{"):
            continue
        try:
            counts[str(json.loads(line).get("event"))] += 1
        except ValueError:
            continue
    return counts


def _crash_lines(log: Path, name: str, most: int = 3) -> list[str]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "loop crashed" in line or line.startswith("Traceback"):
            try:
                doc = json.loads(line)
                exc = str(doc.get("exception", "")).strip().splitlines()
                out.append(
                    f"{name}: {doc.get('event')} {doc.get('loop', '')}: {exc[-1] if exc else ''}"
                )
            except ValueError:
                out.append(f"{name}: {line[:300]}")
            if len(out) >= most:
                break
    return out
