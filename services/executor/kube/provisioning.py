"""Elastic pools on Kubernetes, asked of the cluster the way cluster-autoscaler takes it.

A pool is a node group of the cluster whose nodes carry the pool label (`quartermaster.io/pool:
<pool>` by default; the node group's template sets it, with the accelerator label). To grow it,
the executor creates a `ProvisioningRequest` (`autoscaling.x-k8s.io/v1`, class
`best-effort-atomic-scale-up`) for the nodes missing, each node asked as one placeholder pod that
takes all of a node's accelerators on that group and may not land on a node the pool already
has (so cluster-autoscaler cannot answer "capacity is found" with an empty node of ours).
cluster-autoscaler adds them all or none and reports in the request's conditions; it keeps
retrying a request it cannot serve (a stockout: `Provisioned=False`, `CapacityIsNotFound`), so
a request not provisioned within its pool's timeout counts as failed, as does `Failed=True`.

A node that joins is matched to the oldest open request made before it and marked with it
(`quartermaster.io/provisioned-by`), in the same patch that keeps it from scale-down
(`cluster-autoscaler.kubernetes.io/scale-down-disabled: "true"`); a node the autoscaler removes
(empty, decided under the executor's lock) is cordoned and loses that annotation, and
cluster-autoscaler takes it away as an empty node.

What is on its way is read from the cluster each time, never remembered: the open requests less
the nodes matched to them. So a restart, or a decision applied twice, never asks twice
(docs/autoscaler.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException

from core.autoscale import NodePool
from schemas.events import AutoscaleDecided
from services.common.kafka import OutMessage
from services.executor.elastic import ElasticPools
from services.executor.kube import names
from services.executor.kube.backend import created
from services.executor.nodes import NodeBook
from services.executor.pools import Member, PoolBook
from services.executor.store import ExecutorStore

log = structlog.get_logger()

Obj = dict[str, Any]

GROUP, VERSION, PLURAL = "autoscaling.x-k8s.io", "v1", "provisioningrequests"
ATOMIC = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
KEEP = "cluster-autoscaler.kubernetes.io/scale-down-disabled"
RELEASED = names.PREFIX + "released-at"
REQUEST = names.PREFIX + "provisioned-by"
REQUESTED_AT = names.PREFIX + "requested-at"
POOL = names.PREFIX + "pool"
PLACEHOLDER_IMAGE = "registry.k8s.io/pause:3.9"
# Failures of the cluster's API that a later try may not see.
TRANSIENT = (ApiException, aiohttp.ClientError, TimeoutError)


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
    # A request not provisioned this long after it was made failed (None: twice the pool's
    # provisioning time plus a minute).
    timeout_s: float | None = None
    # Each call to the cluster's API gives up after this long.
    api_timeout_s: float = 10.0

    def timeout_for(self, pool: NodePool) -> float:
        return self.timeout_s if self.timeout_s is not None else 2 * pool.provision_s + 60


@dataclass(frozen=True)
class Request:
    """One ProvisioningRequest of ours, as the cluster holds it."""

    name: str
    pool: str
    count: int
    created_at: datetime  # the API's clock, to the second
    requested_at: datetime  # ours (the annotation), to compare with an inventory's time
    provisioned: bool = False
    # Provisioned with capacity already there: no node comes for it.
    found: bool = False
    failed: str | None = None  # the Failed condition's message
    waiting_why: str = ""  # the Provisioned condition's message while it is not

    @property
    def open(self) -> bool:
        return self.failed is None and not self.found


@dataclass(frozen=True)
class Machine:
    """A Node object of a pool."""

    name: str
    pool: str
    created_at: datetime
    ready: bool
    kept: bool  # carries scale-down-disabled: "true"
    released: bool  # let go: cordoned, cluster-autoscaler takes it when empty
    request: str | None = None  # the request it was matched to (its annotation)


@dataclass
class Steps:
    """What to do to bring the pools to their sizes, from the cluster's state now."""

    ask: dict[str, int] = field(default_factory=dict)  # pool: nodes to request
    cancel: list[Request] = field(default_factory=list)  # not provisioned, beyond the size
    done: list[Request] = field(default_factory=list)  # met, found or failed: deleted
    failures: dict[str, tuple[Request, int]] = field(default_factory=dict)  # pool: (why, lost)
    # Nodes to mark: kept from scale-down, with the request they came for (None: none).
    mark: dict[str, str | None] = field(default_factory=dict)
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
    provisioned = conditions.get("Provisioned") or {}
    failed = None
    if (conditions.get("Failed") or {}).get("status") == "True":
        c = conditions["Failed"]
        failed = str(c.get("message") or c.get("reason") or "the request failed")
    return Request(
        name=str(meta.get("name", "")),
        pool=str(pool),
        count=count,
        created_at=created,
        requested_at=_time((meta.get("annotations") or {}).get(REQUESTED_AT)) or created,
        provisioned=provisioned.get("status") == "True",
        found=provisioned.get("status") == "True"
        and provisioned.get("reason") == "CapacityIsFound",
        failed=failed,
        waiting_why=str(provisioned.get("message") or provisioned.get("reason") or ""),
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
        request=annotations.get(REQUEST),
    )


