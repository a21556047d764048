"""`qm trace JOB_ID`: a job's trace from the dev stack's span files (one JSON lines file per
service process under `<state dir>/traces`, docs/tracing.md), as a tree with each hop's
duration and the gaps between hops."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.text import Text

from cli.out import clean, error

console = Console(highlight=False)


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    status: str = "unset"
    error: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    children: list[Span] = field(default_factory=list)

    @classmethod
    def of(cls, record: dict[str, Any]) -> Span | None:
        try:
            service = str(record.get("service") or "?")
            if record.get("instance"):
                service = f"{service}/{record['instance']}"
            return cls(
                trace_id=str(record["trace_id"]),
                span_id=str(record["span_id"]),
                parent_id=record.get("parent_id"),
                name=str(record["name"]),
                service=service,
                start_ns=int(record["start_ns"]),
                end_ns=int(record["end_ns"]),
                status=str(record.get("status", "unset")),
                error=record.get("error"),
                attributes=dict(record.get("attributes") or {}),
                events=list(record.get("events") or []),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def event_ns(self, name: str) -> int | None:
        for event in self.events:
            if event.get("name") == name and isinstance(event.get("time_ns"), int):
                return int(event["time_ns"])
        return None


def read_spans(directory: Path) -> list[Span]:
    """Every span in the directory's files (rotated ones too); lines being written, or
    anything else that is not a span, are skipped."""
    spans = []
    for path in sorted(directory.glob("*.jsonl*")):
        with path.open("rb") as lines:
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                span = Span.of(record) if isinstance(record, dict) else None
                if span is not None:
                    spans.append(span)
    return spans


def traces_of(spans: Iterable[Span], wanted: str) -> dict[str, list[Span]]:
    """The traces (trace id -> spans) of a job id, or of a trace id."""
    spans = list(spans)
    ids = {s.trace_id for s in spans if s.attributes.get("qm.job_id") == wanted}
    ids |= {s.trace_id for s in spans if s.trace_id == wanted}
    out: dict[str, list[Span]] = {}
    for span in spans:
        if span.trace_id in ids:
            out.setdefault(span.trace_id, []).append(span)
    return dict(sorted(out.items(), key=lambda item: min(s.start_ns for s in item[1])))


def duration(ns: int) -> str:
    seconds = ns / 1e9
    if abs(seconds) < 1:
        return f"{seconds * 1000:.0f} ms" if abs(seconds) >= 0.01 else f"{seconds * 1000:.1f} ms"
    if abs(seconds) < 120:
        return f"{seconds:.2f} s"
    return f"{seconds / 60:.1f} min"


def tree(spans: list[Span]) -> list[Span]:
    """The roots, each with its children (by start); a span whose parent is missing (its
    file not written yet, or sampled out) is a root too."""
    by_id = {s.span_id: s for s in spans}
    ordered = sorted(spans, key=lambda s: s.start_ns)
    for span in ordered:
        span.children = []
    roots = []
    for span in ordered:
        parent = by_id.get(span.parent_id) if span.parent_id else None
        if parent is None:
            roots.append(span)
        else:
            parent.children.append(span)
    return roots


def story(span: Span, parent: Span | None) -> Text:
    """What happened at this hop, in words. Span files are written by the services and hold
    names, ids and errors from what was submitted: every value is cleaned of terminal control
    characters and shown as plain text, never read as rich markup."""
    parts: list[Text] = []
    if parent is not None:
        gap = span.start_ns - parent.end_ns
        if gap >= 0:
            parts.append(Text(clean(f"{duration(gap)} after {parent.name} ended")))
        else:
            parts.append(Text(clean(f"began {duration(-gap)} before {parent.name} ended")))
    elif span.parent_id:
        parts.append(Text("its parent span is not in the files"))
    cycle = span.event_ns("cycle.start")
    if cycle is not None:
        parts.append(Text(f"waited {duration(cycle - span.start_ns)} for the cycle that placed it"))
        parts.append(Text(f"placed {duration(span.end_ns - cycle)} after that cycle began"))
    emitted = span.attributes.get("qm.emitted")
    if emitted:
        parts.append(Text(clean("emitted " + ", ".join(str(e) for e in emitted))))
    if span.status == "error":
        parts.append(Text(clean(f"failed: {span.error or 'error'}"), style="red"))
    return Text("; ").join(parts)


def render(spans: list[Span]) -> list[Text]:
    """One trace as lines: a heading, then each span indented under its parent with its
    offset from the trace's start, its duration and its story."""
    if not spans:
        return []
    start = min(s.start_ns for s in spans)
    end = max(s.end_ns for s in spans)
    jobs = sorted({str(s.attributes["qm.job_id"]) for s in spans if "qm.job_id" in s.attributes})
    services = sorted({s.service.split("/")[0] for s in spans})
    lines = [
        Text.assemble(
            (clean(f"trace {spans[0].trace_id}"), "bold"),
            clean(
                f"  job {', '.join(jobs) or '?'}  "
                f"{len(spans)} spans in {len(services)} services ({', '.join(services)}), "
                f"{duration(end - start)} end to end"
            ),
        ),
        Text(f"{'at':>10}  {'took':>9}  span"),
    ]

    def walk(span: Span, parent: Span | None, depth: int) -> None:
        said = story(span, parent)
        at = "+" + duration(span.start_ns - start)
        took = duration(span.end_ns - span.start_ns)
        line = Text.assemble(
            f"{at:>10}  {took:>9}  {'  ' * depth}{'└ ' if depth else ''}",
            clean(span.name),
            " ",
            (clean(f"({span.service})"), "dim"),
        )
        if said:
            line.append("  ")
            line.append_text(said)
        lines.append(line)
        for child in span.children:
            walk(child, span, depth + 1)

    for root in tree(spans):
        walk(root, None, 0)
    return lines


@click.command()
@click.argument("job_id")
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path),
    help="Span files; default: the dev stack's (<state dir>/traces).",
)
@click.option("--json", "as_json", is_flag=True, help="The spans as JSON lines.")
def trace(job_id: str, directory: Path | None, as_json: bool) -> None:
    """Show the trace of JOB_ID (a job id or a trace id) from the dev stack: every service it
    went through, how long each took and how long it waited in between."""
    if directory is None:
        from cli.client import state_dir
        from cli.stack import trace_dir

        directory = trace_dir(state_dir())
    if not directory.is_dir():
        error(
            f"no traces at {directory}: start the stack with tracing on "
            "(`qm up`, the default) or pass --dir"
        )
        raise click.exceptions.Exit(1)
    found = traces_of(read_spans(directory), job_id)
    if not found:
        error(
            f"no span of {job_id} in {directory} (spans are written about "
            "half a second after each hop; a job submitted before tracing was on has none)"
        )
        raise click.exceptions.Exit(1)
    for spans in found.values():
        if as_json:
            for s in sorted(spans, key=lambda s: s.start_ns):
                record = {k: v for k, v in vars(s).items() if k != "children"}
                print(json.dumps(record, separators=(",", ":")))
            continue
        for line in render(spans):
            console.print(line)
        console.print()
