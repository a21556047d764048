"""Elastic pools on Kubernetes, asked of the cluster the way cluster-autoscaler takes it.

A pool is a node group of the cluster whose nodes carry the pool label (`quartermaster.io/pool:
<pool>` by default; the node group's template sets it, with the accelerator label). To grow it,
the executor creates a `ProvisioningRequest` (`autoscaling.x-k8s.io/v1`, class
`best-effort-atomic-scale-up`) for the nodes missing, each node asked as one placeholder pod that
takes all of a node's accelerators on that group; cluster-autoscaler adds them all or none and
reports back in the request's conditions (`Provisioned`, `Failed`, `BookingExpired`). A node the
pool keeps carries `cluster-autoscaler.kubernetes.io/scale-down-disabled: "true"`; a node the
autoscaler removes (empty, decided under the executor's lock) is cordoned and loses that
annotation, and cluster-autoscaler takes it away as an empty node.

What is on its way is read from the cluster each time, never remembered: the requests this
executor made that are still open, less the pool's nodes that joined since each was made. So a
restart, or a decision applied twice, never asks twice (docs/autoscaler.md)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import structlog
from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException

from core.autoscale import NodePool
from schemas.events import AutoscaleDecided
from services.common.kafka import OutMessage
from services.executor.elastic import ElasticPools
from services.executor.kube import names
from services.executor.nodes import NodeBook
from services.executor.pools import Member, PoolBook

log = structlog.get_logger()

Obj = dict[str, Any]

GROUP, VERSION, PLURAL = "autoscaling.x-k8s.io", "v1", "provisioningrequests"
ATOMIC = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
KEEP = "cluster-autoscaler.kubernetes.io/scale-down-disabled"
RELEASED = names.PREFIX + "released-at"
POOL = names.PREFIX + "pool"
PLACEHOLDER_IMAGE = "registry.k8s.io/pause:3.9"


@dataclass(frozen=True)
class ProvisioningOptions:
    namespace: str
    cluster: str
    pool_label: str = POOL
    provisioning_class: str = ATOMIC
    # The extended resource of an accelerator type (nvidia.com/gpu, google.com/tpu).
    resource: Callable[[str], str] = lambda accelerator_type: "nvidia.com/gpu"
    toleration_keys: tuple[str, ...] = ()
    # After a request failed, the pool asks nothing more for this long unless a new decision
    # for it comes (the autoscaler pauses a failing pool and goes to the next cheapest).
    retry_failed_after_s: float = 300.0


@dataclass(frozen=True)
class Request:
    """One ProvisioningRequest of ours, as the cluster holds it."""

    name: str
    pool: str
    count: int
    created_at: datetime
    provisioned: bool = False
    failed: str | None = None  # the Failed condition's message
    expired: bool = False  # BookingExpired or CapacityRevoked: what did not come will not

    @property
    def open(self) -> bool:
        return self.failed is None and not self.expired


@dataclass(frozen=True)
class Machine:
    """A Node object of a pool."""

    name: str
    pool: str
    created_at: datetime
    ready: bool
    kept: bool  # carries scale-down-disabled: "true"
    released: bool  # let go: cordoned, cluster-autoscaler takes it when empty


@dataclass
class Steps:
    """What to do to bring the pools to their sizes, from the cluster's state now."""

    ask: dict[str, int] = field(default_factory=dict)  # pool: nodes to request
    cancel: list[Request] = field(default_factory=list)  # not provisioned, beyond the size
    done: list[Request] = field(default_factory=list)  # met, failed or expired: deleted
    failures: dict[str, tuple[Request, int]] = field(default_factory=dict)  # pool: (request, lost)
    keep: list[str] = field(default_factory=list)  # nodes to mark scale-down-disabled
    waiting: dict[str, int] = field(default_factory=dict)  # request: nodes still to come


