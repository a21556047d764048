"""The job commands of `qm`: submit, status, list, cancel, watch and explain, over the REST API."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from cli import out
from cli.client import TERMINAL_STATES, GatewayClient, resolve_connection
from cli.errors import GatewayError, QmError
from cli.params import gateway_options, json_option, path_type

# rich is imported by the commands that print through it, when they do: `qm list` and the
# errors of every command print without it (cli.out).
console = out.LazyConsole()
errors = out.LazyConsole(stderr=True)


# --- job files ---------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    # YAML turns unquoted dates into date objects, which JSON cannot carry.
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dt.date | dt.datetime):
        return value.isoformat()
    return value


def job_body(document: Any, source: str = "job file") -> dict[str, Any]:
    """One YAML document as the JSON body of ``POST /v1/jobs``.

    Labels are strings by definition, so unquoted YAML numbers and booleans there
    (``sim_duration_s: 600``) are sent as the text the user wrote rather than refused.
    """
    if not isinstance(document, dict):
        raise QmError(f"{source}: expected a mapping of job fields, got {type(document).__name__}")
    body: dict[str, Any] = _jsonable(document)
    labels = body.get("labels")
    if isinstance(labels, dict):
        body["labels"] = {
            k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in labels.items()
        }
    return body


def load_job_file(path: Path) -> list[dict[str, Any]]:
    """Every job in a YAML file (several may be separated by ``---``)."""
    import yaml  # here rather than at the top: only `qm submit` reads YAML

    try:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise QmError(f"cannot read {path}: {exc}") from exc
    if not documents:
        raise QmError(f"{path} holds no job")
    return [job_body(d, str(path)) for d in documents]


# --- shared plumbing ---------------------------------------------------------------------


@contextmanager
def gateway(url: str | None, token: str | None) -> Iterator[GatewayClient]:
    """A client for the command; any error becomes a message on stderr and exit code 1."""
    try:
        with GatewayClient(resolve_connection(url, token)) as client:
            yield client
    except QmError as exc:
        out.error(str(exc))
        raise click.exceptions.Exit(1) from exc


def _wait_until_decided(client: GatewayClient, job_id: str, timeout: float) -> dict[str, Any]:
    """Poll until the job leaves `submitted` (queued, rejected, or further)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            job = client.job(job_id)
            if job.get("state") not in (None, "submitted"):
                return job
        except GatewayError as exc:
            if exc.status != 404:  # the gateway may not have projected it yet
                raise
        if time.monotonic() > deadline:
            raise QmError(f"{job_id} still not queued after {timeout:.0f}s")
        time.sleep(0.25)


# --- commands ----------------------------------------------------------------------------


@click.command()
@click.option(
    "-f", "--file", "file", type=path_type(exists=True), required=True, help="Job YAML file."
)
@click.option("--wait", is_flag=True, help="Wait until queued or rejected.")
@click.option("--timeout", type=float, default=60.0, help="Seconds --wait waits.")
@gateway_options
def submit(file: Path, wait: bool, timeout: float, url: str | None, token: str | None) -> None:
    """Submit the job(s) in a YAML file; print each job id."""
    rejected = False
    with gateway(url, token) as client:
        for body in load_job_file(file):
            job_id = str(client.submit(body)["job_id"])
            if not wait:
                console.print(job_id, highlight=False)
                continue
            from cli import render

            job = _wait_until_decided(client, job_id, timeout)
            line = render.id_and_state(job_id, job.get("state"))
            if job.get("state") == "rejected":
                rejected = True
                why = f"  {job.get('reason_code') or ''}  {job.get('message') or ''}"
                line.append(out.clean(why))
            console.print(line)
    if rejected:
        raise click.exceptions.Exit(1)


@click.command()
@click.argument("job_id")
@json_option
@gateway_options
def status(job_id: str, as_json: bool, url: str | None, token: str | None) -> None:
    """Show a job: state, reason, placement and its event history."""
    with gateway(url, token) as client:
        job = client.job(job_id)
        why = client.explain(job_id) if job.get("state") in ("submitted", "queued") else None
    if as_json:
        console.print_json(json.dumps(job))
        return
    from cli import render

    console.print(render.job_view(job))
    if why is not None:
        # The gateway's words, not markup: printed as they are, control characters replaced.
        waiting = out.clean(str(why.get("message", "")))
        console.print(f"waiting: {waiting}", markup=False, highlight=False)
        if why.get("growing"):
            growing = out.clean(str(why["growing"].get("message", "")))
            console.print(f"capacity: {growing}", markup=False, highlight=False)


@click.command("list")
@click.option("--state", help="Only jobs in this state.")
@click.option("--queue", help="Only jobs in this queue.")
@click.option("--limit", type=int, default=50, help="At most this many jobs.")
@json_option
@gateway_options
def list_jobs(
    state: str | None,
    queue: str | None,
    limit: int,
    as_json: bool,
    url: str | None,
    token: str | None,
) -> None:
    """List your jobs (all tenants' for admin), newest first."""
    with gateway(url, token) as client:
        jobs = client.jobs(state, queue, limit)
    if as_json:
        console.print_json(json.dumps({"jobs": jobs}))
    else:
        jobs_columns(jobs)


LIST_COLUMNS = ("job id", "name", "owner", "queue", "state", "accel", "cluster", "submitted")


def jobs_columns(jobs: list[dict[str, Any]]) -> None:
    rows, styles = [], []
    for job in jobs:
        owner = "/".join(str(job[k]) for k in ("tenant", "project") if job.get(k))
        state = job.get("state")
        rows.append(
            (
                out.cell(job.get("job_id")),
                out.cell(job.get("name")),
                owner or "-",
                out.cell(job.get("queue")),
                out.cell(state),
                out.shape(job.get("replicas"), job.get("accelerators")),
                out.cell(job.get("cluster")),
                out.when(job.get("submitted_at")),
            )
        )
        styles.append(["", "", "", "", out.STATE_STYLES.get(str(state), ""), "", "", ""])
    out.columns(
        LIST_COLUMNS,
        rows,
        keep=("job id", "state", "submitted"),
        styles=styles,
        title=f"{len(jobs)} job(s)",
    )


@click.command()
@click.argument("job_id")
@gateway_options
def cancel(job_id: str, url: str | None, token: str | None) -> None:
    """Ask for a job to be canceled (works in every state)."""
    with gateway(url, token) as client:
        answer = client.cancel(job_id)
    from cli import render

    state = answer.get("state", "cancel_requested")
    console.print(render.id_and_state(str(answer.get("job_id", job_id)), state))


@click.command()
@click.argument("job_id")
@gateway_options
def watch(job_id: str, url: str | None, token: str | None) -> None:
    """Follow a job's lifecycle events live until it ends (Ctrl-C to stop watching)."""
    from cli import render

    try:
        with gateway(url, token) as client:
            for event in client.events(job_id):
                console.print(render.event_line(event))
                if event.get("state") in TERMINAL_STATES:
                    return
    except KeyboardInterrupt:
        raise click.exceptions.Exit(130) from None
    errors.print("[yellow]the event stream ended before the job did[/yellow]")
    raise click.exceptions.Exit(1)


@click.command()
@click.argument("job_id")
@gateway_options
def explain(job_id: str, url: str | None, token: str | None) -> None:
    """Why is this job where it is (e.g. still pending)?"""
    with gateway(url, token) as client:
        answer = client.explain(job_id)
    from cli import render

    console.print(render.explanation(answer))
