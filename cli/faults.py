"""`qm fault`: inject faults into the simulated fleet of a running stack — a node's hardware
signal, a straggler, a whole cluster going dark, a seeded random mode, or a robot whose link
drops or whose model turns unhealthy."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from cli.client import state_dir
from cli.params import OrderedGroup

# `qm --help` builds this sub-app, so the stack machinery and httpx are imported when a
# fault is actually injected.
if TYPE_CHECKING:
    import httpx

    from cli.stack import Service


@click.group("fault", cls=OrderedGroup)
def fault() -> None:
    """Inject faults into the simulated fleet (demos and tests)."""


def _executors(key: str = "QM_EXECUTOR_CLUSTER") -> dict[str, Service]:
    """cluster name -> its executor service, from the running stack's record (with
    ``QM_EDGE_FLEET``: robot fleet name -> its edge executor)."""
    from cli.stack import Stack

    stack = Stack.load(state_dir())
    if stack is None:
        raise click.BadParameter("no stack is running here (start one with `qm up`)")
    return {s.extra_env[key]: s for s in stack.services if key in s.extra_env}


def _owner(executors: dict[str, Service], node_id: str) -> Service:
    """The executor of the cluster a node belongs to: node ids start with their cluster's
    name, and the longest matching name wins."""
    owners = sorted((c for c in executors if node_id.startswith(f"{c}-")), key=len)
    if not owners:
        raise click.BadParameter(f"no cluster of this stack has a node {node_id}")
    return executors[owners[-1]]


def _send(service: Service, path: str, body: dict[str, object]) -> httpx.Response:
    import httpx

    return httpx.post(f"http://127.0.0.1:{service.port}{path}", json=body, timeout=5)


def _post(service: Service, path: str, body: dict[str, object]) -> None:
    _report(_send(service, path, body))


def _report(r: httpx.Response) -> None:
    if r.status_code >= 400:
        click.echo(f"refused: {r.json().get('detail', r.text)}", err=True)
        raise click.exceptions.Exit(1)
    click.echo(r.json())


@fault.command("node")
@click.argument("node_id")
@click.option("--xid", type=int, default=79, help="GPU XID code (79: fell off the bus)")
@click.option(
    "--kind",
    default="gpu_xid",
    help="gpu_xid, ecc_uncorrectable, thermal_throttle, nvlink_down, pcie_error or disk_full",
)
def node(node_id: str, xid: int, kind: str) -> None:
    """Make node NODE_ID (e.g. onprem-h100-h100-0003) report a hardware error, as its own
    agent would."""
    _post(
        _owner(_executors(), node_id),
        "/faults/node",
        {"node_id": node_id, "kind": kind, "xid": xid},
    )


@fault.command("slow")
@click.argument("node_id")
@click.option(
    "--factor",
    type=click.FloatRange(min=1.0),
    default=3.0,
    help="steps take this many times longer; 1 clears it",
)
def slow(node_id: str, factor: float) -> None:
    """Make node NODE_ID a straggler: replicas there report slower steps (job.progress)."""
    _post(_owner(_executors(), node_id), "/faults/slow", {"node_id": node_id, "factor": factor})


@fault.command("random")
@click.option(
    "--rate",
    type=click.FloatRange(min=0.0),
    required=True,
    help="faults per fleet hour, per cluster; 0 stops",
)
@click.option("--seed", type=int, help="same seed, same sequence of faults (default: random)")
@click.option("--cluster", help="only this cluster (default: every cluster)")
def random_faults(rate: float, seed: int | None, cluster: str | None) -> None:
    """Start (or stop) seeded random faults on the simulated fleet.

    Critical XIDs, bursts of transient signals and stragglers on random nodes, at a rate in
    fleet time; the same seed replays the same sequence of faults."""
    executors = _executors()
    if cluster is not None and cluster not in executors:
        raise click.BadParameter(
            f"unknown cluster {cluster}; known: {', '.join(sorted(executors))}"
        )
    for name in [cluster] if cluster is not None else sorted(executors):
        _post(executors[name], "/faults/random", {"rate_per_hour": rate, "seed": seed})


@fault.command("cluster")
@click.argument("name")
@click.argument("state", type=click.Choice(["down", "up"]), metavar="STATE")
def cluster(name: str, state: str) -> None:
    """Take cluster NAME (as in the fleet file) dark or bring it back: STATE down stops its
    heartbeats, up restarts them."""
    executors = _executors()
    if name not in executors:
        raise click.BadParameter(f"unknown cluster {name}; known: {', '.join(sorted(executors))}")
    _post(executors[name], "/faults/cluster", {"state": state})


@fault.command("robot")
@click.argument("robot_id")
@click.option(
    "--offline/--online",
    default=None,
    help="take its link down (it misses rollouts until back) or bring it back",
    show_default=False,
)
@click.option(
    "--unhealthy/--healthy",
    default=None,
    help="make the models it runs report unhealthy (a rollout that reached it rolls "
    "back), or clear that",
    show_default=False,
)
def robot(robot_id: str, offline: bool | None, unhealthy: bool | None) -> None:
    """Take the link of robot ROBOT_ID (e.g. lab-a-003) down or up, or make its model
    unhealthy or healthy again."""
    import httpx

    if offline is None and unhealthy is None:
        raise click.BadParameter("give --offline or --online, and/or --unhealthy or --healthy")
    body: dict[str, object] = {
        "robot": robot_id,
        "link": None if offline is None else ("offline" if offline else "online"),
        "health": None if unhealthy is None else ("unhealthy" if unhealthy else "healthy"),
    }
    fleets = _executors("QM_EDGE_FLEET")
    if not fleets:
        raise click.BadParameter("this stack runs no robot fleet (no edge executor)")
    unreachable = []
    for fleet in sorted(fleets):  # a robot is in one fleet: the others answer 404
        try:
            r = _send(fleets[fleet], "/faults/robot", body)
        except httpx.HTTPError:
            unreachable.append(fleet)
            continue
        if r.status_code != 404:
            _report(r)
            return
    message = f"no robot fleet of this stack ({', '.join(sorted(fleets))}) has a robot {robot_id}"
    if unreachable:
        message += f"; the edge executor of {', '.join(unreachable)} did not answer (qm ps)"
    raise click.BadParameter(message)
