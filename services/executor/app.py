"""The executor service for one cluster, on the simulated backend."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI

from core.fleet import load_fleet
from schemas import topics
from services.common.bootstrap import open_outboxed
from services.common.consumer import OffsetCommitter, Records, consume_batches
from services.common.kafka import (
    OutMessage,
    envelope_for,
    make_broker,
    publish_all,
)
from services.common.policyfile import load_policy, read_yaml
from services.common.runtime import Runtime, create_http_app
from services.executor.faults import Outage, fault_router
from services.executor.fleetinfo import capacity_event, heartbeats
from services.executor.handlers import PAYLOADS, Executor, ExecutorMetrics
from services.executor.nodes import NodeBook
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
    metrics = ExecutorMetrics(runtime.registry)
    state: dict[str, Executor] = {}

    committer = OffsetCommitter()

    async def handle(records: Records) -> None:
        await state["executor"].process(records)

    consume_batches(
        broker,
        *PAYLOADS,
        group_id=f"executor-{cluster_name}",
        settings=settings,
        handle=handle,
        committer=committer,
    )

    async def finish_loop() -> None:
        while True:
            await state["executor"].finish_due(time.time())
            await asyncio.sleep(settings.tick_interval_s)

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

    @runtime.on_startup
    async def start() -> None:
        pool, relay = await open_outboxed(
            runtime, broker, committer, schema=schema_for(cluster_name), migrations=MIGRATIONS
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
        runtime.background(announce_loop)
        await broker.start()

    app = create_http_app(runtime)
    app.include_router(fault_router(cluster_name, set(nodes), broker, outage))
    app.state.runtime = runtime
    app.state.book = book
    app.state.broker = broker
    return app
