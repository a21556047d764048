"""The whole platform as processes, with one cluster whose executor uses the kubernetes backend
against the Kubernetes API double: jobs submitted with `qm submit` become pods on the chosen
nodes and end as the pods do. Single job, gang, a failed member, preemption with checkpoint,
a node going NotReady and a cordoned node, and an executor restart.

The double serves from a thread of this process and plays kubelet (`auto_kubelet`: a bound,
ungated pod runs at once); the test decides when a pod succeeds or fails. The stack runs in
wall time (time scale 1), as on a real cluster, with a policy whose preemption timings fit a
test (no minimum runtime, a 3 s grace cap, a 1 s requeue backoff)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.k8s_backend import write_fleet
from cli.stack import PROJECT_ROOT, Service, Stack
from schemas import topics
from tests.conftest import own_stack
from tests.integration.kafka_tools import collect
from tests.kubeapi import ResourceType, ThreadedDouble, run_in_thread, write_kubeconfig
from tests.kubeapi.store import Change

NAMESPACE = "quartermaster-jobs"
CLUSTER = "k8s-h100"
NODES = ("kn-0", "kn-1", "kn-2", "kn-3")
JOB_ANNOTATION = "quartermaster.io/job"
CHECKPOINT_ANNOTATION = "quartermaster.io/checkpoint-requested"
ADMIN = {"Authorization": "Bearer dev-admin"}
VISION_TOKEN = "dev-vision"
Obj = dict[str, Any]
QM_MAIN = "from cli.main import app; app()"
UNHEALTHY_AFTER_S = 30


@dataclass
class KubeStack:
    stack: Stack
    kube: ThreadedDouble
    workdir: Path
    # Pod name -> the checkpoint request its annotations carried (written by the double's loop).
    checkpoint_requests: dict[str, str]

    @property
    def executor(self) -> Service:
        (service,) = [s for s in self.stack.services if s.module == "services.executor"]
        return service

    def hook(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call one of the double's hooks (kubelet, node controllers) on its loop."""
        return self.kube.call(getattr(self.kube.double, name), *args, **kwargs)

    def pods(self, job_id: str) -> list[Obj]:
        """Copies of the job's pods (every attempt), by name."""

        def mine() -> list[Obj]:
            return [
                copy.deepcopy(p)
                for p in self.kube.double.objects("pods", NAMESPACE)
                if (p["metadata"].get("annotations") or {}).get(JOB_ANNOTATION) == job_id
            ]

        return self.kube.call(mine)

    def node(self, name: str) -> Obj:
        return self.kube.call(lambda: copy.deepcopy(self.kube.double.get("nodes", None, name)))


def _policy(workdir: Path) -> Path:
    """The example policy with preemption timings for wall time."""
    policy = yaml.safe_load((PROJECT_ROOT / "examples" / "policy.yaml").read_text())
    policy["preemption"].update(
        min_runtime_s=0, grace_cap_s=3, requeue_backoff_s=1, requeue_backoff_cap_s=2
    )
    path = workdir / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


def _prepare(double: Any, checkpoint_requests: dict[str, str]) -> None:
    """Nodes, the namespace, the auto kubelet, and a listener that notes every checkpoint
    request a pod's annotations carry (the pod is gone by the time the test looks)."""

    def note(rt: ResourceType, change: Change) -> None:
        annotations = change.obj.get("metadata", {}).get("annotations") or {}
        if rt.plural == "pods" and CHECKPOINT_ANNOTATION in annotations:
            checkpoint_requests[change.obj["metadata"]["name"]] = annotations[CHECKPOINT_ANNOTATION]

    double.add_listener(note)
    double.create("namespaces", None, {"metadata": {"name": NAMESPACE}})
    for i, name in enumerate(NODES):
        double.add_node(
            name,
            labels={
                "quartermaster.io/accelerator": "H100",
                "kubernetes.io/hostname": f"host-{name}",
                "topology.kubernetes.io/rack": f"rack-{i // 2}",
                "topology.kubernetes.io/zone": "block-0",
                "quartermaster.io/price-tier": "reserved",
            },
            allocatable={"nvidia.com/gpu": "8", "cpu": "96", "memory": "1024Gi"},
            taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}],
        )
    double.auto_kubelet()


