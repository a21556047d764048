"""Bearer tokens mapped to a tenant and a role, from the auth file; every call is scoped."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from fastapi import HTTPException, Request

from services.common.policyfile import read_yaml


class Role(StrEnum):
    USER = "user"  # a researcher: sees and changes only their tenant's jobs
    ADMIN = "admin"  # sees and changes everything
    OPS = "ops"  # sees every job (operates the fleet), changes none
    FINANCE = "finance"  # sees usage and cost of every tenant


@dataclass(frozen=True)
class Principal:
    tenant: str
    role: Role

    def can_read(self, tenant: str) -> bool:
        return self.role in (Role.ADMIN, Role.OPS) or tenant == self.tenant

    def can_change(self, tenant: str) -> bool:
        return self.role is Role.ADMIN or (self.role is Role.USER and tenant == self.tenant)

    @property
    def sees_all(self) -> bool:
        return self.role in (Role.ADMIN, Role.OPS)


def load_tokens(path: Path) -> dict[str, Principal]:
    doc = read_yaml(path)
    tokens: dict[str, Principal] = {}
    for entry in doc.get("tokens", []):
        tokens[str(entry["token"])] = Principal(str(entry["tenant"]), Role(entry["role"]))
    return tokens


def authenticate(tokens: dict[str, Principal], request: Request) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(
            401,
            detail="missing bearer token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    principal = tokens.get(token.strip())
    if principal is None:
        raise HTTPException(401, detail="unknown token", headers={"WWW-Authenticate": "Bearer"})
    return principal