def parse_request(obj: Obj) -> Request | None:
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    pool = labels.get(POOL)
    created = _time(meta.get("creationTimestamp"))
    if not pool or created is None:
        return None
    spec = obj.get("spec") or {}
    count = sum(int(s.get("count") or 0) for s in spec.get("podSets") or [])
    conditions = {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or [] if c}

    def true(kind: str) -> bool:
        return (conditions.get(kind) or {}).get("status") == "True"

    failed = None
    if true("Failed"):
        c = conditions["Failed"]
        failed = str(c.get("message") or c.get("reason") or "the request failed")
    return Request(
        name=str(meta.get("name", "")),
        pool=str(pool),
        count=count,
        created_at=created,
        provisioned=true("Provisioned"),
        failed=failed,
        expired=true("BookingExpired") or true("CapacityRevoked"),
    )


def parse_machine(obj: Obj, pool_label: str) -> Machine | None:
    meta = obj.get("metadata") or {}
    pool = (meta.get("labels") or {}).get(pool_label)
    created = _time(meta.get("creationTimestamp"))
    if not pool or created is None:
        return None
    annotations = meta.get("annotations") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (obj.get("status") or {}).get("conditions") or []
    )
    return Machine(
        name=str(meta.get("name", "")),
        pool=str(pool),
        created_at=created,
        ready=ready,
        kept=annotations.get(KEEP) == "true",
        released=RELEASED in annotations,
    )


def remaining(requests: Sequence[Request], machines: Sequence[Machine]) -> dict[str, int]:
    """The nodes each request still waits for: every node of a pool counts for the oldest of
    the pool's requests made before it that is not met yet (creation times are the API's, to
    the second; a node of the same second as a request counts for an older one only)."""
    left = {r.name: r.count for r in requests}
    by_pool: dict[str, list[Request]] = {}
    for r in sorted(requests, key=lambda r: (r.created_at, r.name)):
        by_pool.setdefault(r.pool, []).append(r)
    for m in sorted(machines, key=lambda m: (m.created_at, m.name)):
        for r in by_pool.get(m.pool, []):
            if r.created_at < m.created_at and left[r.name] > 0:
                left[r.name] -= 1
                break
    return left


def plan(
    desired: Mapping[str, int],
    requests: Sequence[Request],
    machines: Sequence[Machine],
    *,
    quiet: set[str] | None = None,
    since: datetime | None = None,
) -> Steps:
    """Bring each pool in `desired` to its size. A failed request's nodes are lost (the pool's
    size drops by them: app side), a met or expired one is deleted; nodes still to come from
    open requests count as the pool's. Missing nodes are asked in one request, unless the pool
    is `quiet` or a request of it failed just now; nodes beyond the size are canceled from the
    newest requests not provisioned yet, never one made after `since` (the inventory a
    decision was taken on)."""
    steps = Steps()
    left = remaining([r for r in requests if r.open], machines)
    for r in requests:
        if r.failed is not None:
            steps.done.append(r)
            # An atomic request brings all its nodes or none; count any that came anyway.
            lost = remaining([r], machines)[r.name]
            if lost > 0:
                steps.failures[r.pool] = (r, steps.failures.get(r.pool, (r, 0))[1] + lost)
        elif r.expired or (r.provisioned and left.get(r.name, 0) == 0):
            steps.done.append(r)
    steps.waiting = {r.name: left[r.name] for r in requests if r.open and left[r.name] > 0}
    for pool, size in sorted(desired.items()):
        live = [m for m in machines if m.pool == pool and not m.released]
        steps.keep.extend(m.name for m in live if not m.kept)
        mine = [r for r in requests if r.pool == pool and r.name in steps.waiting]
        coming = sum(steps.waiting[r.name] for r in mine)
        missing = size - len(live) - coming
        if missing > 0 and pool not in (quiet or set()) and pool not in steps.failures:
            steps.ask[pool] = missing
        elif missing < 0:
            excess = -missing
            for r in sorted(mine, key=lambda r: (r.created_at, r.name), reverse=True):
                newer = since is not None and r.created_at > since
                if not r.provisioned and not newer and steps.waiting[r.name] <= excess:
                    steps.cancel.append(r)
                    excess -= steps.waiting.pop(r.name)
    return steps


def _time(raw: Any) -> datetime | None:
    if not isinstance(raw, str):
        return None
    try:
        at = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


