"""The executor service for one cluster: it consumes placements and orders and sends inventory
and heartbeats. On the simulated backend it ends runs on their clock and reports gang progress;
on the kubernetes backend the cluster runs them (services/executor/kube/)."""

from __future__ import annotations

import asyncio
import random
import time
from datetime import UTC, datetime

from fastapi import FastAPI

from core.fleet import load_fleet, load_pools
from schemas import topics
from schemas.health import NodeProbe
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
from services.executor.backend import Backend
from services.executor.elastic import ElasticPools
from services.executor.faults import FaultInjector, Outage, Slowdowns, fault_router
from services.executor.fleetinfo import capacity_event, heartbeats
from services.executor.handlers import PAYLOADS, Executor
from services.executor.kube.backend import KubeBackend
from services.executor.kube.connect import (
    api_client,
    device_loss_kind,
    kube_options,
    node_labels,
    provisioning_options,
)
from services.executor.kube.inventory import KubeInventory
from services.executor.kube.provisioning import KubePools
from services.executor.metrics import ExecutorMetrics
from services.executor.nodes import NodeBook
from services.executor.pools import PoolBook
from services.executor.random_faults import RandomFaults
from services.executor.runs import progress, readiness
from services.executor.settings import ExecutorSettings, with_fleet_backend
from services.executor.store import MIGRATIONS, ExecutorStore, schema_for

NAME = "executor"


