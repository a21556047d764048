"""Output without rich for the commands people run most (`qm list`, errors of any gateway
command), and rich loaded only when a command prints through it.

Importing rich's console costs 35-50 ms and laying out a 50-row rich table about 100 ms, a
third of `qm list`'s whole run (docs/performance.md, "The CLI's start"). `columns` writes
kubectl-style columns instead: a header, two spaces between columns, cells cut with an
ellipsis to fit a terminal's width and never cut when the output goes to a pipe or a file, so
`qm list | grep` sees every id whole. Colour only on a terminal, and never under NO_COLOR or
TERM=dumb, always under FORCE_COLOR. What the gateway answered is written with its control
characters replaced (`clean`): a job name cannot drive the terminal.
"""

from __future__ import annotations

import os
import shutil
import sys
import unicodedata
from collections.abc import Sequence
from datetime import datetime
from typing import IO, Any

import click

# The styles below as ANSI codes (rich reads the same names).
_SGR = {
    "dim": "2",
    "bold": "1",
    "cyan": "36",
    "blue": "34",
    "yellow": "33",
    "magenta": "35",
    "green": "32",
    "red": "31",
    "bold red": "1;31",
}
ELLIPSIS = "…"
GAP = "  "

# The colour of each job state, on every command that shows one.
STATE_STYLES = {
    "submitted": "dim",
    "queued": "cyan",
    "placed": "blue",
    "running": "yellow",
    "preempting": "magenta",
    "succeeded": "green",
    "failed": "red",
    "canceled": "magenta",
    "cancel_requested": "magenta",
    "rejected": "bold red",
}


class LazyConsole:
    """A rich Console made on first use: modules that print through rich only sometimes do
    not pay its import when they do not."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._console: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._options)
        return getattr(self._console, name)


def colour_on(stream: IO[str]) -> bool:
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return bool(getattr(stream, "isatty", lambda: False)())


def clean(text: str, keep: str = "") -> str:
    """`text` safe to write to a terminal: what a gateway answered (a job's name, a reason)
    may hold escape sequences that would recolour, move the cursor or retitle the terminal,
    newlines that would forge table rows, or bidi overrides that reorder what is shown. Each
    control, format or line-separator character (other than those in `keep`) becomes "?",
    other spaces a plain space."""
    if text.isprintable():
        return text
    return "".join(
        char
        if char.isprintable() or char in keep
        else " "
        if unicodedata.category(char) == "Zs"
        else "?"
        for char in text
    )


def error(message: str) -> None:
    """`error: message` on stderr, the label in red on a terminal."""
    label = click.style("error:", fg="red") if colour_on(sys.stderr) else "error:"
    click.echo(f"{label} {clean(message, keep=chr(10))}", err=True, color=colour_on(sys.stderr))


def when(value: str | None) -> str:
    """A timestamp in local time: the clock alone if today, with the date otherwise."""
    if not value:
        return "-"
    try:
        moment = datetime.fromisoformat(value).astimezone()
    except (TypeError, ValueError, OverflowError, OSError):
        return str(value)  # not a time (a number, year 1 or 9999 at the edge of a zone): as is
    today = datetime.now().astimezone().date()
    fmt = "%H:%M:%S" if moment.date() == today else "%Y-%m-%d %H:%M:%S"
    return moment.strftime(fmt)


def cell(value: Any) -> str:
    """A value as table text: "-" for nothing, lists joined, 8.0 as 8."""
    if value is None or value == "" or value == []:
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value)
    return str(value)


def shape(replicas: Any, accelerators: Any) -> str:
    """A gang's shape, e.g. ``4x8`` (replicas x accelerators each)."""
    if replicas in (None, 1):
        return cell(accelerators)
    return f"{cell(replicas)}x{cell(accelerators)}"


def width_of(text: str) -> int:
    """Terminal cells `text` takes: East Asian wide and full-width characters take two,
    combining and enclosing marks none (Thai and Devanagari vowel signs among them)."""
    if text.isascii():
        return len(text)
    cells = 0
    for char in text:
        if unicodedata.category(char) in ("Mn", "Me"):
            continue
        cells += 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
    return cells


def cut(text: str, cells: int) -> str:
    """`text` in at most `cells` terminal cells, ending in an ellipsis when shortened."""
    if width_of(text) <= cells:
        return text
    if cells <= 0:
        return ""
    kept, used = [], 0
    for char in text:
        step = width_of(char)
        if used + step > cells - 1:
            break
        kept.append(char)
        used += step
    return "".join(kept) + ELLIPSIS


def fit(natural: list[int], keep: Sequence[bool], room: int) -> list[int]:
    """Column widths that fit in `room` cells (gaps excluded): the widest column that may be
    shortened gives up a cell at a time, to no less than 5 cells; columns marked `keep` (ids,
    times) are never shortened. If even that does not fit, the line is left to wrap."""
    widths = [min(w, max(room, 5)) for w in natural]  # no column wider than the line
    while sum(widths) > room:
        candidates = [i for i, w in enumerate(widths) if not keep[i] and w > 5]
        if not candidates:
            break
        widest = max(candidates, key=lambda i: widths[i])
        widths[widest] -= 1
    return widths


def columns(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    keep: Sequence[str] = (),
    styles: Sequence[Sequence[str]] | None = None,
    stream: IO[str] | None = None,
    title: str | None = None,
) -> None:
    """Print a table as aligned columns. `styles[r][c]` names a colour for a cell (a key of
    the state colours, or ""); `keep` names the columns never shortened."""
    out = stream or sys.stdout
    colour = colour_on(out)
    headers = [clean(h) for h in headers]
    rows = [[clean(value) for value in row] for row in rows]
    natural = [
        max([width_of(h), *(width_of(row[i]) for row in rows)]) for i, h in enumerate(headers)
    ]
    widths = natural
    if getattr(out, "isatty", lambda: False)():
        room = shutil.get_terminal_size().columns - len(GAP) * (len(headers) - 1)
        widths = fit(natural, [h in keep for h in headers], room)
    lines = []
    if title:
        lines.append(clean(title))
    head = GAP.join(_pad(cut(h.upper(), w), w) for h, w in zip(headers, widths, strict=True))
    lines.append(_paint(head.rstrip(), "bold", colour))
    last = len(headers) - 1
    for r, row in enumerate(rows):
        cells = []
        for c, (value, w) in enumerate(zip(row, widths, strict=True)):
            text = cut(value, w)
            if c < last:
                text = _pad(text, w)
            cells.append(_paint(text, styles[r][c] if styles else "", colour))
        lines.append(GAP.join(cells).rstrip())
    out.write("\n".join(lines) + "\n")
    out.flush()


def _pad(text: str, cells: int) -> str:
    return text + " " * max(0, cells - width_of(text))


def _paint(text: str, style: str, colour: bool) -> str:
    code = _SGR.get(style)
    if not colour or not code:
        return text
    return f"\x1b[{code}m{text}\x1b[0m"
