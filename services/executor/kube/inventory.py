"""The cluster's Node objects, listed then watched: the executor's node book (what it may
place), its inventory (cluster.capacity), which nodes heartbeat, and node.probe signals for
devices a node stopped offering."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio.client import ApiClient, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.watch import Watch

from core.model import AcceleratorModel, Node
from schemas.health import NodeProbe, SignalKind
from services.executor.kube.nodes import NodeLabels, NodeView, lost_devices, node_view
from services.executor.nodes import NodeBook

log = structlog.get_logger()

Obj = dict[str, Any]
ProbeSink = Callable[[NodeProbe], Awaitable[None]]


class KubeInventory:
    def __init__(
        self,
        api: ApiClient,
        cluster: str,
        labels: NodeLabels,
        types: Mapping[str, AcceleratorModel],
        book: NodeBook,
        *,
        on_probe: ProbeSink | None = None,
        device_loss: SignalKind = SignalKind.PCIE_ERROR,
    ) -> None:
        self.core: Any = CoreV1Api(api)
        self.cluster = cluster
        self.labels = labels
        self.types = types
        self.book = book
        self.on_probe = on_probe
        self.device_loss = device_loss
        self.views: dict[str, NodeView] = {}

    def hostname(self, node_id: str) -> str:
        """The node's `kubernetes.io/hostname` label, which pods are pinned with."""
        view = self.views.get(node_id)
        return view.hostname if view is not None else node_id

    def pinned(self, node_id: str) -> Mapping[str, str]:
        """More of the node's labels its pods select on (a TPU slice's topology)."""
        view = self.views.get(node_id)
        return view.pinned if view is not None else {}

    def nodes(self) -> dict[str, Node]:
        """The accelerator nodes as the scheduler should see them (cluster.capacity)."""
        return {name: v.node for name, v in sorted(self.views.items()) if v.node is not None}

    def silent(self) -> set[str]:
        """Nodes that send no heartbeat: not Ready (its kubelet stopped posting) or gone. The
        health service hears the silence and quarantines them (heartbeat_lost)."""
        return {n for n in self.book.use if n not in self.views or not self.views[n].ready}

    async def load(self) -> str:
        """List every node; the list's resourceVersion, to watch from."""
        response = await self.core.list_node(_preload_content=False)
        listed: Obj = json.loads(await response.read())
        names = set()
        for obj in listed.get("items") or []:
            names.add(obj["metadata"]["name"])
            await self._seen(obj)
        for gone in set(self.views) - names:
            await self._gone(gone)
        return str((listed.get("metadata") or {}).get("resourceVersion", ""))

    async def run(self) -> None:
        """List, then watch from the list's version; re-list on 410, re-watch after a cut."""
        while True:
            try:
                version = await self.load()
                while True:
                    watch = Watch()
                    try:
                        async for event in watch.stream(
                            self.core.list_node,
                            resource_version=version,
                            allow_watch_bookmarks=True,
                        ):
                            raw = event.get("raw_object") or {}
                            meta = raw.get("metadata") or {}
                            version = str(meta.get("resourceVersion") or version)
                            if event.get("type") == "DELETED":
                                await self._gone(meta.get("name", ""))
                            elif event.get("type") in ("ADDED", "MODIFIED"):
                                await self._seen(raw)
                    except aiohttp.ClientPayloadError:
                        log.info("node watch cut; watching again", resource_version=version)
                    finally:
                        await watch.close()
            except asyncio.CancelledError:
                raise
            except ApiException as error:
                if error.status != 410:
                    log.warning("node watch failed; listing again", status=error.status)
                    await asyncio.sleep(1.0)
            except Exception as error:
                log.warning("node watch failed; listing again", error=str(error))
                await asyncio.sleep(1.0)

    async def _seen(self, obj: Obj) -> None:
        view = node_view(obj, self.cluster, self.labels, self.types)
        before = self.views.get(view.name)
        self.views[view.name] = view
        if view.node is not None:
            self.book.upsert(view.node)
        lost = lost_devices(before, view)
        if lost and self.on_probe is not None:
            detail = (
                f"allocatable accelerators dropped from {before.devices if before else 0} "
                f"to {view.devices} (the device plugin stopped offering {lost})"
            )
            log.warning("node lost devices", node=view.name, lost=lost)
            await self.on_probe(
                NodeProbe(
                    node_id=view.name, cluster=self.cluster, kind=self.device_loss, detail=detail
                )
            )

    async def _gone(self, name: str) -> None:
        """A Node object deleted (a pool's node taken away, a machine retired): forgotten if
        nothing is booked on it; else it stays, unhealthy, until its runs are handed back."""
        self.views.pop(name, None)
        if not self.book.remove(name):
            self.book.set_health(name, healthy=False)
