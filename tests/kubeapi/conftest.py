"""Fixtures for the API double's own tests."""

from tests.kubeapi.fixtures import kube_api, kube_client

__all__ = ["kube_api", "kube_client"]
