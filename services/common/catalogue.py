"""The metrics catalogue (docs/metrics.md) read as data: each metric's type and label names,
for the tools that must name only metrics Quartermaster serves (the SLO file, the Prometheus
rules and Grafana dashboard generated from it)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from services.common.settings import REPO_ROOT

CATALOGUE_FILE = REPO_ROOT / "docs" / "metrics.md"
_ROW = re.compile(r"^\| `(qm_[a-z0-9_]+)` \| (counter|gauge|histogram) \| ([^|]*) \|")


@dataclass(frozen=True)
class CatalogueEntry:
    type: str  # counter | gauge | histogram
    labels: frozenset[str]


def parse_catalogue(text: str) -> dict[str, CatalogueEntry]:
    """name -> entry, from the catalogue's table rows (counters are named with `_total`)."""
    out = {}
    for line in text.splitlines():
        match = _ROW.match(line)
        if match:
            labels = frozenset(re.findall(r"`([a-z_]+)`", match[3]))
            out[match[1]] = CatalogueEntry(match[2], labels)
    return out


def read_catalogue(path: Path = CATALOGUE_FILE) -> dict[str, CatalogueEntry] | None:
    """The catalogue, or None where it is not shipped (the container image has no docs/)."""
    try:
        return parse_catalogue(path.read_text())
    except FileNotFoundError:
        return None
