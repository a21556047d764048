"""The edge executor of one robot fleet (a cluster of kind `edge`): the fleet's side of the
robots' intermittent link. It reads the version each robot should run from `robot.desired`,
from the start of the topic every time it starts (the desired state lives on the log, so a
restart converges to it), carries it to each robot when the robot is online, and publishes the
fleet's inventory (`robot.inventory`: link, versions running, health) when it changes and every
few seconds.

The robots here are simulated (services/executor/edge/robots.py); what a robot runs is kept in
Redis, standing for each robot's own disk, so a restart of this process is not a reboot of the
fleet. Faults: `POST /faults/robot` (`qm fault robot`).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from fastapi import APIRouter, FastAPI, HTTPException
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis

from schemas import topics
from schemas.bounds import parse_json
from schemas.envelope import Envelope
from schemas.robots import RobotDesired, RobotInventory
from services.common.kafka import OutMessage, envelope_for, make_broker, publish_all
from services.common.pacing import FetchPacer
from services.common.policyfile import read_yaml
from services.common.runtime import Runtime, create_http_app
from services.common.settings import ServiceSettings
from services.executor.edge.robots import Desired, SimRobot, load_robot_fleet, state_of, step

log = structlog.get_logger()


class EdgeSettings(ServiceSettings):
    # Which of the fleet file's `robot_fleets:` this executor runs.
    edge_fleet: str = "robots"
    # Wall seconds between two looks at every robot, and between two full inventories.
    step_every_s: float = 0.25
    change_every_s: float = 1.0
    inventory_every_s: float = 5.0


class RobotFault(BaseModel):
    robot: str
    link: Literal["offline", "online"] | None = None
    health: Literal["unhealthy", "healthy"] | None = None


def create_app(settings: EdgeSettings | None = None) -> FastAPI:
    settings = settings or EdgeSettings()
    fleet = settings.edge_fleet
    name = f"edge-{fleet}"
    runtime = Runtime(name, settings)
    broker = make_broker(settings, name, runtime.registry)
    robots_list, config = load_robot_fleet(read_yaml(settings.fleet_file), fleet)
    robots: dict[str, SimRobot] = {r.robot: r for r in robots_list}
    desired: dict[str, dict[str, Desired]] = {r: {} for r in robots}
    disk_key = f"qm:edge:{fleet}:running"
    # Injected faults stand until lifted, also across a restart of this process.
    faults_key = f"qm:edge:{fleet}:faults"
    online = Gauge("qm_edge_robots_online", "Robots whose link is up", registry=runtime.registry)
    switches = Counter(
        "qm_edge_version_switches",
        "Robots that switched a model version",
        registry=runtime.registry,
    )
    skipped = Counter(
        "qm_edge_desired_skipped",
        "robot.desired records that could not be read",
        registry=runtime.registry,
    )
    caught_up = asyncio.Event()

    def take(value: bytes | None) -> None:
        try:
            envelope = Envelope.model_validate(parse_json(value or b""))
            want = RobotDesired.model_validate(envelope.payload)
        except (ValidationError, ValueError) as error:
            skipped.inc()
            log.warning("unreadable robot.desired record", error=str(error)[:300])
            return
        if want.cluster != fleet or want.robot not in desired:
            return
        desired[want.robot][want.model] = Desired(want.version, want.deployment, want.labels)

    async def read_desired() -> None:
        """Every record of robot.desired from the start, then as they come."""
        consumer = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka_bootstrap,
            enable_auto_commit=False,
            fetch_max_wait_ms=250,
        )
        await consumer.start()
        # Desired state changes seldom: poll slowly while it does not (common/pacing.py).
        pacer = FetchPacer(
            250,
            factor=settings.fetch_idle_factor,
            max_ms=settings.fetch_idle_max_ms,
            quiet_s=settings.fetch_idle_after_s,
            at_client=settings.fetch_wait_at == "client",
        )
        pacer.attach(consumer, quiet=False)
        try:
            # The partitions the broker has (metadata read at start; the stack creates the
            # topics first), else the registry's count.
            ids = consumer.partitions_for_topic(topics.ROBOT_DESIRED) or range(
                topics.BY_NAME[topics.ROBOT_DESIRED].partitions
            )
            parts = [TopicPartition(topics.ROBOT_DESIRED, p) for p in sorted(ids)]
            consumer.assign(parts)
            await consumer.seek_to_beginning(*parts)
            ends = await consumer.end_offsets(parts)
            while True:
                batches = await consumer.getmany(timeout_ms=200, max_records=5000)
                if any(batches.values()):
                    pacer.saw_records()
                for records in batches.values():
                    for record in records:
                        take(record.value)
                if not caught_up.is_set():
                    positions = [await consumer.position(tp) for tp in parts]
                    if all(pos >= ends[tp] for pos, tp in zip(positions, parts, strict=True)):
                        caught_up.set()
                        log.info("desired state read", robots=len(robots))
        finally:
            pacer.close()
            await consumer.stop()

    async def run_robots() -> None:
        await caught_up.wait()
        redis: Redis = state["redis"]
        last_full = 0.0
        changed = False
        while True:
            now = time.time()
            moved: dict[str | bytes, str | bytes] = {}
            for robot in robots.values():
                before = dict(robot.running)
                if step(robot, desired[robot.robot], config, now, settings.time_scale):
                    changed = True
                if robot.running != before:
                    switches.inc()
                    moved[robot.robot] = json.dumps(robot.running)
            if moved:
                await redis.hset(disk_key, mapping=moved)  # type: ignore[arg-type]
            online.set(sum(1 for r in robots.values() if r.online))
            # A change goes out within a second (flapping links change all the time), and
            # the whole inventory every few seconds anyway.
            due = settings.change_every_s if changed else settings.inventory_every_s
            if now - last_full >= due:
                inventory = RobotInventory(
                    cluster=fleet, robots=[state_of(r) for r in robots.values()]
                )
                message = OutMessage(
                    topics.ROBOT_INVENTORY,
                    fleet,
                    envelope_for("RobotInventory", inventory, producer=f"executor/{fleet}"),
                )
                await publish_all(broker, [message])
                last_full, changed = now, False
            await asyncio.sleep(settings.step_every_s)

    state: dict[str, Any] = {}

    @runtime.on_startup
    async def start() -> None:
        redis = Redis.from_url(settings.redis_url)
        state["redis"] = redis
        disk = await redis.hgetall(disk_key)
        for key, value in disk.items():
            robot = robots.get(key.decode() if isinstance(key, bytes) else key)
            if robot is not None:
                robot.running = dict(json.loads(value))
        for key, value in (await redis.hgetall(faults_key)).items():
            robot = robots.get(key.decode() if isinstance(key, bytes) else key)
            if robot is not None:
                fault = json.loads(value)
                robot.link_down, robot.sick = bool(fault["link_down"]), bool(fault["sick"])
        await broker.connect()
        runtime.background(read_desired)
        runtime.background(run_robots)

        async def close() -> None:
            await broker.stop()
            await redis.aclose()

        runtime.on_shutdown(close)

    app = create_http_app(runtime)
    faults = APIRouter(prefix="/faults")

    @faults.post("/robot", status_code=202)
    async def robot_fault(fault: RobotFault) -> dict[str, Any]:
        robot = robots.get(fault.robot)
        if robot is None:
            raise HTTPException(404, detail=f"no robot {fault.robot} in fleet {fleet}")
        if fault.link is not None:
            robot.link_down = fault.link == "offline"
        if fault.health is not None:
            robot.sick = fault.health == "unhealthy"
        state_now = {"link_down": robot.link_down, "sick": robot.sick}
        redis = state.get("redis")
        if redis is not None:  # started (the HTTP app alone takes faults in memory only)
            await redis.hset(faults_key, robot.robot, json.dumps(state_now))
        return {"robot": robot.robot, **state_now}

    app.include_router(faults)
    app.state.runtime = runtime
    app.state.robots = robots
    return app
