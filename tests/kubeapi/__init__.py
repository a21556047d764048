"""A Kubernetes API double for testing against the real kubernetes-asyncio client (server.py)."""

from tests.kubeapi.server import (
    KubeApiDouble,
    RunningDouble,
    ThreadedDouble,
    api_client_for,
    kubeconfig,
    run_in_thread,
    serve_double,
    write_kubeconfig,
)
from tests.kubeapi.store import ApiError, DeletionRecord, Fault, RequestRecord
from tests.kubeapi.strategies import ResourceType, custom_resource

__all__ = [
    "ApiError",
    "DeletionRecord",
    "Fault",
    "KubeApiDouble",
    "RequestRecord",
    "ResourceType",
    "RunningDouble",
    "ThreadedDouble",
    "api_client_for",
    "custom_resource",
    "kubeconfig",
    "run_in_thread",
    "serve_double",
    "write_kubeconfig",
]
