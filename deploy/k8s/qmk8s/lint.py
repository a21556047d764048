"""The security (and durability) lint of rendered manifests.

Each rule has a name; a finding fails the check unless the object carries a justification: an
annotation `lint.quartermaster.io/<rule>: <reason>` on the object (for pod and container rules
also accepted on the pod template). The reason is printed with the finding, so a justified
exception stays visible in every run.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from qmk8s.kustomize import FROM_EXAMPLE, describe, obj_id, pod_templates
from qmk8s.validate import selector_matches
from qmk8s.yamlio import Obj

PREFIX = "lint.quartermaster.io/"
MIN_REASON = 12  # characters: a reason, not a shrug

RULES = {
    "run-as-non-root": "containers run as a non-root user (runAsNonRoot, runAsUser not 0)",
    "read-only-root-fs": "containers have a read-only root filesystem",
    "writable-tmp": "a read-only container gets /tmp from an emptyDir",
    "no-privilege-escalation": "allowPrivilegeEscalation is false",
    "drop-all-capabilities": "capabilities drop ALL and add none",
    "seccomp-runtime-default": "seccompProfile RuntimeDefault (or Localhost)",
    "no-privileged": "no privileged container",
    "resource-limits": "CPU and memory requests and limits on every container",
    "probes": "readiness and liveness probes on every long-running container",
    "host-namespaces": "no hostNetwork, hostPID or hostIPC",
    "host-path": "no hostPath volume",
    "service-account-token": "automountServiceAccountToken is false",
    "dedicated-service-account": "pods run under their own service account, not `default`",
    "image-pinned": "images carry a tag other than latest, or a digest",
    "rbac-wildcard": "no `*` in RBAC apiGroups, resources or verbs",
    "rbac-sensitive": "no RBAC on secrets, exec, attach, port-forward, escalate, bind, impersonate",
    "rbac-workload-access": "only the executor may touch pods, services, events and nodes",
    "rbac-executor-scope": "the executor gets exactly the verbs its kubernetes backend needs",
    "network-default-deny": "every namespace with pods denies ingress by default, and every "
    "Quartermaster pod is under an egress policy",
    "egress-any-address": "no egress to any address (0.0.0.0/0, ::/0)",
    "disruption-budget": "every Deployment and StatefulSet has a PodDisruptionBudget",
    "kafka-durability": "topics and the broker keep 3 replicas with min.insync.replicas 2",
    "secret-placeholder": "no Secret renders from an example or holds a REPLACE-ME value",
}

# The executor's kubernetes backend (rbac-executor.yaml): resource -> verbs.
EXECUTOR = ("quartermaster", "executor")
EXECUTOR_SCOPE = {
    "pods": {"create", "get", "list", "watch", "patch", "delete"},
    "services": {"create", "get", "list", "delete"},
    "poddisruptionbudgets": {"create", "get", "delete"},
    "podtemplates": {"create", "list", "delete"},
    "provisioningrequests": {"create", "list", "delete"},
    "nodes": {"get", "list", "watch", "patch"},
    "events": {"create"},
}
WORKLOAD_RESOURCES = {
    "pods",
    "services",
    "events",
    "nodes",
    "deployments",
    "statefulsets",
    "daemonsets",
    "replicasets",
    "jobs",
    "cronjobs",
    "persistentvolumeclaims",
    "poddisruptionbudgets",
    "podtemplates",
    "provisioningrequests",
}
SENSITIVE_RESOURCES = {
    "secrets",
    "pods/exec",
    "pods/attach",
    "pods/portforward",
    "serviceaccounts/token",
}
SENSITIVE_VERBS = {"escalate", "bind", "impersonate"}


@dataclass(frozen=True)
class Finding:
    rule: str
    where: str
    message: str
    justification: str | None = None

    @property
    def failing(self) -> bool:
        return self.justification is None

    def __str__(self) -> str:
        head = f"[{self.rule}] {self.where}: {self.message}"
        return head if self.failing else f"{head} (justified: {self.justification})"


def _annotations(*holders: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for holder in holders:
        out.update(((holder or {}).get("metadata") or {}).get("annotations") or {})
    return out


class _Collector:
    def __init__(self) -> None:
        self.findings: list[Finding] = []

    def add(self, rule: str, where: str, message: str, *holders: Any) -> None:
        assert rule in RULES, rule
        reason = _annotations(*holders).get(PREFIX + rule)
        if reason is not None and len(" ".join(str(reason).split())) < MIN_REASON:
            self.findings.append(
                Finding(rule, where, f"{message}; its justification is too short: {reason!r}")
            )
            return
        text = " ".join(str(reason).split()) if reason is not None else None
        self.findings.append(Finding(rule, where, message, text))


def lint(objects: list[Obj]) -> list[Finding]:
    c = _Collector()
    for obj in objects:
        _pods(c, obj, objects)
    _rbac(c, objects)
    _network(c, objects)
    _budgets(c, objects)
    _kafka(c, objects)
    _secrets(c, objects)
    return c.findings


# --- pods ---------------------------------------------------------------------------------


def _pods(c: _Collector, obj: Obj, objects: list[Obj]) -> None:
    for template in pod_templates(obj):
        spec = template.get("spec") or {}
        where = describe(obj_id(obj))
        pod_sc = spec.get("securityContext") or {}
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(flag):
                c.add("host-namespaces", where, f"{flag} is true", obj, template)
        for volume in spec.get("volumes") or []:
            if "hostPath" in volume:
                c.add(
                    "host-path", where, f"volume {volume.get('name')} is a hostPath", obj, template
                )
        account = spec.get("serviceAccountName") or "default"
        if account == "default":
            c.add("dedicated-service-account", where, "runs as the default service account", obj)
        automount = spec.get("automountServiceAccountToken")
        if automount is None:
            sa = next(
                (o for o in objects if obj_id(o) == ("ServiceAccount", obj_id(obj)[1], account)),
                None,
            )
            automount = (sa or {}).get("automountServiceAccountToken", True)
        if automount:
            c.add("service-account-token", where, "mounts a service-account token", obj, template)
        tmp_volumes = {v.get("name") for v in spec.get("volumes") or [] if "emptyDir" in v}
        long_running = obj.get("kind") in ("Deployment", "StatefulSet", "DaemonSet")
        for key in ("initContainers", "containers"):
            for container in spec.get(key) or []:
                cw = f"{where} container {container.get('name')}"
                _container(c, cw, container, pod_sc, tmp_volumes, obj, template)
                if key == "containers" and long_running:
                    missing = [p for p in ("readinessProbe", "livenessProbe") if p not in container]
                    if missing:
                        c.add("probes", cw, f"no {' or '.join(missing)}", obj, template)


def _container(
    c: _Collector,
    where: str,
    container: Obj,
    pod_sc: Obj,
    tmp_volumes: set[Any],
    *holders: Any,
) -> None:
    sc = container.get("securityContext") or {}

    def effective(key: str) -> Any:
        return sc[key] if key in sc else pod_sc.get(key)

    if effective("runAsNonRoot") is not True or effective("runAsUser") == 0:
        c.add("run-as-non-root", where, "may run as root (runAsNonRoot is not true)", *holders)
    if sc.get("readOnlyRootFilesystem") is not True:
        c.add("read-only-root-fs", where, "root filesystem is writable", *holders)
    else:
        mounts = {m.get("mountPath"): m.get("name") for m in container.get("volumeMounts") or []}
        if mounts.get("/tmp") not in tmp_volumes:
            c.add(
                "writable-tmp",
                where,
                "read-only root filesystem without an emptyDir /tmp",
                *holders,
            )
    if sc.get("allowPrivilegeEscalation") is not False:
        c.add("no-privilege-escalation", where, "allowPrivilegeEscalation is not false", *holders)
    caps = sc.get("capabilities") or {}
    if "ALL" not in (caps.get("drop") or []) or caps.get("add"):
        c.add("drop-all-capabilities", where, f"capabilities {caps or 'not dropped'}", *holders)
    seccomp = (effective("seccompProfile") or {}).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        c.add("seccomp-runtime-default", where, f"seccompProfile is {seccomp}", *holders)
    if sc.get("privileged"):
        c.add("no-privileged", where, "privileged", *holders)
    resources = container.get("resources") or {}
    missing = [
        f"{kind}.{res}"
        for kind in ("requests", "limits")
        for res in ("cpu", "memory")
        if res not in (resources.get(kind) or {})
    ]
    if missing:
        c.add("resource-limits", where, f"no {', '.join(missing)}", *holders)
    image = str(container.get("image", ""))
    name_part = image.split("@")[0]
    tag = name_part.rsplit(":", 1)[1] if ":" in name_part.rsplit("/", 1)[-1] else None
    if "@" not in image and (tag is None or tag == "latest"):
        c.add("image-pinned", where, f"image {image!r} has no tag or digest", *holders)


# --- RBAC ---------------------------------------------------------------------------------


def _rbac(c: _Collector, objects: list[Obj]) -> None:
    roles = {obj_id(o): o for o in objects if o.get("kind") in ("Role", "ClusterRole")}
    granted: dict[tuple[str, str], dict[str, set[str]]] = {}
    for role in roles.values():
        where = describe(obj_id(role))
        for rule in role.get("rules") or []:
            for key in ("apiGroups", "resources", "verbs"):
                if "*" in (rule.get(key) or []):
                    c.add("rbac-wildcard", where, f"{key} contains *", role)
            bad = set(rule.get("resources") or []) & SENSITIVE_RESOURCES
            bad |= set(rule.get("verbs") or []) & SENSITIVE_VERBS
            if bad:
                c.add("rbac-sensitive", where, f"grants {sorted(bad)}", role)
    for binding in objects:
        if binding.get("kind") not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        ref = binding.get("roleRef") or {}
        ns = obj_id(binding)[1] if ref.get("kind") == "Role" else ""
        bound = roles.get((str(ref.get("kind")), ns, str(ref.get("name"))))
        if bound is None:
            continue
        resources: dict[str, set[str]] = {}
        for rule in bound.get("rules") or []:
            for res in rule.get("resources") or []:
                resources.setdefault(res, set()).update(rule.get("verbs") or [])
        touching = {r for r in resources if r.split("/")[0] in WORKLOAD_RESOURCES}
        for subject in binding.get("subjects") or []:
            who = (str(subject.get("namespace") or ""), str(subject.get("name")))
            if subject.get("kind") != "ServiceAccount" or who != EXECUTOR:
                if touching:
                    c.add(
                        "rbac-workload-access",
                        describe(obj_id(binding)),
                        f"gives {subject.get('kind')} {'/'.join(who)} {sorted(touching)}",
                        binding,
                    )
                continue
            for res, verbs in resources.items():
                granted.setdefault(EXECUTOR, {}).setdefault(res, set()).update(verbs)
    for res, verbs in granted.get(EXECUTOR, {}).items():
        extra = verbs - EXECUTOR_SCOPE.get(res, set())
        if extra:
            c.add(
                "rbac-executor-scope",
                "ServiceAccount quartermaster/executor",
                f"{res}: {sorted(extra)} beyond what the backend needs",
            )


# --- network ------------------------------------------------------------------------------


def _workload_pods(objects: list[Obj]) -> Iterator[tuple[Obj, str, dict[str, str]]]:
    for obj in objects:
        for template in pod_templates(obj):
            labels = (template.get("metadata") or {}).get("labels") or {}
            yield obj, obj_id(obj)[1], labels


def _network(c: _Collector, objects: list[Obj]) -> None:
    policies = [o for o in objects if o.get("kind") == "NetworkPolicy"]
    namespaces = {ns for _, ns, _ in _workload_pods(objects)}
    for ns in sorted(namespaces):
        denies = [
            p
            for p in policies
            if obj_id(p)[1] == ns
            and not (p["spec"].get("podSelector") or {})
            and "Ingress" in (p["spec"].get("policyTypes") or [])
            and not p["spec"].get("ingress")
        ]
        if not denies:
            c.add("network-default-deny", f"Namespace {ns}", "no default-deny ingress policy")
    for obj, ns, labels in _workload_pods(objects):
        egress = [
            p
            for p in policies
            if obj_id(p)[1] == ns
            and "Egress" in (p["spec"].get("policyTypes") or [])
            and selector_matches(p["spec"].get("podSelector"), labels)
        ]
        if not egress:
            c.add("network-default-deny", describe(obj_id(obj)), "no egress policy selects it", obj)
    for policy in policies:
        for rule in policy["spec"].get("egress") or []:
            for peer in rule.get("to") or []:
                block = peer.get("ipBlock") or {}
                if block.get("cidr") in ("0.0.0.0/0", "::/0") and not block.get("except"):
                    c.add(
                        "egress-any-address",
                        describe(obj_id(policy)),
                        f"egress to {block['cidr']}",
                        policy,
                    )


def _budgets(c: _Collector, objects: list[Obj]) -> None:
    budgets = [o for o in objects if o.get("kind") == "PodDisruptionBudget"]
    for obj in objects:
        if obj.get("kind") not in ("Deployment", "StatefulSet"):
            continue
        labels = ((obj["spec"].get("template") or {}).get("metadata") or {}).get("labels") or {}
        if not any(
            obj_id(b)[1] == obj_id(obj)[1] and selector_matches(b["spec"].get("selector"), labels)
            for b in budgets
        ):
            c.add("disruption-budget", describe(obj_id(obj)), "no PodDisruptionBudget", obj)


def _kafka(c: _Collector, objects: list[Obj]) -> None:
    for obj in objects:
        where = describe(obj_id(obj))
        if obj.get("kind") == "KafkaTopic":
            spec = obj.get("spec") or {}
            isr = int((spec.get("config") or {}).get("min.insync.replicas", 1))
            if int(spec.get("replicas", 1)) < 3 or isr < 2:
                c.add(
                    "kafka-durability",
                    where,
                    f"replicas {spec.get('replicas')}, min.insync.replicas {isr}",
                    obj,
                )
        elif obj.get("kind") == "Kafka":
            config = ((obj.get("spec") or {}).get("kafka") or {}).get("config") or {}
            rf = int(config.get("default.replication.factor", 1))
            isr = int(config.get("min.insync.replicas", 1))
            if rf < 3 or isr < 2:
                c.add(
                    "kafka-durability",
                    where,
                    f"default.replication.factor {rf}, min.insync.replicas {isr}",
                    obj,
                )


def _secrets(c: _Collector, objects: list[Obj]) -> None:
    for obj in objects:
        if obj.get("kind") != "Secret":
            continue
        where = describe(obj_id(obj))
        if _annotations(obj).get(FROM_EXAMPLE) == "true":
            # Only `render.py check` renders from examples, and says so; never for applying.
            c.findings.append(
                Finding(
                    "secret-placeholder",
                    where,
                    "rendered from the .example file",
                    "render.py check only: `render.py render` refuses without the real file",
                )
            )
            continue
        for key, value in (obj.get("data") or {}).items():
            text = base64.b64decode(str(value)).decode(errors="replace")
            if "REPLACE-ME" in text:
                c.add("secret-placeholder", where, f"{key} still holds a REPLACE-ME value", obj)
        for key, value in (obj.get("stringData") or {}).items():
            if "REPLACE-ME" in str(value):
                c.add("secret-placeholder", where, f"{key} still holds a REPLACE-ME value", obj)
