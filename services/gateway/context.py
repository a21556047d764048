"""What the gateway's request handlers share: stores, broker, policy and tokens."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg
from faststream.kafka import KafkaBroker
from redis.asyncio import Redis

from core.policy import Policy
from services.common.tracing import Tracing
from services.gateway.auth import Principal
from services.gateway.settings import GatewaySettings


@dataclass
class Gateway:
    settings: GatewaySettings
    pool: asyncpg.Pool
    redis: Redis
    broker: KafkaBroker
    policy: Policy
    tokens: dict[str, Principal]
    tracing: Tracing | None = None  # None: tracing is off