@pytest.fixture(scope="module")
def kube_stack(
    tmp_path_factory: pytest.TempPathFactory, postgres_server_url: str
) -> Iterator[KubeStack]:
    workdir = tmp_path_factory.mktemp("kube-stack")
    with run_in_thread() as kube:
        checkpoint_requests: dict[str, str] = {}
        kube.call(_prepare, kube.double, checkpoint_requests)
        kubeconfig = write_kubeconfig(workdir / "kubeconfig", kube.url, NAMESPACE)
        env = {
            "QM_CAPACITY_INTERVAL_S": "1",
            # A node silent this long is lost. Long enough that the executor's restart (all
            # of its nodes silent meanwhile) never looks like lost nodes, even on a loaded
            # machine; the NotReady flow waits it out.
            "QM_UNHEALTHY_AFTER_S": str(UNHEALTHY_AFTER_S),
        }
        with own_stack(
            workdir,
            postgres_server_url,
            env,
            fleet_file=write_fleet(workdir, CLUSTER, kubeconfig),
            policy_file=_policy(workdir),
            time_scale=1.0,
        ) as stack:
            yield KubeStack(stack, kube, workdir, checkpoint_requests)


@pytest.fixture(scope="module")
async def client(kube_stack: KubeStack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=kube_stack.stack.gateway_url, timeout=30) as c:
        yield c


# --- helpers -----------------------------------------------------------------------------------


