"""deploy/k8s: both overlays render, validate against the Kubernetes schemas (and our own checks
of the custom resources), fit the code of the services they run, pass the security lint, and
the generated files are current. And each of those checks can fail: a stale topics file, a
container that may run as root, a misspelt setting, a missing network path are all reported."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "deploy" / "k8s"))

from qmk8s import cli, generate, kustomize, lint, validate, wiring  # noqa: E402
from qmk8s.kustomize import obj_id  # noqa: E402

Obj = dict[str, Any]
OVERLAYS = ("dev", "prod")


@pytest.fixture(scope="module")
def reports() -> dict[str, cli.Report]:
    return {overlay: cli.check_overlay(overlay) for overlay in OVERLAYS}


@pytest.fixture
def dev(reports: dict[str, cli.Report]) -> list[Obj]:
    return copy.deepcopy(reports["dev"].objects)


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    return next(o for o in objects if obj_id(o)[0] == kind and obj_id(o)[2] == name)


def of(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o.get("kind") == kind]


# --- the committed manifests pass -----------------------------------------------------------


def test_every_overlay_is_checked() -> None:
    assert cli.overlays() == sorted(OVERLAYS)


def test_generated_files_are_current() -> None:
    assert generate.stale() == [], "run: .venv/bin/python deploy/k8s/render.py generate"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_and_fits_the_services(
    reports: dict[str, cli.Report], overlay: str
) -> None:
    report = reports[overlay]
    assert [str(p) for p in report.problems] == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_passes_the_security_lint(reports: dict[str, cli.Report], overlay: str) -> None:
    report = reports[overlay]
    assert [str(f) for f in report.failing] == []
    # Every exception is a justified one, with its reason, and the list stays short.
    justified = {f.rule for f in report.findings}
    assert justified <= {
        "service-account-token",
        "egress-any-address",
        "kafka-durability",
        "secret-placeholder",
    }


def test_check_command_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "dev"]) == 0
    assert "overlay dev" in capsys.readouterr().out


def test_every_service_runs_with_its_stores_and_the_fleet_has_its_executors(
    reports: dict[str, cli.Report],
) -> None:
    for overlay in OVERLAYS:
        index = wiring._Index(reports[overlay].objects)
        running = {c.service for c in wiring.service_containers(index)}
        assert running == set(wiring.service_packages()) == set(wiring.SERVICES)
        executors = {
            c.env["QM_EXECUTOR_CLUSTER"]
            for c in wiring.service_containers(index)
            if c.service == "executor"
        }
        fleet = yaml.safe_load((ROOT / "examples" / "fleet.yaml").read_text())
        assert executors == {c["name"] for c in fleet["clusters"]}


def test_topics_follow_the_registry(reports: dict[str, cli.Report]) -> None:
    from schemas.topics import TOPICS

    for overlay in OVERLAYS:
        topics = {obj_id(t)[2]: t["spec"] for t in of(reports[overlay].objects, "KafkaTopic")}
        assert {name: spec["partitions"] for name, spec in topics.items()} == {
            t.name: t.partitions for t in TOPICS
        }
    prod = {obj_id(t)[2]: t["spec"] for t in of(reports["prod"].objects, "KafkaTopic")}
    assert {(s["replicas"], s["config"]["min.insync.replicas"]) for s in prod.values()} == {(3, 2)}
    # Retention is the registry's (the scheduler starts from its snapshot, not the beginning).
    assert {name: spec["config"]["retention.ms"] for name, spec in prod.items()} == {
        t.name: t.retention_ms for t in TOPICS
    }


def test_dev_is_one_of_everything_and_prod_is_redundant(reports: dict[str, cli.Report]) -> None:
    dev, prod = reports["dev"].objects, reports["prod"].objects
    assert {d["spec"]["replicas"] for d in of(dev, "Deployment")} == {1}
    assert of(dev, "HorizontalPodAutoscaler") == []
    assert find(dev, "KafkaNodePool", "dual-role")["spec"]["replicas"] == 1
    assert {t["spec"]["replicas"] for t in of(dev, "KafkaTopic")} == {1}
    assert find(dev, "Cluster", "quartermaster-pg")["spec"]["instances"] == 1
    assert find(prod, "Deployment", "scheduler")["spec"]["replicas"] == 2
    assert {h["metadata"]["name"] for h in of(prod, "HorizontalPodAutoscaler")} == {
        "gateway",
        "queue",
    }
    assert find(prod, "KafkaNodePool", "dual-role")["spec"]["replicas"] == 3
    assert find(prod, "Cluster", "quartermaster-pg")["spec"]["instances"] == 3


def test_only_the_executor_may_touch_the_kubernetes_api(reports: dict[str, cli.Report]) -> None:
    objects = reports["prod"].objects
    subjects = {
        (s["namespace"], s["name"])
        for b in objects
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
        for s in b["subjects"]
    }
    assert subjects == {("quartermaster", "executor")}
    mounting = {
        obj_id(d)[2]
        for d in of(objects, "Deployment")
        if d["spec"]["template"]["spec"].get("automountServiceAccountToken")
    }
    assert mounting == {"executor-onprem-h100", "executor-cloud-a100", "executor-tpu-slices"}


def test_prod_refuses_to_render_without_its_real_secrets() -> None:
    if (generate.K8S / "overlays" / "prod" / "secrets" / "auth.yaml").exists():
        pytest.skip("this checkout has real prod secrets")
    with pytest.raises(kustomize.KustomizeError, match=r"auth\.yaml is missing"):
        cli.render("prod")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_renderer_agrees_with_kubectl_kustomize(reports: dict[str, cli.Report]) -> None:
    run = subprocess.run(
        ["kubectl", "kustomize", str(generate.K8S / "overlays" / "dev")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if run.returncode != 0 and "unknown command" in run.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert run.returncode == 0, run.stderr
    theirs = {obj_id(o): o for o in yaml.safe_load_all(run.stdout) if o}
    ours = {obj_id(o): o for o in reports["dev"].objects}
    assert sorted(ours) == sorted(theirs)
    assert ours == theirs


# --- and the checks fail when they should ---------------------------------------------------


def test_a_stale_topics_file_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from schemas import topics

    extra = topics.Topic("job.teleported", "job_id", 4, "JobTeleported", None, "A new event.")
    monkeypatch.setattr(topics, "TOPICS", (*topics.TOPICS, extra))
    assert generate.stale() == [generate.TOPICS_FILE]
    assert cli.cmd_generate(check=True) == 1
    assert "job.teleported" in generate.topics_yaml()


def test_a_topic_missing_from_the_manifests_is_reported(dev: list[Obj]) -> None:
    dev.remove(find(dev, "KafkaTopic", "job.submitted"))
    problems = [str(p) for p in wiring.check(dev)]
    assert "topic job.submitted: is in the registry but has no KafkaTopic" in problems


def test_a_container_without_run_as_non_root_is_reported(dev: list[Obj]) -> None:
    pod = find(dev, "Deployment", "queue")["spec"]["template"]["spec"]
    del pod["securityContext"]["runAsNonRoot"]
    del pod["containers"][0]["securityContext"]["runAsNonRoot"]
    failing = [f for f in lint.lint(dev) if f.failing]
    assert [(f.rule, f.where) for f in failing] == [
        ("run-as-non-root", "Deployment quartermaster/queue container queue")
    ]
    assert not cli.check_objects("dev", dev, validate.KUBERNETES_VERSION).ok


@pytest.mark.parametrize(
    ("rule", "mutate"),
    [
        ("read-only-root-fs", lambda c, p: c["securityContext"].pop("readOnlyRootFilesystem")),
        (
            "no-privilege-escalation",
            lambda c, p: c["securityContext"].pop("allowPrivilegeEscalation"),
        ),
        (
            "drop-all-capabilities",
            lambda c, p: c["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
        ),
        ("resource-limits", lambda c, p: c["resources"].pop("limits")),
        ("probes", lambda c, p: c.pop("livenessProbe")),
        ("host-namespaces", lambda c, p: p.update(hostNetwork=True)),
        ("host-path", lambda c, p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}})),
        ("service-account-token", lambda c, p: p.update(automountServiceAccountToken=True)),
        ("image-pinned", lambda c, p: c.update(image="quartermaster:latest")),
        ("writable-tmp", lambda c, p: c["volumeMounts"].pop(0)),
    ],
)
def test_each_pod_rule_can_fail(dev: list[Obj], rule: str, mutate: Any) -> None:
    pod = find(dev, "Deployment", "queue")["spec"]["template"]["spec"]
    mutate(pod["containers"][0], pod)
    assert rule in {f.rule for f in lint.lint(dev) if f.failing}


def test_rbac_beyond_the_executor_is_reported(dev: list[Obj]) -> None:
    dev.append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "gateway-nodes"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "quartermaster-executor-nodes",
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": "gateway", "namespace": "quartermaster"}
            ],
        }
    )
    find(dev, "ClusterRole", "quartermaster-executor-nodes")["rules"].append(
        {"apiGroups": ["*"], "resources": ["secrets"], "verbs": ["get"]}
    )
    failing = {f.rule for f in lint.lint(dev) if f.failing}
    assert {
        "rbac-workload-access",
        "rbac-wildcard",
        "rbac-sensitive",
        "rbac-executor-scope",
    } <= failing


def test_a_justification_keeps_a_finding_visible_without_failing(dev: list[Obj]) -> None:
    deployment = find(dev, "Deployment", "queue")
    deployment["spec"]["template"]["spec"]["hostNetwork"] = True
    notes = deployment["metadata"].setdefault("annotations", {})
    notes["lint.quartermaster.io/host-namespaces"] = "too short"
    assert "host-namespaces" in {f.rule for f in lint.lint(dev) if f.failing}
    notes["lint.quartermaster.io/host-namespaces"] = "a measured need, reviewed on 1 Jan"
    [finding] = [f for f in lint.lint(dev) if f.rule == "host-namespaces"]
    assert not finding.failing
    assert "reviewed" in str(finding)


def test_a_misspelt_setting_and_a_wrong_port_are_reported(dev: list[Obj]) -> None:
    container = find(dev, "Deployment", "meter")["spec"]["template"]["spec"]["containers"][0]
    next(e for e in container["env"] if e["name"] == "QM_BUDGETS_FILE")["name"] = "QM_BUDGET_FILE"
    container["ports"][0]["containerPort"] = 9090
    problems = "\n".join(str(p) for p in wiring.check(dev))
    assert "QM_BUDGET_FILE is not a setting of services.meter" in problems
    assert "QM_BUDGETS_FILE is not set" in problems
    assert "QM_HTTP_PORT 8080 is not its `http` port 9090" in problems


def test_the_network_policies_are_evaluated(dev: list[Obj]) -> None:
    dev.remove(find(dev, "NetworkPolicy", "postgres-clients"))
    allow_all = find(dev, "NetworkPolicy", "redis")
    allow_all["spec"]["ingress"][0].pop("from")
    problems = "\n".join(str(p) for p in wiring.check(dev))
    assert "Deployment quartermaster/queue: cannot reach postgres" in problems
    assert "redis is reachable from other namespaces on 6379" in problems


def test_custom_resources_get_structural_checks(dev: list[Obj]) -> None:
    topic = find(dev, "KafkaTopic", "job.queued")
    topic["spec"]["partition"] = topic["spec"].pop("partitions")
    kafka = find(dev, "Kafka", "quartermaster")
    kafka["spec"]["kafka"]["config"]["default.replication.factor"] = 3
    problems = "\n".join(str(p) for p in validate.validate(dev))
    assert "'partitions' is a required property" in problems
    assert "default.replication.factor 3 > 1 brokers" in problems


def test_kubernetes_schemas_reject_an_unknown_field(dev: list[Obj]) -> None:
    container = find(dev, "Deployment", "queue")["spec"]["template"]["spec"]["containers"][0]
    container["securityContext"]["runAsNonRot"] = True
    problems = [str(p) for p in validate.validate(dev)]
    assert any("'runAsNonRot' was unexpected" in p for p in problems)


# --- the renderer itself --------------------------------------------------------------------


def test_content_hash_is_kustomizes() -> None:
    # Vectors from kustomize's own hasher tests.
    assert kustomize.content_hash({"kind": "ConfigMap", "metadata": {}}) == "6ct58987ht"
    assert kustomize.content_hash({"kind": "ConfigMap", "data": {"one": ""}}) == "9g67k2htb6"
    secret = {"kind": "Secret", "type": "my-type", "data": {"one": ""}}
    assert kustomize.content_hash(secret) == "74bd68bm66"


def test_strategic_merge_merges_lists_by_key_and_json_patch_applies() -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]},
    }
    patch = {"spec": {"containers": [{"name": "b", "image": "z"}, {"name": "c", "image": "w"}]}}
    merged = kustomize.strategic_merge(deployment, patch, strategic=True)
    assert [c["image"] for c in merged["spec"]["containers"]] == ["x", "z", "w"]
    replaced = kustomize.strategic_merge(deployment, patch, strategic=False)
    assert [c["name"] for c in replaced["spec"]["containers"]] == ["b", "c"]
    ops = [
        {"op": "add", "path": "/metadata", "value": {"annotations": {}}},
        {"op": "add", "path": "/metadata/annotations/a~1b", "value": "1"},
        {"op": "remove", "path": "/spec/containers/0"},
    ]
    patched = kustomize.json6902(deployment, ops, "test")
    assert patched["metadata"]["annotations"] == {"a/b": "1"}
    assert [c["name"] for c in patched["spec"]["containers"]] == ["b"]


def test_unsupported_kustomize_features_are_refused(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("namePrefix: x-\nresources: []\n")
    with pytest.raises(kustomize.KustomizeError, match="namePrefix not supported"):
        kustomize.build(tmp_path)