def create_app(settings: ExecutorSettings | None = None) -> FastAPI:
    settings = settings or ExecutorSettings()
    fleet_doc = read_yaml(settings.fleet_file)
    try:
        settings = with_fleet_backend(settings, fleet_doc, settings.fleet_file)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    cluster_name = settings.executor_cluster
    producer = f"{NAME}/{cluster_name}"
    runtime = Runtime(producer, settings)
    broker = make_broker(settings, producer, runtime.registry)
    policy = load_policy(settings.policy_file)
    clusters, all_nodes = load_fleet(fleet_doc, policy.accelerator_types)
    if cluster_name not in clusters:
        raise SystemExit(
            f"cluster {cluster_name!r} is not in {settings.fleet_file} "
            f"(clusters: {', '.join(sorted(clusters))})"
        )
    cluster = clusters[cluster_name]  # type: ignore[index]
    # On Kubernetes the nodes are the cluster's Node objects (KubeInventory), not the fleet's.
    kubernetes = settings.executor_backend == "kubernetes"
    nodes = {
        str(n.node_id): n
        for n in all_nodes.values()
        if n.cluster == cluster_name and not kubernetes
    }
    book = NodeBook(nodes)
    # Elastic pools: simulated nodes (ElasticPools), or on Kubernetes ProvisioningRequests for
    # cluster-autoscaler (KubePools, made once the cluster's API is connected).
    pool_book = PoolBook(
        cluster_name,
        load_pools(fleet_doc, policy.accelerator_types, policy.prices).get(cluster.cluster_id, []),
        settings.time_scale,
        settings.fault_seed,
    )
    announce_due = {"capacity": 0.0}  # monotonic time of the last inventory; 0: send now

    def announce_now() -> None:
        announce_due["capacity"] = 0.0

    elastic: list[ElasticPools] = [
        ElasticPools(pool_book, book, announce_now, lambda out: publish_all(broker, out))
    ]
    inventory: list[KubeInventory] = []  # the cluster's nodes, once connected
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

    async def handle_pools(records: Records) -> None:
        await elastic[0].handle(records)

    if pool_book.pools:
        consumers.subscribe(
            topics.AUTOSCALE_DECIDED,
            group_id=f"executor-{cluster_name}-pools",
            handle=handle_pools,
        )

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
        while True:
            if outage.dark:  # a simulated outage: the cluster says nothing at all
                await asyncio.sleep(settings.heartbeat_interval_s)
                continue
            out: list[OutMessage] = []
            if time.monotonic() - announce_due["capacity"] >= settings.capacity_interval_s:
                now_nodes = inventory[0].nodes() if inventory else nodes
                cap = capacity_event(
                    cluster,
                    {**now_nodes, **elastic[0].ready_nodes()},
                    pool_book.status(book.used),
                )
                out.append(
                    OutMessage(
                        topics.CLUSTER_CAPACITY,
                        cluster_name,
                        envelope_for("ClusterCapacity", cap, producer=producer),
                    )
                )
                announce_due["capacity"] = time.monotonic()
            silent = inventory[0].silent() if inventory else set()
            for beat in heartbeats(cluster_name, book):
                if beat.node_id in silent:
                    continue
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
            now = datetime.now(UTC)
            out += [
                OutMessage(
                    topics.SERVICE_LOAD,
                    ready.service,
                    envelope_for("ReplicaReported", ready, producer=producer, tenant=job.tenant),
                )
                for job in jobs
                if (ready := readiness(job, cluster_name, now)) is not None
            ]
            await publish_all(broker, out)

    @runtime.on_startup
    async def start() -> None:
        pool, relay = await open_outboxed(
            runtime, broker, consumers, schema=schema_for(cluster_name), migrations=MIGRATIONS
        )
        store = ExecutorStore(pool, cluster_name)
        kube: KubeBackend | None = None
        backend: Backend | None = None
        if kubernetes:
            kube = await connect_kubernetes()
            backend = kube
        await elastic[0].start(store)
        executor = Executor(
            cluster_name,
            book,
            store,
            relay,
            metrics,
            time_scale=settings.time_scale,
            default_duration_s=settings.default_duration_s,
            backend=backend,
            tracing=runtime.tracing,
        )
        elastic[0].changing = executor.changing
        await executor.restore()
        state["executor"] = executor
        runtime.background(finish_loop)
        runtime.background(tombstone_loop)
        runtime.background(announce_loop)
        if kube is not None:
            kube.adopt(list(executor.running.values()))
            backend_run = kube.run
            runtime.background(lambda: backend_run(executor.report))
            runtime.background(inventory[0].run)
            if pool_book.pools:
                runtime.background(elastic[0].run_forever)
        else:
            runtime.background(progress_loop)
            if settings.fault_rate_per_hour > 0:
                random_mode.configure(settings.fault_rate_per_hour, settings.fault_seed)
            runtime.background(random_mode.run_forever)
            if pool_book.pools:
                runtime.background(elastic[0].run_forever)
        await consumers.start()

    async def publish_probe(probe: NodeProbe) -> None:
        env = envelope_for("NodeProbe", probe, producer=producer)
        await publish_all(broker, [OutMessage(topics.NODE_PROBE, probe.node_id, env)])

    async def connect_kubernetes() -> KubeBackend:
        """The cluster's API; its nodes in the book before the store's runs are booked again."""
        api = await api_client(settings)
        runtime.on_shutdown(api.close)
        nodes_now = KubeInventory(
            api,
            cluster_name,
            node_labels(settings),
            policy.accelerator_types,
            book,
            on_probe=publish_probe,
            device_loss=device_loss_kind(settings),
        )
        await nodes_now.load()
        inventory.append(nodes_now)
        if pool_book.pools:
            elastic[0] = KubePools(
                pool_book,
                book,
                announce_now,
                lambda out: publish_all(broker, out),
                api,
                provisioning_options(settings, node_labels(settings)),
            )
        return KubeBackend(
            api, kube_options(settings), hostnames=nodes_now.hostname, pinned=nodes_now.pinned
        )

    app = create_http_app(runtime)
    app.include_router(fault_router(injector, outage, random_mode))
    app.state.runtime = runtime
    app.state.executor = state  # "executor": the Executor once started
    app.state.book = book
    app.state.broker = broker
    app.state.slowdowns = slowdowns
    app.state.random_faults = random_mode
    return app
