"""The executor service for one cluster, on the simulated backend: it consumes placements and
orders, ends runs on their clock, and sends inventory, heartbeats and gang progress."""

from __future__ import annotations

import asyncio
import random
import time

from fastapi import FastAPI

from core.fleet import load_fleet
from schemas import topics
from services.common.bootstrap import open_outboxed
from services.common.consumer import Consumers, Records
from services.common.kafka import (
    OutMessage,
    envelope_for,
    make_broker,
    publish_all,
)
from services.common.policyfile import load_policy, read_yaml
from services.common.runtime import Runtime, create_http_app
from services.executor.faults import FaultInjector, Outage, Slowdowns, fault_router
from services.executor.fleetinfo import capacity_event, heartbeats
from services.executor.handlers import PAYLOADS, Executor
from services.executor.metrics import ExecutorMetrics
from services.executor.nodes import NodeBook
from services.executor.random_faults import RandomFaults
from services.executor.runs import progress
from services.executor.settings import ExecutorSettings
from services.executor.store import MIGRATIONS, ExecutorStore, schema_for

NAME = "executor"


def create_app(settings: ExecutorSettings | None = None) -> FastAPI:
    settings = settings or ExecutorSettings()
    cluster_name = settings.executor_cluster
    producer = f"{NAME}/{cluster_name}"
    runtime = Runtime(producer, settings)
    broker = make_broker(settings, producer, runtime.registry)
    policy = load_policy(settings.policy_file)
    clusters, all_nodes = load_fleet(read_yaml(settings.fleet_file), policy.accelerator_types)
    if cluster_name not in clusters:
        raise SystemExit(
            f"cluster {cluster_name!r} is not in {settings.fleet_file} "
            f"(clusters: {', '.join(sorted(clusters))})"
        )
    cluster = clusters[cluster_name]  # type: ignore[index]
    nodes = {str(n.node_id): n for n in all_nodes.values() if n.cluster == cluster_name}
    book = NodeBook(nodes)
    outage = Outage()
    slowdowns = Slowdowns()
    injector = FaultInjector(
        cluster_name,
        {node_id: n.accelerators for node_id, n in nodes.items()},
        broker,
        slowdowns,
        settings.time_scale,
    )
    random_mode = RandomFaults(
        cluster_name, injector.nodes, injector.apply, time_scale=settings.time_scale
    )
    metrics = ExecutorMetrics(runtime.registry)
    state: dict[str, Executor] = {}

    consumers = Consumers(broker, settings, service=NAME, registry=runtime.registry)

    async def handle(records: Records) -> None:
        await state["executor"].process(records)

    consumers.subscribe(*PAYLOADS, group_id=f"executor-{cluster_name}", handle=handle)

    async def finish_loop() -> None:
        while True:
            await state["executor"].finish_due(time.time())
            await asyncio.sleep(settings.tick_interval_s)

    async def tombstone_loop() -> None:
        while True:
            await asyncio.sleep(settings.tombstone_prune_every_s)
            await state["executor"].prune_tombstones(settings.tombstone_retention_s)

    async def announce_loop() -> None:
        """Inventory now and then (the scheduler builds its fleet from it) and heartbeats."""
        last_capacity = 0.0
        while True:
            if outage.dark:  # a simulated outage: the cluster says nothing at all
                await asyncio.sleep(settings.heartbeat_interval_s)
                continue
            out: list[OutMessage] = []
            if time.monotonic() - last_capacity >= settings.capacity_interval_s:
                cap = capacity_event(cluster, nodes)
                out.append(
                    OutMessage(
                        topics.CLUSTER_CAPACITY,
                        cluster_name,
                        envelope_for("ClusterCapacity", cap, producer=producer),
                    )
                )
                last_capacity = time.monotonic()
            for beat in heartbeats(cluster_name, book):
                out.append(
                    OutMessage(
                        topics.NODE_HEARTBEAT,
                        beat.node_id,
                        envelope_for("NodeHeartbeat", beat, producer=producer),
                    )
                )
            await publish_all(broker, out)
            metrics.overcommitted.set(len(book.audit()))
            await asyncio.sleep(settings.heartbeat_interval_s)

    async def progress_loop() -> None:
        """Step times of every running gang; a slowed node's replica lags its peers. Telemetry:
        published directly, a lost report is replaced by the next one."""
        # Seeded so a run repeats; the noise only needs to be small, not unpredictable.
        rng = random.Random(settings.fault_seed or 0)
        while True:
            await asyncio.sleep(settings.progress_interval_s)
            if outage.dark:
                continue
            factors = slowdowns.current()
            jobs = sorted(state["executor"].running.values(), key=lambda j: j.job_id)
            out = [
                OutMessage(
                    topics.JOB_PROGRESS,
                    report.job_id,
                    envelope_for("JobProgress", report, producer=producer, tenant=job.tenant),
                )
                for job in jobs
                if (report := progress(job, cluster_name, factors, rng)) is not None
            ]
            await publish_all(broker, out)

    @runtime.on_startup
    async def start() -> None:
        pool, relay = await open_outboxed(
            runtime, broker, consumers, schema=schema_for(cluster_name), migrations=MIGRATIONS
        )
        store = ExecutorStore(pool, cluster_name)
        executor = Executor(
            cluster_name,
            book,
            store,
            relay,
            metrics,
            time_scale=settings.time_scale,
            default_duration_s=settings.default_duration_s,
        )
        await executor.restore()
        state["executor"] = executor
        runtime.background(finish_loop)
        runtime.background(tombstone_loop)
        runtime.background(announce_loop)
        runtime.background(progress_loop)
        if settings.fault_rate_per_hour > 0:
            random_mode.configure(settings.fault_rate_per_hour, settings.fault_seed)
        runtime.background(random_mode.run_forever)
        await broker.start()

    app = create_http_app(runtime)
    app.include_router(fault_router(injector, outage, random_mode))
    app.state.runtime = runtime
    app.state.executor = state  # "executor": the Executor once started
    app.state.book = book
    app.state.broker = broker
    app.state.slowdowns = slowdowns
    app.state.random_faults = random_mode
    return app
