"""Pytest fixtures for the Kubernetes API double. A conftest elsewhere gets them with
`from tests.kubeapi.fixtures import kube_api, kube_client  # noqa: F401`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from kubernetes_asyncio.client import ApiClient

from tests.kubeapi.server import RunningDouble, api_client_for, serve_double


@pytest.fixture
async def kube_api() -> AsyncIterator[RunningDouble]:
    """A fresh double for one test, on a free port: `.url`, and `.double` for the hooks."""
    async with serve_double() as running:
        yield running


@pytest.fixture
async def kube_client(kube_api: RunningDouble) -> AsyncIterator[ApiClient]:
    """A kubernetes-asyncio ApiClient talking to `kube_api`."""
    async with api_client_for(kube_api.url) as client:
        yield client
