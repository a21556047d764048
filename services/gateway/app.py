"""The gateway: REST API for people and tools, and the read model it answers from."""

from __future__ import annotations

from fastapi import FastAPI
from redis.asyncio import Redis

from schemas import topics
from services.common.consumer import Consumers, Records
from services.common.db import create_pool
from services.common.kafka import make_broker
from services.common.policyfile import load_policy
from services.common.runtime import Runtime, create_http_app
from services.common.scrape import scrape_client
from services.gateway import (
    explain,
    fleet,
    inventory,
    pools,
    problems,
    robots,
    routes,
    serving,
    store,
    usage,
)
from services.gateway.auth import load_tokens
from services.gateway.context import Gateway
from services.gateway.dashboard import views as dashboard
from services.gateway.dashboard.session import Sessions
from services.gateway.explain import record_explanations
from services.gateway.handlers import PROJECTED, Projector, early_dropped_counter
from services.gateway.settings import GatewaySettings

NAME = "gateway"

DESCRIPTION = """Submit ML jobs to Quartermaster and follow them. Every call needs
`Authorization: Bearer <token>`; a token belongs to one tenant and role, and sees only what
that role may see."""


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    runtime = Runtime(NAME, settings)
    broker = make_broker(settings, NAME, runtime.registry)
    policy = load_policy(settings.policy_file)
    tokens = load_tokens(settings.auth_file)
    app = create_http_app(runtime, description=DESCRIPTION, version="1")
    problems.install(app)
    app.include_router(routes.router)
    app.include_router(explain.router)
    app.include_router(pools.router)
    app.include_router(usage.router)
    app.include_router(serving.router)
    app.include_router(robots.router)
    app.include_router(fleet.router)
    dashboard.install(app, Sessions(tokens, settings.ui_session_secret, settings.ui_session_hours))
    holder: dict[str, Projector] = {}
    early_dropped = early_dropped_counter(runtime.registry)  # listed before start-up

    consumers = Consumers(broker, settings, service=NAME, registry=runtime.registry)

    # Each step returns the dead letters the gateway owes; sent before the offsets move.
    async def handle(records: Records) -> None:
        await consumers.publish(await holder["projector"].process(records))

    async def usage_ticks(records: Records) -> None:
        await consumers.publish(await app.state.usage.process(records))

    consumers.subscribe(
        *usage.USAGE_TOPICS, group_id=f"{settings.group_id}-usage", handle=usage_ticks
    )

    async def explanations(records: Records) -> None:
        await consumers.publish(await record_explanations(app.state.gateway.pool, records))

    consumers.subscribe(
        topics.SCHEDULING_EXPLAINED, group_id=f"{settings.group_id}-explain", handle=explanations
    )

    async def pool_views(records: Records) -> None:
        # Pools and the fleet's nodes share one consumer: both read cluster.capacity.
        pool = app.state.gateway.pool
        pooled = tuple(r for r in records if r.topic in pools.POOL_TOPICS)
        dead = await pools.record_pools(pool, pooled) if pooled else []
        dead += await inventory.record_fleet(pool, records)
        await consumers.publish(dead)

    consumers.subscribe(
        *pools.POOL_TOPICS,
        *inventory.HEALTH_TOPICS,
        group_id=f"{settings.group_id}-pools",
        handle=pool_views,
    )

    async def serving_views(records: Records) -> None:
        # Services, robots and deployments: one consumer, polled gently (nobody waits on
        # these views within milliseconds; every consumer polling costs the broker).
        pool = app.state.gateway.pool
        services = tuple(r for r in records if r.topic in serving.SERVICE_TOPICS)
        fleets = tuple(r for r in records if r.topic not in serving.SERVICE_TOPICS)
        dead = await serving.record_services(pool, services) if services else []
        dead += await robots.record_robots(pool, fleets) if fleets else []
        await consumers.publish(dead)

    consumers.subscribe(
        *serving.SERVICE_TOPICS,
        *robots.ROBOT_TOPICS,
        group_id=f"{settings.group_id}-serving",
        handle=serving_views,
        fetch_max_wait_ms=200,
    )
    consumers.subscribe(*PROJECTED, group_id=settings.group_id, handle=handle)

    @runtime.on_startup
    async def start() -> None:
        pool = await create_pool(settings.database_url, settings.db_pool_size + 4)
        await store.migrate_gateway(pool)
        redis = Redis.from_url(settings.redis_url)
        holder["projector"] = Projector(
            pool,
            redis,
            early_max=settings.early_events_max,
            early_max_bytes=settings.early_events_max_bytes,
            early_dropped=early_dropped,
        )
        app.state.usage = usage.UsageProjector(pool)
        app.state.gateway = Gateway(
            settings, pool, redis, broker, policy, tokens, tracing=runtime.tracing
        )
        # The dashboard's scheduler page scrapes the services every few seconds while open.
        app.state.scrape_client = scrape_client()
        consumers.probe = lambda: pool.fetchval("SELECT 1")
        runtime.background(consumers.committer.run_forever)
        await consumers.start()

        async def close() -> None:
            await consumers.committer.flush()
            await broker.stop()
            await redis.aclose()
            await pool.close()
            await app.state.scrape_client.aclose()

        runtime.on_shutdown(close)

    app.state.runtime = runtime
    app.state.broker = broker
    return app