class KubePools(ElasticPools):
    """`autoscale.decided` carried out on a Kubernetes cluster (see the module docstring). The
    book (pools.py) keeps each pool's size, the newest decision applied and the failures; its
    members are rebuilt from the cluster on every check (ready and joining nodes, and one
    `provisioning` entry per node a request still waits for)."""

    def __init__(
        self,
        book: PoolBook,
        nodes: NodeBook,
        announce: Callable[[], None],
        publish: Callable[[list[OutMessage]], Awaitable[object]],
        api: ApiClient,
        options: ProvisioningOptions,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        super().__init__(book, nodes, announce, publish)
        self.core: Any = CoreV1Api(api)
        self.custom: Any = CustomObjectsApi(api)
        self.options = options
        self.clock = clock
        self.requests: list[Request] = []
        self.machines: dict[str, Machine] = {}
        # Pools whose request failed, and when: no new request until the pause is over or a
        # decision for the pool comes.
        self.quiet_since: dict[str, datetime] = {}

    def ready_nodes(self) -> dict[str, Any]:
        return {}  # the pool's nodes are Node objects: the inventory announces them

    async def decided(self, d: AutoscaleDecided, decided_at: datetime | None) -> bool:
        async with self.changing:
            pool = self.book.accept(d, decided_at)
            if pool is None:
                return False
            await self._read()
            kept = 0
            for node_id in d.remove:
                m = self.machines.get(node_id)
                if m is None or m.pool != pool.name or m.released:
                    continue
                if self.nodes.busy(node_id):
                    kept += 1  # it took work meanwhile: stays, on top of the size
                    continue
                await self._release(node_id)
            self.book.desired[pool.name] = max(
                pool.min_nodes, min(d.desired_nodes + kept, pool.max_nodes)
            )
            self.quiet_since.pop(pool.name, None)
            await self._save()
            await self._converge(since=d.inventory_at)
        log.info(
            "pool resized",
            pool=d.pool,
            desired=self.book.desired[pool.name],
            remove=d.remove,
            reason=d.reason,
        )
        return True

    async def tick(self, now: datetime) -> None:
        async with self.changing:
            before = self._shape()
            await self._read()
            await self._converge(since=None)
            if self.unsaved:
                await self._save()
        if self._shape() != before:
            self.announce()

    def _shape(self) -> tuple[object, ...]:
        return (
            sorted((m.node_id, m.ready_at is not None) for m in self.book.members.values()),
            sorted(self.book.failing.items()),
            sorted(self.book.desired.items()),
        )

    async def _read(self) -> None:
        o = self.options
        listed = await self.custom.list_namespaced_custom_object(
            GROUP,
            VERSION,
            o.namespace,
            PLURAL,
            label_selector=f"{names.CLUSTER}={names.label_value(o.cluster)}",
        )
        self.requests = [
            r
            for obj in listed.get("items") or []
            if (r := parse_request(obj)) is not None and r.pool in self.book.pools
        ]
        response = await self.core.list_node(label_selector=o.pool_label, _preload_content=False)
        nodes = json.loads(await response.read())
        self.machines = {
            m.name: m
            for obj in nodes.get("items") or []
            if (m := parse_machine(obj, o.pool_label)) is not None and m.pool in self.book.pools
        }

    async def _converge(self, since: datetime | None) -> None:
        now = self.clock()
        quiet = {
            p
            for p, at in self.quiet_since.items()
            if (now - at).total_seconds() < self.options.retry_failed_after_s
        }
        steps = plan(
            self.book.desired, self.requests, list(self.machines.values()), quiet=quiet, since=since
        )
        for pool, (r, lost) in steps.failures.items():
            spec = self.book.pools[pool]
            self.book.desired[pool] = max(spec.min_nodes, self.book.desired[pool] - lost)
            self.book.failing[pool] = (r.failed or "the request failed", now)
            self.quiet_since[pool] = now
            self.unsaved = True
            log.warning("pool request failed", pool=pool, request=r.name, cause=r.failed)
        for r in steps.done:
            if r.provisioned and r.failed is None and r.pool in self.book.failing:
                del self.book.failing[r.pool]  # nodes came again: the incident is over
                self.unsaved = True
        for r in steps.done + steps.cancel:
            await self._delete(r.name)
        for name in steps.keep:
            await self._keep(name)
        for pool, count in steps.ask.items():
            await self._ask(self.book.pools[pool], count, now)
        self._members(steps)

    def _members(self, steps: Steps) -> None:
        """The book's members as the cluster has them now (empty_since carried over)."""
        old = self.book.members
        made = {r.name: r for r in self.requests}
        members: dict[str, Member] = {}
        for m in self.machines.values():
            if m.released:
                continue
            before = old.get(m.name)
            members[m.name] = Member(
                m.name,
                m.pool,
                before.requested_at if before else m.created_at,
                m.created_at if m.ready else None,
                empty_since=before.empty_since if before and m.ready else None,
            )
        for name, count in steps.waiting.items():
            r = made[name]
            for i in range(count):
                members[f"{name}-{i}"] = Member(f"{name}-{i}", r.pool, r.created_at)
        self.book.members = members
        self.book.note_use(self.nodes.busy, self.clock())

    async def _ask(self, pool: NodePool, count: int, now: datetime) -> None:
        """One request for `count` whole nodes of the pool (its placeholder pods' template
        first; both named from the pool's request number, so a retry answers 409)."""
        o = self.options
        seq = self.book.next_seq[pool.name]
        self.book.next_seq[pool.name] = seq + 1
        await self._save()  # the number is never used twice, even across a restart
        name = request_name(o.cluster, pool.name, seq)
        labels = {
            names.MANAGED_BY: names.MANAGER,
            names.CLUSTER: names.label_value(o.cluster),
            POOL: names.label_value(pool.name),
        }
        resource = o.resource(pool.accelerator.type)
        per_node = str(pool.accelerators_per_node)
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": name, "namespace": o.namespace, "labels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {o.pool_label: pool.name},
                    "tolerations": [
                        {"key": k, "operator": "Exists", "effect": "NoSchedule"}
                        for k in o.toleration_keys
                    ],
                    "containers": [
                        {
                            "name": "capacity",
                            "image": PLACEHOLDER_IMAGE,
                            "resources": {
                                "requests": {resource: per_node},
                                "limits": {resource: per_node},
                            },
                        }
                    ],
                },
            },
        }
        request = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ProvisioningRequest",
            "metadata": {
                "name": name,
                "namespace": o.namespace,
                "labels": labels,
                "annotations": {names.PREFIX + "requested-at": now.isoformat()},
            },
            "spec": {
                "provisioningClassName": o.provisioning_class,
                "podSets": [{"podTemplateRef": {"name": name}, "count": count}],
            },
        }
        await _created(self.core.create_namespaced_pod_template(o.namespace, template))
        created = await _created(
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, o.namespace, PLURAL, request
            )
        )
        if created is not None:
            r = parse_request(created)
            if r is not None:
                self.requests.append(r)
        log.info("pool nodes requested", pool=pool.name, request=name, count=count)

    async def _delete(self, name: str) -> None:
        o = self.options
        for call in (
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, o.namespace, PLURAL, name),
            self.core.delete_namespaced_pod_template(name, o.namespace),
        ):
            try:
                await call
            except ApiException as error:
                if error.status != 404:
                    raise
        self.requests = [r for r in self.requests if r.name != name]

    async def _keep(self, node: str) -> None:
        await self.core.patch_node(node, {"metadata": {"annotations": {KEEP: "true"}}})

    async def _release(self, node: str) -> None:
        """Let cluster-autoscaler take the node: cordoned (nothing new lands on it), no longer
        protected from scale-down, marked as ours to let go."""
        body = {
            "metadata": {"annotations": {KEEP: None, RELEASED: self.clock().isoformat()}},
            "spec": {"unschedulable": True},
        }
        await self.core.patch_node(node, body)
        self.nodes.set_health(node, healthy=False)
        self.machines.pop(node, None)
        log.info("pool node released", node=node)


def request_name(cluster: str, pool: str, seq: int) -> str:
    """A DNS-1123 name per (cluster, pool, number): `qm-<pool>-<hash>-<number>`."""
    piece = names.slug(pool, 30) or "pool"
    return f"qm-{piece}-{names.digest(cluster + '/' + pool, 6)}-{seq:05d}"


async def _created(call: Awaitable[Any]) -> Any:
    try:
        return await call
    except ApiException as error:
        if error.status != 409:  # made by an earlier try
            raise
        return None
