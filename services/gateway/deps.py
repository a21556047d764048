"""FastAPI dependencies every gateway router shares: the service context and the caller."""

from __future__ import annotations

from fastapi import Request

from services.gateway.auth import Principal, authenticate
from services.gateway.context import Gateway


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway  # type: ignore[no-any-return]


def principal(request: Request) -> Principal:
    return authenticate(gateway(request).tokens, request)
