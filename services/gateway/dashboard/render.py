"""Jinja2 set-up for the dashboard: templates, filters people read numbers through."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape

HERE = Path(__file__).parent
STATIC = HERE / "static"


def duration(seconds: float | int | Decimal | None) -> str:
    """12 s, 4 min 3 s, 2 h 5 min, 3 d 4 h."""
    if seconds is None:
        return ""
    s = float(seconds)
    if not math.isfinite(s):
        return ""
    if s < 60:
        return f"{s:.0f} s" if s >= 10 or s == int(s) else f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    if s < 86400:
        return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"
    return f"{int(s // 86400)} d {int(s % 86400 // 3600)} h"


def money(value: float | Decimal | None, currency: str = "") -> str:
    if value is None:
        return ""
    v = float(value)
    text = f"{v:,.2f}" if abs(v) < 1e6 else f"{v / 1e6:,.2f} M"
    return f"{text} {currency}".strip()


def number(value: float | int | Decimal | None, digits: int = 1) -> str:
    if value is None:
        return ""
    v = float(value)
    if not math.isfinite(v):
        return ""
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v):,}"
    return f"{v:,.{digits}f}"


def when(at: datetime | None) -> str:
    if at is None:
        return ""
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def ago(at: datetime | None) -> str:
    if at is None:
        return ""
    return duration((datetime.now(UTC) - at).total_seconds()) + " ago"


def query(params: dict[str, str], **changes: Any) -> str:
    merged = {**params}
    for k, v in changes.items():
        if v is None or v == "":
            merged.pop(k, None)
        else:
            merged[k] = str(v)
    return urlencode({k: v for k, v in merged.items() if v})


def environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters |= {
        "duration": duration,
        "money": money,
        "number": number,
        "when": when,
        "ago": ago,
        "tojson_attr": lambda v: json.dumps(v, default=str),
    }
    env.globals["query"] = query
    return env
