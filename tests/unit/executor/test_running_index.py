"""The executor's runs by node: the index a node's loss is answered from stays in step with
the runs, whatever is stored, replaced and removed."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from schemas.events import ReplicaAssignment
from services.executor.backend import NEVER
from services.executor.handlers import Executor
from services.executor.metrics import ExecutorMetrics
from services.executor.nodes import NodeBook
from services.executor.running import RunningJobs
from services.executor.simulated import RunEnd
from services.executor.store import RunningJob

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def run(job_id: str, nodes: list[int], attempt: int = 1) -> RunningJob:
    replicas = [
        ReplicaAssignment(replica=i, node_id=f"n{n}", accelerators=1, cpu=1, memory_gb=1)
        for i, n in enumerate(nodes)
    ]
    return RunningJob(
        job_id, attempt, 1, "t", replicas, T0, T0 + timedelta(minutes=5), RunEnd.SUCCEEDED
    )


ops = st.lists(
    st.tuples(
        st.sampled_from(["set", "del", "pop", "pop-default", "clear"]),
        st.integers(0, 5),  # job
        st.lists(st.integers(0, 3), min_size=1, max_size=3),  # its replicas' nodes
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_the_node_index_names_exactly_the_runs_with_a_replica_there(
    steps: list[tuple[str, int, list[int]]],
) -> None:
    running = RunningJobs()
    for i, (op, job, nodes) in enumerate(steps):
        job_id = f"j{job}"
        if op == "set":
            running[job_id] = run(job_id, nodes, attempt=i)
        elif op == "del" and job_id in running:
            del running[job_id]
        elif op == "pop":
            if job_id in running:
                assert running.pop(job_id).job_id == job_id
            else:
                with pytest.raises(KeyError):
                    running.pop(job_id)
        elif op == "pop-default":
            had = running.get(job_id)
            assert running.pop(job_id, None) is had
        elif op == "clear" and i % 7 == 0:
            running.clear()
        for n in range(4):
            expected = [j for j in running.values() if f"n{n}" in j.nodes]
            got = running.on_node(f"n{n}")
            assert len(got) == len({j.job_id for j in got})
            assert {j.job_id for j in got} == {j.job_id for j in expected}
            assert all(running[j.job_id] is j for j in got)  # the run stored now, not an old one


def test_runs_on_a_node_come_in_the_order_they_were_stored() -> None:
    running = RunningJobs()
    for job_id in ("c", "a", "b"):
        running[job_id] = run(job_id, [0])
    running["a"] = run("a", [0], attempt=2)  # same nodes: keeps its place
    assert [j.job_id for j in running.on_node("n0")] == ["c", "a", "b"]
    assert running.on_node("n0")[1].attempt == 2
    running["c"] = run("c", [1])  # moved off n0
    assert [j.job_id for j in running.on_node("n0")] == ["a", "b"]
    assert [j.job_id for j in running.on_node("n1")] == ["c"]
    assert running.on_node("n9") == []


@pytest.mark.parametrize("name", ["update", "setdefault", "popitem"])
def test_writes_that_would_bypass_the_index_are_refused(name: str) -> None:
    running = RunningJobs()
    running["a"] = run("a", [0])
    with pytest.raises(TypeError, match="node index"):
        getattr(running, name)({"b": run("b", [1])} if name == "update" else "b")
    with pytest.raises(TypeError, match="node index"):
        running |= {"b": run("b", [1])}
    assert list(running) == ["a"]


class _Store:
    def __init__(self, jobs: list[RunningJob]) -> None:
        self.jobs = jobs

    async def load(self) -> tuple[list[RunningJob], int, dict[str, float]]:
        return self.jobs, 0, {}


async def test_a_run_its_backend_ends_is_not_kept_on_the_clock() -> None:
    """A Kubernetes gang or a served model is never due on the executor's clock: its entry
    would stay in the heap, one per placement ever made, until a restart."""
    clocked = run("clocked", [0])
    reported = replace(run("reported", [1]), ends_at=T0 + NEVER)
    executor = Executor(
        "c",
        NodeBook({}),
        _Store([clocked, reported]),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        ExecutorMetrics(CollectorRegistry()),
        time_scale=1,
        default_duration_s=60,
    )
    await executor.restore()
    assert set(executor.running) == {"clocked", "reported"}
    assert [job_id for _, job_id, _ in executor.due] == ["clocked"]
    assert [j.job_id for j in executor.running.on_node("n1")] == ["reported"]