def match(requests: Sequence[Request], machines: Sequence[Machine]) -> dict[str, str]:
    """Which request each node came for: the one it is marked with, or (not marked yet) the
    oldest open request of its pool made before it that still waits for a node. Creation times
    are the API's, to the second: a node of the same second as a request is not its."""
    left = {r.name: r.count for r in requests}
    matched: dict[str, str] = {}
    for m in machines:
        if m.request is not None and left.get(m.request, 0) > 0:
            matched[m.name] = m.request
            left[m.request] -= 1
    by_pool: dict[str, list[Request]] = {}
    for r in sorted(requests, key=lambda r: (r.created_at, r.name)):
        by_pool.setdefault(r.pool, []).append(r)
    for m in sorted(machines, key=lambda m: (m.created_at, m.name)):
        if m.request is not None:
            continue  # marked for a request that is over (or met): it counts for no other
        for r in by_pool.get(m.pool, []):
            if r.created_at < m.created_at and left[r.name] > 0:
                matched[m.name] = r.name
                left[r.name] -= 1
                break
    return matched


def plan(
    desired: Mapping[str, int],
    requests: Sequence[Request],
    machines: Sequence[Machine],
    now: datetime,
    *,
    timeout_s: Mapping[str, float] | None = None,
    quiet: set[str] | None = None,
    since: Mapping[str, datetime] | None = None,
) -> Steps:
    """Bring each pool in `desired` to its size. A request that failed, or was not provisioned
    within its pool's timeout, is deleted and its nodes not come are lost (the pool's size drops
    by them: app side); a met one, or one answered with capacity already there, is deleted. Nodes
    still to come from open requests count as the pool's. Missing nodes are asked in one request,
    unless the pool is `quiet` or a request of it failed just now; nodes beyond the size are
    canceled from the newest requests not provisioned yet, never one made after the inventory
    its pool's last decision was taken on (`since`)."""
    steps = Steps()
    usable = [r for r in requests if r.open]
    matched = match(usable, machines)
    came: dict[str, int] = {}
    for request_name in matched.values():
        came[request_name] = came.get(request_name, 0) + 1
    for r in requests:
        left = r.count - came.get(r.name, 0)
        late = not r.provisioned and (now - r.created_at).total_seconds() > (timeout_s or {}).get(
            r.pool, float("inf")
        )
        if r.failed is not None or (late and left > 0):
            why = r.failed or f"not provisioned within the pool's timeout: {r.waiting_why}"
            steps.done.append(r)
            # A failed atomic request brought nothing; a late one what has not come yet.
            lost = r.count if r.failed is not None else left
            previous = steps.failures.get(r.pool)
            total = lost + (previous[1] if previous else 0)
            steps.failures[r.pool] = (replace(r, failed=why), total)
        elif r.found or left <= 0:
            steps.done.append(r)
        else:
            steps.waiting[r.name] = left
    for m in machines:
        if m.released:
            continue
        request = matched.get(m.name)
        if not m.kept or (request is not None and m.request != request):
            steps.mark[m.name] = request
    for pool, size in sorted(desired.items()):
        live = [m for m in machines if m.pool == pool and not m.released]
        mine = [r for r in requests if r.pool == pool and r.name in steps.waiting]
        coming = sum(steps.waiting[r.name] for r in mine)
        missing = size - len(live) - coming
        if missing > 0 and pool not in (quiet or set()) and pool not in steps.failures:
            steps.ask[pool] = missing
        elif missing < 0:
            excess = -missing
            after = (since or {}).get(pool)
            for r in sorted(mine, key=lambda r: (r.created_at, r.name), reverse=True):
                newer = after is not None and r.requested_at > after
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

    every_s = 2.0

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
        # Per pool, the inventory time its newest decision was taken on.
        self.since: dict[str, datetime] = {}
        # Reading and changing requests, one at a time (the executor's lock is taken only to
        # let a node go, and never across a call to the API).
        self.converging = asyncio.Lock()
        self.ticks = 0

    async def start(self, store: ExecutorStore) -> None:
        """The stored sizes, newest decisions and request numbers; the members are the
        cluster's and are read from it, never restored into the node book."""
        self.store = store
        members, sizes, applied = await store.load_pools()
        self.book.restore([], sizes, applied)
        log.info("pools restored", pools=len(self.book.pools), stored_members=len(members))

    def ready_nodes(self) -> dict[str, Any]:
        return {}  # the pool's nodes are Node objects: the inventory announces them

    def _api(self) -> dict[str, float]:
        return {"_request_timeout": self.options.api_timeout_s}

    async def decided(self, d: AutoscaleDecided, decided_at: datetime | None) -> bool:
        async with self.converging:
            pool = self.book.accept(d, decided_at)
            if pool is None:
                return False
            if d.inventory_at is not None:
                self.since[pool.name] = d.inventory_at
            self.quiet_since.pop(pool.name, None)
            try:
                await self._read()
            except TRANSIENT as error:
                log.warning("pool decision not applied yet", pool=pool.name, error=str(error))
                return False  # it stays the newest: the autoscaler sends it again
            kept = 0
            for node_id in d.remove:
                m = self.machines.get(node_id)
                if m is None or m.pool != pool.name or m.released:
                    continue
                try:
                    if not await self._release(node_id):
                        kept += 1  # it took work meanwhile: stays, on top of the size
                except TRANSIENT as error:
                    kept += 1  # still ours; the autoscaler names it again
                    log.warning("pool node not released", node=node_id, error=str(error))
            self.book.desired[pool.name] = max(
                pool.min_nodes, min(d.desired_nodes + kept, pool.max_nodes)
            )
            await self._save()
            try:
                await self._converge()
            except TRANSIENT as error:
                log.warning("pool not converged yet", pool=pool.name, error=str(error))
        log.info(
            "pool resized",
            pool=d.pool,
            desired=self.book.desired[pool.name],
            remove=d.remove,
            reason=d.reason,
        )
        return True

    async def tick(self, now: datetime) -> None:
        async with self.converging:
            before = self._shape()
            await self._read()
            await self._converge()
            if self.unsaved:
                await self._save()
            self.ticks += 1
            if self.ticks % 15 == 1:
                await self._sweep_templates()
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
            label_selector=names.gang_selector(self.options.cluster),
            **self._api(),
        )
        self.requests = [
            r
            for obj in listed.get("items") or []
            if (r := parse_request(obj)) is not None and r.pool in self.book.pools
        ]
        response = await self.core.list_node(
            label_selector=o.pool_label, _preload_content=False, **self._api()
        )
        nodes = json.loads(await response.read())
        self.machines = {
            m.name: m
            for obj in nodes.get("items") or []
            if (m := parse_machine(obj, o.pool_label)) is not None and m.pool in self.book.pools
        }

    async def _converge(self) -> None:
        now = self.clock()
        quiet = {
            p
            for p, at in self.quiet_since.items()
            if (now - at).total_seconds() < self.options.retry_failed_after_s
        }
        timeouts = {name: self.options.timeout_for(p) for name, p in self.book.pools.items()}
        steps = plan(
            self.book.desired,
            self.requests,
            list(self.machines.values()),
            now,
            timeout_s=timeouts,
            quiet=quiet,
            since=self.since,
        )
        for r in steps.done + steps.cancel:
            await self._delete(r.name)  # before the size drops: a failed delete drops nothing
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
        for node, request in steps.mark.items():
            await self._mark(node, request)
        for pool, count in steps.ask.items():
            made = await self._ask(self.book.pools[pool], count, now)
            if made is not None:
                steps.waiting[made.name] = made.count
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
                members[f"{name}-{i}"] = Member(f"{name}-{i}", r.pool, r.requested_at)
        self.book.members = members
        self.book.note_use(self.nodes.busy, self.clock())

    async def _ask(self, pool: NodePool, count: int, now: datetime) -> Request | None:
        """One request for `count` whole nodes of the pool, never on a node it has (its
        placeholder pods' template first; both named from the pool's request number, so a
        retry answers 409)."""
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
        spec: Obj = {
            "nodeSelector": {o.pool_label: pool.name},
            "tolerations": [
                {"key": k, "operator": "Exists", "effect": "NoSchedule"} for k in o.toleration_keys
            ],
            "containers": [
                {
                    "name": "capacity",
                    "image": PLACEHOLDER_IMAGE,
                    "resources": {"requests": {resource: per_node}, "limits": {resource: per_node}},
                }
            ],
        }
        have = sorted(m.name for m in self.machines.values() if m.pool == pool.name)
        if have:
            spec["affinity"] = {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {"key": "metadata.name", "operator": "NotIn", "values": have}
                                ]
                            }
                        ]
                    }
                }
            }
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": name, "namespace": o.namespace, "labels": labels},
            "template": {"metadata": {"labels": labels}, "spec": spec},
        }
        request = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ProvisioningRequest",
            "metadata": {
                "name": name,
                "namespace": o.namespace,
                "labels": labels,
                "annotations": {REQUESTED_AT: now.isoformat()},
            },
            "spec": {
                "provisioningClassName": o.provisioning_class,
                "podSets": [{"podTemplateRef": {"name": name}, "count": count}],
            },
        }
        await created(
            self.core.create_namespaced_pod_template(o.namespace, template, **self._api())
        )
        answer = await created(
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, o.namespace, PLURAL, request, **self._api()
            )
        )
        log.info("pool nodes requested", pool=pool.name, request=name, count=count)
        made = parse_request(answer) if answer is not None else None
        if made is not None:
            self.requests.append(made)
        return made

    async def _delete(self, name: str) -> None:
        o = self.options
        for call in (
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, o.namespace, PLURAL, name, **self._api()
            ),
            self.core.delete_namespaced_pod_template(name, o.namespace, **self._api()),
        ):
            try:
                await call
            except ApiException as error:
                if error.status != 404:
                    raise
        self.requests = [r for r in self.requests if r.name != name]

    async def _sweep_templates(self) -> None:
        """Templates left without their request (a crash between the two creates or deletes)."""
        o = self.options
        listed = await self.core.list_namespaced_pod_template(
            o.namespace,
            label_selector=names.gang_selector(self.options.cluster),
            _preload_content=False,
            **self._api(),
        )
        open_names = {r.name for r in self.requests}
        cutoff = self.clock()
        for obj in json.loads(await listed.read()).get("items") or []:
            meta = obj.get("metadata") or {}
            created = _time(meta.get("creationTimestamp")) or cutoff
            # A template younger than a minute may belong to a request being made now.
            if meta.get("name") not in open_names and (cutoff - created).total_seconds() > 60:
                await self._delete(str(meta["name"]))

    async def _mark(self, node: str, request: str | None) -> None:
        annotations = {KEEP: "true"}
        if request is not None:
            annotations[REQUEST] = request
        await self.core.patch_node(node, {"metadata": {"annotations": annotations}}, **self._api())

    async def _release(self, node: str) -> bool:
        """Let cluster-autoscaler take the node if nothing is booked on it (checked under the
        executor's lock, which no placement passes meanwhile): cordoned (nothing new lands on
        it), no longer protected from scale-down, marked as ours to let go."""
        async with self.changing:
            if self.nodes.busy(node):
                return False
            body = {
                "metadata": {"annotations": {KEEP: None, RELEASED: self.clock().isoformat()}},
                "spec": {"unschedulable": True},
            }
            await self.core.patch_node(node, body, **self._api())
            self.nodes.set_health(node, healthy=False)
        self.machines.pop(node, None)
        log.info("pool node released", node=node)
        return True


def request_name(cluster: str, pool: str, seq: int) -> str:
    """A DNS-1123 name per (cluster, pool, number): `qm-<pool>-<hash>-<number>`."""
    piece = names.slug(pool, 30) or "pool"
    return f"qm-{piece}-{names.digest(cluster + '/' + pool, 6)}-{seq:05d}"
