"""The fault endpoints of the executor, on a stub broker: probes for node faults and random
faults, stragglers that expire or are cleared, and the random mode switched on and off."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI

from schemas.health import SignalKind
from services.executor.faults import FaultInjector, Outage, Slowdowns, fault_router
from services.executor.random_faults import Fault, FaultKind, RandomFaults, Signal

NODES = {"c-n0": 8, "c-n1": 8}


class StubBroker:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, value: bytes, topic: str, **_: Any) -> None:
        self.sent.append((topic, value))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup() -> tuple[httpx.AsyncClient, StubBroker, Slowdowns, RandomFaults, FaultInjector]:
    broker = StubBroker()
    slowdowns = Slowdowns()
    injector = FaultInjector("c", dict(NODES), broker, slowdowns, time_scale=60)  # type: ignore[arg-type]
    mode = RandomFaults("c", NODES, injector.apply, time_scale=60)
    app = FastAPI()
    app.include_router(fault_router(injector, Outage(), mode))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://executor")
    return client, broker, slowdowns, mode, injector


async def test_a_node_fault_is_a_probe_from_that_node() -> None:
    client, broker, *_ = setup()
    body = {"node_id": "c-n1", "kind": "gpu_xid", "xid": 48}
    assert (await client.post("/faults/node", json=body)).status_code == 202
    ((topic, value),) = broker.sent
    assert topic == "node.probe" and b'"xid":48' in value and b'"c-n1"' in value
    assert (await client.post("/faults/node", json={"node_id": "zz"})).status_code == 404


async def test_slow_sets_and_clears_a_straggler() -> None:
    client, _, slowdowns, *_ = setup()

    async def slow(node_id: str, factor: float) -> int:
        r = await client.post("/faults/slow", json={"node_id": node_id, "factor": factor})
        return r.status_code

    assert await slow("c-n0", 2.5) == 202
    assert slowdowns.current() == {"c-n0": 2.5}
    assert (await client.get("/faults")).json()["slow"] == {"c-n0": 2.5}
    assert await slow("c-n0", 1) == 202
    assert slowdowns.current() == {}
    assert await slow("c-n0", 0.5) == 422
    assert await slow("zz", 2) == 404


async def test_the_random_mode_is_configured_over_http() -> None:
    client, _, _, mode, _ = setup()
    r = await client.post("/faults/random", json={"rate_per_hour": 12, "seed": 4})
    assert r.status_code == 202 and (mode.rate_per_hour, mode.seed) == (12, 4)
    state = (await client.get("/faults")).json()["random"]
    assert state == {"rate_per_hour": 12, "seed": 4, "injected": 0}
    await client.post("/faults/random", json={"rate_per_hour": 0})
    assert mode.rate_per_hour == 0
    r = await client.post("/faults/random", json={"rate_per_hour": -1})
    assert r.status_code == 422


async def test_random_stragglers_expire_after_their_fleet_time() -> None:
    clock = Clock()
    slowdowns = Slowdowns(clock=clock)
    injector = FaultInjector("c", dict(NODES), StubBroker(), slowdowns, time_scale=60)  # type: ignore[arg-type]
    await injector.apply(Fault(FaultKind.STRAGGLER, "c-n0", factor=3, for_s=600))
    assert slowdowns.current() == {"c-n0": 3}
    clock.now += 9.9  # 600 fleet seconds are 10 wall seconds at 60x
    assert slowdowns.current() == {"c-n0": 3}
    clock.now += 0.2
    assert slowdowns.current() == {}


async def test_random_signal_faults_send_every_probe_of_the_burst() -> None:
    broker = StubBroker()
    injector = FaultInjector("c", dict(NODES), broker, Slowdowns(), time_scale=60)  # type: ignore[arg-type]
    burst = (Signal(SignalKind.THERMAL_THROTTLE, None, 2),) * 3
    await injector.apply(Fault(FaultKind.TRANSIENT_BURST, "c-n1", burst))
    assert len(broker.sent) == 3 and all(t == "node.probe" for t, _ in broker.sent)
    assert all(b"thermal_throttle" in v and b'"xid"' not in v for _, v in broker.sent)