async def qm_submit(ks: KubeStack, name: str, body: Obj, token: str = VISION_TOKEN) -> str:
    """`qm submit -f <file>` as a user would run it; the job id it prints."""
    path = ks.workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, **body}))
    qm = Path(sys.executable).with_name("qm")
    command = [str(qm)] if qm.exists() else [sys.executable, "-c", QM_MAIN]
    process = await asyncio.create_subprocess_exec(
        *command,
        "submit",
        "-f",
        str(path),
        "--gateway",
        ks.stack.gateway_url,
        "--token",
        token,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NO_COLOR": "1"},
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return out.decode().strip()


async def until(what: str, check: Callable[[], Any], timeout_s: float = 90.0) -> Any:
    """Poll `check` until it returns something true; that value."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def job(client: httpx.AsyncClient, job_id: str) -> Obj:
    r = await client.get(f"/v1/jobs/{job_id}", headers=ADMIN)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def wait_state(
    client: httpx.AsyncClient, job_id: str, states: set[str], timeout_s: float = 90.0
) -> Obj:
    seen: Obj = {}

    async def reached() -> Obj | None:
        nonlocal seen
        seen = await job(client, job_id)
        return seen if seen["state"] in states else None

    try:
        return dict(await until(f"{job_id} in {states}", reached, timeout_s))
    except AssertionError:
        raise AssertionError(f"{job_id} never reached {states}: {seen}") from None


def attempt_of(pod: Obj) -> int:
    return int(pod["metadata"]["labels"]["quartermaster.io/attempt"])


def running_pods(ks: KubeStack, job_id: str, replicas: int, after: int = 0) -> list[Obj] | None:
    """The pods of the job's newest attempt (above `after`) once every one of them runs (and is
    not being deleted). Not a fixed attempt: a placement refused on its way (a node cordoned a
    moment before) comes back as the next attempt."""
    live = [p for p in ks.pods(job_id) if "deletionTimestamp" not in p["metadata"]]
    newest = max((attempt_of(p) for p in live), default=0)
    pods = [p for p in live if attempt_of(p) == newest]
    if (
        newest > after
        and len(pods) == replicas
        and all(p["status"].get("phase") == "Running" for p in pods)
    ):
        return sorted(pods, key=lambda p: p["metadata"]["name"])
    return None


async def running(
    ks: KubeStack, job_id: str, replicas: int = 1, after: int = 0, timeout_s: float = 90.0
) -> list[Obj]:
    return list(
        await until(
            f"{job_id}: {replicas} pods of an attempt after {after} running",
            lambda: running_pods(ks, job_id, replicas, after),
            timeout_s,
        )
    )


def succeed(ks: KubeStack, pods: list[Obj]) -> None:
    for pod in pods:
        ks.hook("pod_succeeded", NAMESPACE, pod["metadata"]["name"])


def _objects_of(ks: KubeStack, resource: str, job_id: str) -> list[Obj]:
    def mine() -> list[Obj]:
        return [
            copy.deepcopy(b)
            for b in ks.kube.double.objects(resource, NAMESPACE)
            if (b["metadata"].get("annotations") or {}).get(JOB_ANNOTATION) == job_id
        ]

    return ks.kube.call(mine)


def budgets(ks: KubeStack, job_id: str) -> list[Obj]:
    return _objects_of(ks, "poddisruptionbudgets", job_id)


def gang_services(ks: KubeStack, job_id: str) -> list[Obj]:
    return _objects_of(ks, "services", job_id)


def env_of(pod: Obj) -> dict[str, str]:
    container = pod["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def node_of(pod: Obj) -> str:
    return str(pod["spec"]["nodeName"])


IMAGE = "registry.example/trainer:1.0"
GANG_OF_8 = {"resources": {"accelerators": 8, "accelerator_types": ["H100"]}, "image": IMAGE}


# --- the flows ---------------------------------------------------------------------------------


async def test_a_job_submitted_with_qm_runs_as_a_pod_and_succeeds(
    kube_stack: KubeStack, client: httpx.AsyncClient
) -> None:
    ks = kube_stack
    job_id = await qm_submit(
        ks,
        "single",
        {"resources": {"accelerators": 2, "accelerator_types": ["H100"]}, "image": "busybox"},
    )
    (pod,) = await running(ks, job_id)
    status = await wait_state(client, job_id, {"running"})
    # On the node the scheduler chose, pinned by the hostname label of its Node object.
    (node,) = status["nodes"]
    assert node_of(pod) == node
    assert pod["spec"]["nodeSelector"]["kubernetes.io/hostname"] == f"host-{node}"
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "2"
    assert pod["spec"]["containers"][0]["image"] == "busybox"
    assert pod["metadata"]["labels"]["quartermaster.io/tenant"] == "vision"
    assert not pod["spec"].get("schedulingGates")

    succeed(ks, [pod])
    done = await wait_state(client, job_id, {"succeeded", "failed", "canceled"})
    assert done["state"] == "succeeded", done
    # The run's objects are cleaned up once it is over.
    await until("the pod deleted", lambda: not ks.pods(job_id))


async def test_a_gang_starts_together_on_distinct_nodes_and_succeeds(
    kube_stack: KubeStack, client: httpx.AsyncClient
) -> None:
    ks = kube_stack
    job_id = await qm_submit(ks, "gang", {**GANG_OF_8, "replicas": 2})
    pods = await running(ks, job_id, replicas=2)
    assert len({node_of(p) for p in pods}) == 2
    ranks = sorted(env_of(p)["RANK"] for p in pods)
    assert ranks == ["0", "1"]
    assert {env_of(p)["WORLD_SIZE"] for p in pods} == {"2"}
    assert len({env_of(p)["MASTER_ADDR"] for p in pods}) == 1
    # job.started is announced once every replica runs, naming both nodes.
    status = await wait_state(client, job_id, {"running"})
    assert sorted(status["nodes"]) == sorted(node_of(p) for p in pods)

    # A node drain must not break the gang one member at a time: its budget keeps all.
    (budget,) = budgets(ks, job_id)
    assert budget["spec"]["minAvailable"] == 2

    succeed(ks, pods)
    done = await wait_state(client, job_id, {"succeeded", "failed", "canceled"})
    assert done["state"] == "succeeded", done
    await until("the gang's budget deleted", lambda: not budgets(ks, job_id))


async def test_a_failed_member_tears_the_gang_down_and_fails_the_job(
    kube_stack: KubeStack, client: httpx.AsyncClient
) -> None:
    ks = kube_stack
    job_id = await qm_submit(ks, "oom", {**GANG_OF_8, "replicas": 2, "max_retries": 0})
    pods = await running(ks, job_id, replicas=2)
    ks.hook("pod_oom_killed", NAMESPACE, pods[1]["metadata"]["name"])
    done = await wait_state(client, job_id, {"succeeded", "failed", "canceled"})
    assert done["state"] == "failed", done
    assert done["reason_code"] == "out_of_memory", done
    # The member still running was deleted with the rest of the gang.
    await until("the gang deleted", lambda: not ks.pods(job_id))


async def test_a_critical_job_preempts_with_a_checkpoint_and_the_victim_runs_again(
    kube_stack: KubeStack, client: httpx.AsyncClient
) -> None:
    ks = kube_stack
    bootstrap = ks.stack.server("kafka").url
    healthy = [n for n in NODES if not ks.node(n)["spec"].get("unschedulable")]
    filler = {**GANG_OF_8, "priority_class": "low", "checkpoint_grace_s": 2}
    fillers = [await qm_submit(ks, f"filler-{i}", filler) for i in range(len(healthy))]
    filler_pods = {f: (await running(ks, f))[0] for f in fillers}

    critical = await qm_submit(ks, "critical", {**GANG_OF_8, "priority_class": "critical"})
    (critical_pod,) = await running(ks, critical)
    events = await collect(
        bootstrap,
        (topics.JOB_CHECKPOINT_REQUESTED, topics.JOB_PREEMPTED),
        lambda _t, e: e["payload"].get("for_job") == critical,
        count=2,
        timeout_s=30,
    )
    by_topic = {t: e["payload"] for t, e in events}
    victim = by_topic[topics.JOB_PREEMPTED]["job_id"]
    assert victim in fillers
    assert by_topic[topics.JOB_CHECKPOINT_REQUESTED]["job_id"] == victim
    assert node_of(critical_pod) == node_of(filler_pods[victim])

    # The victim's pod was told to checkpoint (the annotation the workload reads) and then
    # deleted with the grace it was granted.
    victim_pod = filler_pods[victim]["metadata"]["name"]
    deletions = ks.kube.call(lambda: [d for d in ks.kube.double.deletions if d.name == victim_pod])
    assert deletions and deletions[0].requested_grace_seconds == 2, deletions
    assert victim_pod in ks.checkpoint_requests, "the checkpoint annotation was never written"

    # The critical job runs; once it is done, the victim runs again (attempt 2) and finishes.
    succeed(ks, [critical_pod])
    assert (await wait_state(client, critical, {"succeeded"}))["state"] == "succeeded"
    (again,) = await running(ks, victim, after=attempt_of(filler_pods[victim]))
    succeed(ks, [again, *(p for f, p in filler_pods.items() if f != victim)])
    for f in fillers:
        done = await wait_state(client, f, {"succeeded", "failed", "canceled"})
        assert done["state"] == "succeeded", done
    history = [h["type"] for h in (await job(client, victim))["history"]]
    assert "JobPreempted" in history, history


async def test_a_job_without_an_image_fails_with_the_apis_reason(
    kube_stack: KubeStack, client: httpx.AsyncClient
) -> None:
    """Kubernetes needs an image (this stack sets no default): the job fails once, with the
    API's words, instead of being placed and refused in a loop."""
    ks = kube_stack
    body = {"resources": {"accelerators": 1, "accelerator_types": ["H100"]}}
    job_id = await qm_submit(ks, "no-image", body)
    done = await wait_state(client, job_id, {"succeeded", "failed", "canceled"})
    assert done["state"] == "failed", done
    assert done["reason_code"] == "invalid_pod", done
    assert "image" in done["message"], done
    assert not ks.pods(job_id)
    # What was created before the pod was refused (its Service, its budget) is gone too.
    await until(
        "the gang's objects deleted",
        lambda: not budgets(ks, job_id) and not gang_services(ks, job_id),
    )


