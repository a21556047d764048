"""Fixtures for tests that run one service in-process against the real broker and stores."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import yaml
from fastapi import FastAPI

from services.common.topics import ensure_topics
from tests.unit.services.builders import POLICY_DOC

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("policy") / "policy.yaml"
    path.write_text(yaml.safe_dump(POLICY_DOC))
    return path


@pytest.fixture(scope="session")
async def topics_ready(kafka_bootstrap: str) -> str:
    await ensure_topics(kafka_bootstrap)
    return kafka_bootstrap


@pytest.fixture(scope="session")
def service_env(
    topics_ready: str, database_url: str, redis_url: str, policy_file: Path
) -> dict[str, object]:
    return {
        "kafka_bootstrap": topics_ready,
        "database_url": database_url,
        "redis_url": redis_url,
        "policy_file": policy_file,
        "fleet_file": ROOT / "examples" / "fleet.yaml",
        "auth_file": ROOT / "examples" / "auth.yaml",
        "log_format": "console",
    }


@asynccontextmanager
async def running(app: FastAPI) -> AsyncIterator[FastAPI]:
    """Run a service app's lifespan (stores, broker, loops) for the duration of a block."""
    async with app.router.lifespan_context(app):
        yield app
