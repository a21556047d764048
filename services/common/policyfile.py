"""Reading the shared policy and fleet YAML files (the core parses; this only does the I/O)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from core.policy import Policy


def read_yaml(path: Path) -> dict[str, Any]:
    with path.open() as fh:
        doc = yaml.safe_load(fh) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return doc


def load_policy(path: Path) -> Policy:
    return Policy.from_dict(read_yaml(path))