async def test_a_cordoned_node_keeps_its_work_and_gets_no_new_work(
    kube_stack: KubeStack, client: httpx.AsyncClient
) -> None:
    ks = kube_stack
    first = await qm_submit(ks, "on-cordoned", GANG_OF_8)
    (pod,) = await running(ks, first)
    cordoned = node_of(pod)
    ks.hook("cordon_node", cordoned)
    try:
        # Until the scheduler has heard (a heartbeat with healthy: false), a job may still
        # be sent there and refused; every placement after that goes elsewhere.
        others = [await qm_submit(ks, f"beside-cordoned-{i}", GANG_OF_8) for i in range(2)]
        placed = [(await running(ks, o))[0] for o in others]
        assert all(node_of(p) != cordoned for p in placed), [node_of(p) for p in placed]
        # The cordon did not stop what ran there.
        assert running_pods(ks, first, 1), ks.pods(first)
        assert (await job(client, first))["state"] == "running"
        succeed(ks, [pod, *placed])
        for job_id in [first, *others]:
            done = await wait_state(client, job_id, {"succeeded", "failed", "canceled"})
            assert done["state"] == "succeeded", done
    finally:
        ks.hook("cordon_node", cordoned, False)


async def test_a_node_that_goes_not_ready_hands_its_gang_back_to_run_elsewhere(
    kube_stack: KubeStack, client: httpx.AsyncClient
) -> None:
    ks = kube_stack
    job_id = await qm_submit(ks, "on-failing-node", GANG_OF_8)
    (pod,) = await running(ks, job_id)
    failing = node_of(pod)
    ks.hook("set_node_ready", failing, False)
    try:
        # Heartbeats stop; the health service quarantines the node; the executor hands the
        # gang back and cordons and taints the node; the job runs again on another node.
        (again,) = await running(
            ks, job_id, after=attempt_of(pod), timeout_s=UNHEALTHY_AFTER_S + 60
        )
        assert node_of(again) != failing
        node = ks.node(failing)
        assert node["spec"].get("unschedulable") is True
        assert "quartermaster.io/quarantined" in {t["key"] for t in node["spec"].get("taints", [])}
        succeed(ks, [again])
        done = await wait_state(client, job_id, {"succeeded", "failed", "canceled"})
        assert done["state"] == "succeeded", done
        assert "JobPreempted" in [h["type"] for h in done["history"]]
    finally:
        ks.hook("set_node_ready", failing, True)
    # Back and healthy: the quarantine taint comes off and the node is schedulable again.
    await until(
        "the node released",
        lambda: not ks.node(failing)["spec"].get("unschedulable"),
        timeout_s=60,
    )


