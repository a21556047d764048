"""`qm fault`: inject faults into the simulated fleet of a running stack — a node's hardware
signal, a straggler, a whole cluster going dark, or a seeded random mode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from cli.client import state_dir

# `qm --help` builds this sub-app, so the stack machinery and httpx are imported when a
# fault is actually injected.
if TYPE_CHECKING:
    from cli.stack import Service

fault_app = typer.Typer(
    help="Inject faults into the simulated fleet (demos and tests).", no_args_is_help=True
)


def _executors() -> dict[str, Service]:
    """cluster name -> its executor service, from the running stack's record."""
    from cli.stack import Stack

    stack = Stack.load(state_dir())
    if stack is None:
        raise typer.BadParameter("no stack is running here (start one with `qm up`)")
    return {
        s.extra_env["QM_EXECUTOR_CLUSTER"]: s
        for s in stack.services
        if "QM_EXECUTOR_CLUSTER" in s.extra_env
    }


def _owner(executors: dict[str, Service], node_id: str) -> Service:
    """The executor of the cluster a node belongs to: node ids start with their cluster's
    name, and the longest matching name wins."""
    owners = sorted((c for c in executors if node_id.startswith(f"{c}-")), key=len)
    if not owners:
        raise typer.BadParameter(f"no cluster of this stack has a node {node_id}")
    return executors[owners[-1]]


def _post(service: Service, path: str, body: dict[str, object]) -> None:
    import httpx

    r = httpx.post(f"http://127.0.0.1:{service.port}{path}", json=body, timeout=5)
    if r.status_code >= 400:
        typer.echo(f"refused: {r.json().get('detail', r.text)}", err=True)
        raise typer.Exit(1)
    typer.echo(r.json())


@fault_app.command("node")
def node(
    node_id: Annotated[str, typer.Argument(help="e.g. onprem-h100-h100-0003")],
    xid: Annotated[int, typer.Option(help="GPU XID code (79: fell off the bus)")] = 79,
    kind: Annotated[
        str,
        typer.Option(
            help="gpu_xid, ecc_uncorrectable, thermal_throttle, "
            "nvlink_down, pcie_error or disk_full"
        ),
    ] = "gpu_xid",
) -> None:
    """Make a node report a hardware error, as its own agent would."""
    _post(
        _owner(_executors(), node_id),
        "/faults/node",
        {"node_id": node_id, "kind": kind, "xid": xid},
    )


@fault_app.command("slow")
def slow(
    node_id: Annotated[str, typer.Argument(help="e.g. onprem-h100-h100-0003")],
    factor: Annotated[
        float, typer.Option(min=1.0, help="steps take this many times longer; 1 clears it")
    ] = 3.0,
) -> None:
    """Make a node a straggler: replicas there report slower steps (job.progress)."""
    _post(_owner(_executors(), node_id), "/faults/slow", {"node_id": node_id, "factor": factor})


@fault_app.command("random")
def random_faults(
    rate: Annotated[
        float, typer.Option(min=0.0, help="faults per fleet hour, per cluster; 0 stops")
    ],
    seed: Annotated[
        int | None, typer.Option(help="same seed, same sequence of faults (default: random)")
    ] = None,
    cluster: Annotated[
        str | None, typer.Option(help="only this cluster (default: every cluster)")
    ] = None,
) -> None:
    """Start (or stop) seeded random faults on the simulated fleet.

    Critical XIDs, bursts of transient signals and stragglers on random nodes, at a rate in
    fleet time; the same seed replays the same sequence of faults."""
    executors = _executors()
    if cluster is not None and cluster not in executors:
        raise typer.BadParameter(
            f"unknown cluster {cluster}; known: {', '.join(sorted(executors))}"
        )
    for name in [cluster] if cluster is not None else sorted(executors):
        _post(executors[name], "/faults/random", {"rate_per_hour": rate, "seed": seed})


@fault_app.command("cluster")
def cluster(
    name: Annotated[str, typer.Argument(help="cluster name, as in the fleet file")],
    state: Annotated[str, typer.Argument(help="down (stop heartbeating) or up")],
) -> None:
    """Take a whole cluster dark (its heartbeats stop) or bring it back."""
    executors = _executors()
    if name not in executors:
        raise typer.BadParameter(f"unknown cluster {name}; known: {', '.join(sorted(executors))}")
    _post(executors[name], "/faults/cluster", {"state": state})
