"""How `qm` shows things with rich: a job, its history, the dev stack, one line per event.
(`qm list` prints plain columns: cli.out.)

What the gateway answered goes in as `Text` made from `clean` text (tables: `SafeTable`): a
plain string in a rich table is read as markup (a job named `[/]` would crash the command,
`[red]` recolour it), and rich passes escape sequences through to the terminal."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.style import StyleType
from rich.table import Table
from rich.text import Text

from cli.out import STATE_STYLES, clean, when
from cli.out import cell as _cell


def _safe_cell(cell: RenderableType | None) -> RenderableType | None:
    if isinstance(cell, str):
        return Text(clean(cell))
    if isinstance(cell, Text) and not cell.plain.isprintable():
        # Built from a gateway value (a state, a phase) holding control characters: its
        # text cleaned, in its overall style (the hostile case only loses inner spans).
        return Text(clean(cell.plain), style=cell.style)
    return cell


class SafeTable(Table):
    """A rich table whose cells and title are shown as the text they are: cleaned of control
    characters and never read as markup. For every table of what the gateway answered (node
    names, service names, reasons): a name holding `[/]` would otherwise crash the command."""

    def __init__(self, *headers: Any, title: str | Text | None = None, **options: Any) -> None:
        safe = _safe_cell(title)
        super().__init__(*headers, title=safe if isinstance(safe, Text) else None, **options)

    def add_row(
        self,
        *renderables: RenderableType | None,
        style: StyleType | None = None,
        end_section: bool = False,
    ) -> None:
        cells = [_safe_cell(r) for r in renderables]
        super().add_row(*cells, style=style, end_section=end_section)


def state_text(state: str | None) -> Text:
    return Text(clean(state or "-"), style=STATE_STYLES.get(state or "", ""))


def id_and_state(job_id: str, state: str | None) -> Text:
    """`j-123  queued`, the state in its colour."""
    return Text(f"{clean(job_id)}  ").append_text(state_text(state))


def _summary(job: Mapping[str, Any]) -> Table:
    grid = SafeTable.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    spec = job.get("spec") or {}
    resources = spec.get("resources") or {}
    shape = (
        (
            f"{_cell(spec.get('replicas', 1))} x {_cell(resources.get('accelerators'))} "
            f"{_cell(resources.get('accelerator_types')) or 'any'}"
        )
        if spec
        else "-"
    )
    reason = " ".join(p for p in (job.get("reason_code"), job.get("message")) if p)
    rows: list[tuple[str, Any]] = [
        ("job", job.get("job_id")),
        ("state", state_text(job.get("state"))),
        ("reason", reason or None),
        ("owner", f"{job.get('tenant')}/{job.get('project')} ({job.get('user')})"),
        ("queue", job.get("queue")),
        ("name", job.get("name")),
        ("shape", shape),
        ("cluster", job.get("cluster")),
        ("nodes", job.get("nodes")),
        ("submitted", when(job.get("submitted_at"))),
        ("updated", when(job.get("updated_at"))),
    ]
    for label, value in rows:
        if value is not None and value != []:
            grid.add_row(label, value if isinstance(value, Text) else _cell(value))
    return grid


def history_table(history: Sequence[Mapping[str, Any]]) -> Table:
    table = SafeTable(title="history", title_justify="left", header_style="bold")
    for column in ("at", "state", "event", "reason", "message"):
        table.add_column(column)
    for item in history:
        table.add_row(
            when(item.get("at")),
            state_text(item.get("state")),
            _cell(item.get("event_type") or item.get("type")),
            _cell(item.get("reason_code")),
            _cell(item.get("message")),
        )
    return table


def job_view(job: Mapping[str, Any]) -> Group:
    return Group(_summary(job), Text(), history_table(job.get("history") or []))


def event_line(event: Mapping[str, Any]) -> Text:
    """One lifecycle event as a single line for `qm watch`."""
    line = Text(f"{clean(when(event.get('at')))}  ")
    line.append_text(state_text(event.get("state")))
    kind = event.get("event_type") or event.get("type")
    for part in (kind, event.get("reason_code"), event.get("message")):
        if part:
            line.append(f"  {clean(str(part))}")
    return line


def explanation(result: Mapping[str, Any]) -> Group:
    head = Text(f"{clean(str(result.get('job_id')))}  ")
    head.append_text(state_text(result.get("state")))
    codes = ", ".join(result.get("codes") or []) or "-"
    return Group(
        head, Text(clean(f"codes: {codes}")), Text(clean(str(result.get("message") or "")))
    )


def services_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title="services", title_justify="left", header_style="bold")
    for column in ("service", "pid", "port", "process", "health", "log"):
        table.add_column(column, no_wrap=column != "log")
    for row in rows:
        table.add_row(
            row["name"],
            _cell(row.get("pid")),
            _cell(row.get("port")),
            Text(row["process"], style="green" if row["process"] == "running" else "red"),
            Text(row["health"], style="green" if row["health"] == "ok" else "yellow"),
            _cell(row.get("log")),
        )
    return table


def servers_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(title="servers", title_justify="left", header_style="bold")
    for column in ("server", "source", "url", "pid", "state"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["name"], row["how"], row["url"], _cell(row.get("pid")), _cell(row.get("state"))
        )
    return table
