"""The runs an executor holds, by job, and which of them have a replica on each node.

A node's loss (`node.unhealthy`) hands back every gang with a replica on it. Finding those by
walking every run cost what the cluster's load does, for each node lost: at 40,000 runs, some
30 ms a record, and a rack or a whole cluster going dark is one record per node. The index
answers from the node's own runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn, TypeVar, overload

from services.executor.store import RunningJob

T = TypeVar("T")


def _nodes(job: RunningJob) -> Iterable[str]:
    return dict.fromkeys(r.node_id for r in job.replicas)


class RunningJobs(dict[str, RunningJob]):
    """A dict of job id -> run that keeps a node -> job ids index in step. Only the methods
    that keep the index are open for writing (set, del, pop, clear); the rest raise.

    A run's replicas are not changed in place while it is held (nothing in the executor does;
    a changed run is stored again under its job id, which re-indexes it)."""

    def __init__(self) -> None:
        super().__init__()
        # node id -> job ids with a replica there, in the order they were indexed.
        self._on_node: dict[str, dict[str, None]] = {}

    def on_node(self, node_id: str) -> list[RunningJob]:
        """The runs with a replica on this node, in the order they were stored."""
        return [self[j] for j in self._on_node.get(node_id, ())]

    def __setitem__(self, job_id: str, job: RunningJob) -> None:
        old = self.get(job_id)
        if old is not None:
            if old.replicas == job.replicas:
                super().__setitem__(job_id, job)
                return
            self._forget(job_id, old)
        super().__setitem__(job_id, job)
        for node_id in _nodes(job):
            self._on_node.setdefault(node_id, {})[job_id] = None

    def __delitem__(self, job_id: str) -> None:
        job = self[job_id]
        super().__delitem__(job_id)
        self._forget(job_id, job)

    _MISSING: Any = object()

    @overload
    def pop(self, job_id: str) -> RunningJob: ...

    @overload
    def pop(self, job_id: str, default: RunningJob | T) -> RunningJob | T: ...

    def pop(self, job_id: str, default: Any = _MISSING) -> Any:
        if job_id not in self:
            if default is RunningJobs._MISSING:
                raise KeyError(job_id)
            return default
        job = self[job_id]
        del self[job_id]
        return job

    def clear(self) -> None:
        super().clear()
        self._on_node.clear()

    def _forget(self, job_id: str, job: RunningJob) -> None:
        for node_id in _nodes(job):
            jobs = self._on_node.get(node_id)
            if jobs is not None:
                jobs.pop(job_id, None)
                if not jobs:
                    del self._on_node[node_id]

    def _closed(self, *_: Any, **__: Any) -> NoReturn:
        raise TypeError("RunningJobs keeps a node index: set, del, pop or clear instead")

    update = setdefault = popitem = __ior__ = _closed