async def test_an_executor_restart_adopts_its_pods_and_reports_what_ended_meanwhile(
    kube_stack: KubeStack, client: httpx.AsyncClient
) -> None:
    ks = kube_stack
    ended = await qm_submit(ks, "ends-while-away", GANG_OF_8)
    stays = await qm_submit(ks, "runs-through", {**GANG_OF_8, "replicas": 2})
    (ended_pod,) = await running(ks, ended)
    stays_pods = await running(ks, stays, replicas=2)
    await wait_state(client, stays, {"running"})
    await wait_state(client, ended, {"running"})

    executor = ks.executor
    assert executor.process is not None
    killed = time.monotonic()
    executor.process.kill()
    executor.process.wait(timeout=30)
    succeed(ks, [ended_pod])  # while no executor watches
    ks.stack.restart(executor)
    away_s = time.monotonic() - killed
    # While it is away its nodes are silent; past the health service's threshold they would
    # be declared lost and the gang handed back, which is another flow than this one.
    assert away_s < UNHEALTHY_AFTER_S, (
        f"the executor took {away_s:.0f} s to restart, more than the {UNHEALTHY_AFTER_S} s "
        "after which silent nodes are lost: this run cannot tell adoption from recovery"
    )

    done = await wait_state(client, ended, {"succeeded", "failed", "canceled"})
    assert done["state"] == "succeeded", done
    # The gang that kept running was adopted, not restarted: the same pods.
    assert running_pods(ks, stays, 2) is not None
    assert [p["metadata"]["uid"] for p in running_pods(ks, stays, 2) or []] == [
        p["metadata"]["uid"] for p in stays_pods
    ]
    succeed(ks, stays_pods)
    done = await wait_state(client, stays, {"succeeded", "failed", "canceled"})
    assert done["state"] == "succeeded", done
    assert [h["type"] for h in done["history"]].count("JobStarted") == 1, done["history"]


def test_the_stack_log_has_no_error_from_the_kubernetes_executor(kube_stack: KubeStack) -> None:
    """Last: nothing the flows did made the executor log an error or a traceback."""
    lines = kube_stack.executor.log.read_text().splitlines()
    bad = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            if "Traceback" in line:
                bad.append(line)
            continue
        if record.get("level") in ("error", "critical"):
            bad.append(line)
    assert not bad, "\n".join(bad[:5])
