"""Checks that the rendered manifests fit together and fit the code they run.

- References: every ConfigMap, Secret (and key), ServiceAccount, role, HPA target and named port
  that an object points at exists; every Service, PodDisruptionBudget and ServiceMonitor
  selects something.
- The services: each Deployment running `python -m services.<name>` sets only QM_* variables
  that are settings of that service (services/<name>/settings.py), listens where its probes
  and Service look, gets the stores it needs and no others, and finds every file it reads
  (policy, fleet, health rules, budgets, tokens) in a mounted ConfigMap or Secret. Every
  service package has a Deployment; every cluster of the fleet has exactly one executor.
- The network: the NetworkPolicies (plus the ingress policy Strimzi derives from the Kafka
  listener's `networkPolicyPeers`) are evaluated for each service: it reaches what it needs
  and nothing else; only the gateway is reachable from outside; Prometheus reaches every
  service's metrics.
- Kafka topics: exactly the registry's topics (schemas/topics.py), with its partition counts.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml

from qmk8s.generate import ROOT
from qmk8s.kustomize import containers, describe, obj_id, pod_templates
from qmk8s.validate import Problem, selector_matches
from qmk8s.yamlio import Obj


@dataclass(frozen=True)
class Needs:
    stores: frozenset[str]
    files: frozenset[str]  # the Path settings the service reads


def _needs(stores: str, files: str) -> Needs:
    return Needs(frozenset(stores.split()), frozenset(files.split()))


# What each service uses, as its services/<name>/app.py does (read it when this changes).
SERVICES: dict[str, Needs] = {
    "gateway": _needs("kafka postgres redis", "policy_file auth_file"),
    "queue": _needs("kafka postgres", "policy_file"),
    "scheduler": _needs("kafka redis", "policy_file"),
    "preemptor": _needs("kafka postgres", "policy_file"),
    "meter": _needs("kafka postgres redis", "policy_file fleet_file budgets_file"),
    "health": _needs("kafka postgres redis", "health_file"),
    "autoscaler": _needs("kafka postgres redis", "policy_file fleet_file"),
    "serving": _needs("kafka postgres redis", ""),
    "executor": _needs("kafka postgres", "policy_file fleet_file"),
}
STORE_SETTING = {"postgres": "QM_DATABASE_URL", "redis": "QM_REDIS_URL"}
# Secrets the operators create (CloudNativePG `<cluster>-app`) and the keys they hold.
CNPG_APP_KEYS = {
    "username",
    "password",
    "host",
    "port",
    "dbname",
    "uri",
    "jdbc-uri",
    "pgpass",
    "fqdn-uri",
    "fqdn-jdbc-uri",
}
SECRET = "<secret>"


def service_packages() -> list[str]:
    return sorted(
        p.name
        for p in (ROOT / "services").iterdir()
        if (p / "__main__.py").is_file() and (p / "settings.py").is_file()
    )


def settings_fields(service: str) -> dict[str, Any]:
    """Field name -> annotation of the settings class in services/<service>/settings.py."""
    from services.common.settings import ServiceSettings

    module = importlib.import_module(f"services.{service}.settings")
    classes: list[type[ServiceSettings]] = [
        v
        for v in vars(module).values()
        if isinstance(v, type) and issubclass(v, ServiceSettings) and v is not ServiceSettings
    ]
    if len(classes) != 1:
        raise RuntimeError(f"services.{service}.settings: expected one settings class")
    return {name: f.annotation for name, f in classes[0].model_fields.items()}


class _Index:
    def __init__(self, objects: list[Obj]) -> None:
        self.objects = objects
        self.by_id = {obj_id(o): o for o in objects}
        self.problems: list[Problem] = []

    def get(self, kind: str, ns: str, name: str) -> Obj | None:
        return self.by_id.get((kind, ns, name))

    def of(self, kind: str) -> Iterator[Obj]:
        return (o for o in self.objects if o.get("kind") == kind)

    def add(self, where: str, message: str) -> None:
        self.problems.append(Problem(where, message))

    def cnpg_secret(self, ns: str, name: str) -> bool:
        return any(
            obj_id(c)[1] == ns and name in (f"{obj_id(c)[2]}-app", f"{obj_id(c)[2]}-superuser")
            for c in self.of("Cluster")
        )

    def data_keys(self, kind: str, ns: str, name: str) -> set[str] | None:
        obj = self.get(kind, ns, name)
        if obj is not None:
            return set(obj.get("data") or {}) | set(obj.get("stringData") or {})
        if kind == "Secret" and self.cnpg_secret(ns, name):
            return CNPG_APP_KEYS
        return None


def check(objects: list[Obj]) -> list[Problem]:
    index = _Index(objects)
    _references(index)
    _services(index)
    _network(index)
    _topics(index)
    return index.problems


# --- references ---------------------------------------------------------------------------


def _template_labels(obj: Obj) -> Iterator[dict[str, str]]:
    for template in pod_templates(obj):
        yield (template.get("metadata") or {}).get("labels") or {}


def _references(ix: _Index) -> None:
    workloads = [o for o in ix.objects if any(True for _ in pod_templates(o))]
    for obj in workloads:
        where, ns = describe(obj_id(obj)), obj_id(obj)[1]
        spec = obj["spec"]
        selector = spec.get("selector")
        for labels in _template_labels(obj):
            if selector is not None and not selector_matches(selector, labels):
                ix.add(where, "its selector does not match its pod template")
        for template in pod_templates(obj):
            pod = template.get("spec") or {}
            account = pod.get("serviceAccountName")
            if account and ix.get("ServiceAccount", ns, account) is None:
                ix.add(where, f"service account {account} does not exist")
            volumes = {v.get("name"): v for v in pod.get("volumes") or []}
            for volume in volumes.values():
                for kind, ref, key in (
                    ("ConfigMap", "configMap", "name"),
                    ("Secret", "secret", "secretName"),
                ):
                    if ref in volume:
                        _exists(ix, where, kind, ns, volume[ref][key], volume[ref].get("items"))
            for container in containers(pod):
                cw = f"{where} container {container.get('name')}"
                ports = {
                    p.get("name"): p.get("containerPort") for p in container.get("ports") or []
                }
                for mount in container.get("volumeMounts") or []:
                    if mount.get("name") not in volumes:
                        ix.add(cw, f"mounts volume {mount.get('name')} that the pod lacks")
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    action = (container.get(probe) or {}).get("httpGet") or (
                        container.get(probe) or {}
                    ).get("tcpSocket")
                    port = (action or {}).get("port")
                    if isinstance(port, str) and port not in ports:
                        ix.add(cw, f"{probe} uses port {port}, which it does not declare")
                for source in container.get("envFrom") or []:
                    for kind, ref in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                        if ref in source:
                            _exists(ix, cw, kind, ns, source[ref]["name"])
                for env in container.get("env") or []:
                    value_from = env.get("valueFrom") or {}
                    for kind, ref in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                        if ref in value_from:
                            r = value_from[ref]
                            _exists(ix, cw, kind, ns, r["name"], [{"key": r["key"]}])
    for service in ix.of("Service"):
        ns, selector = obj_id(service)[1], service["spec"].get("selector")
        if not selector:
            continue
        matched = [
            o
            for o in workloads
            if obj_id(o)[1] == ns
            and any(selector_matches({"matchLabels": selector}, lbl) for lbl in _template_labels(o))
        ]
        if not matched:
            ix.add(describe(obj_id(service)), "its selector matches no pod")
        for port in service["spec"].get("ports") or []:
            target = port.get("targetPort")
            if not isinstance(target, str):
                continue
            for obj in matched:
                names = {
                    p.get("name")
                    for t in pod_templates(obj)
                    for c in containers(t.get("spec") or {})
                    for p in c.get("ports") or []
                }
                if target not in names:
                    ix.add(
                        describe(obj_id(service)), f"{describe(obj_id(obj))} has no port {target}"
                    )
    for budget in ix.of("PodDisruptionBudget"):
        ns = obj_id(budget)[1]
        if not any(
            obj_id(o)[1] == ns and selector_matches(budget["spec"].get("selector"), lbl)
            for o in workloads
            for lbl in _template_labels(o)
        ):
            ix.add(describe(obj_id(budget)), "selects no pod")
    for hpa in ix.of("HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        target = ix.get(ref["kind"], obj_id(hpa)[1], ref["name"])
        if target is None:
            ix.add(describe(obj_id(hpa)), f"scales {ref['kind']} {ref['name']}, which is missing")
        elif "replicas" in target["spec"]:
            ix.add(
                describe(obj_id(target)),
                "sets replicas although an autoscaler owns them (each apply would reset them)",
            )
    for binding in (
        o for o in ix.objects if o.get("kind") in ("RoleBinding", "ClusterRoleBinding")
    ):
        ref = binding["roleRef"]
        ns = obj_id(binding)[1] if ref["kind"] == "Role" else ""
        if ix.get(ref["kind"], ns, ref["name"]) is None:
            ix.add(describe(obj_id(binding)), f"{ref['kind']} {ref['name']} does not exist")
        for subject in binding.get("subjects") or []:
            if (
                subject.get("kind") == "ServiceAccount"
                and ix.get(
                    "ServiceAccount", str(subject.get("namespace")), str(subject.get("name"))
                )
                is None
            ):
                ix.add(describe(obj_id(binding)), f"service account {subject} does not exist")


def _exists(
    ix: _Index, where: str, kind: str, ns: str, name: str, items: list[Obj] | None = None
) -> None:
    keys = ix.data_keys(kind, ns, name)
    if keys is None:
        ix.add(where, f"{kind} {name} does not exist")
        return
    for item in items or []:
        if item["key"] not in keys:
            ix.add(where, f"{kind} {name} has no key {item['key']}")


# --- the services -------------------------------------------------------------------------


@dataclass
class Container:
    """A Quartermaster service's container, its environment resolved."""

    workload: Obj
    service: str
    spec: Obj
    pod: Obj
    env: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return describe(obj_id(self.workload))


def service_containers(ix: _Index) -> Iterator[Container]:
    for obj in ix.objects:
        for template in pod_templates(obj):
            pod = template.get("spec") or {}
            for spec in pod.get("containers") or []:
                command = [*(spec.get("command") or []), *(spec.get("args") or [])]
                if command[:2] == ["python", "-m"] and len(command) > 2:
                    match = re.fullmatch(r"services\.(\w+)", command[2])
                    if match:
                        yield Container(obj, match.group(1), spec, pod, _env(ix, obj, spec))


def _env(ix: _Index, obj: Obj, container: Obj) -> dict[str, str]:
    ns = obj_id(obj)[1]
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        ref = source.get("configMapRef")
        if ref and (cm := ix.get("ConfigMap", ns, ref["name"])) is not None:
            env.update({k: str(v) for k, v in (cm.get("data") or {}).items()})
        elif source.get("secretRef"):
            env.update(
                {k: SECRET for k in ix.data_keys("Secret", ns, source["secretRef"]["name"]) or ()}
            )
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item:
            value = str(item["value"])
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value):
                if ref not in env:
                    ix.add(
                        describe(obj_id(obj)),
                        f"{name} refers to $({ref}), defined nowhere before it",
                    )
            env[name] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), value
            )
        else:
            value_from = item.get("valueFrom") or {}
            cm_ref = value_from.get("configMapKeyRef")
            if cm_ref and (cm := ix.get("ConfigMap", ns, cm_ref["name"])) is not None:
                env[name] = str((cm.get("data") or {}).get(cm_ref["key"], ""))
            else:
                env[name] = SECRET
    return env


def _mounted_file(ix: _Index, c: Container, path: str) -> tuple[str, str, str] | None:
    """The (kind, name, key) of the ConfigMap or Secret behind `path` in the container."""
    volumes = {v.get("name"): v for v in c.pod.get("volumes") or []}
    for mount in c.spec.get("volumeMounts") or []:
        root = str(mount.get("mountPath", "")).rstrip("/")
        if not path.startswith(root + "/"):
            continue
        key = path[len(root) + 1 :]
        volume = volumes.get(mount.get("name")) or {}
        if "configMap" in volume:
            return ("ConfigMap", volume["configMap"]["name"], key)
        if "secret" in volume:
            return ("Secret", volume["secret"]["secretName"], key)
    return None


def _services(ix: _Index) -> None:
    running = list(service_containers(ix))
    for missing in sorted(set(service_packages()) - {c.service for c in running}):
        ix.add(f"services/{missing}", "no Deployment runs it")
    for unknown in sorted(set(service_packages()) - set(SERVICES)):
        ix.add(f"services/{unknown}", "deploy/k8s/qmk8s/wiring.py does not know what it needs")
    scales: dict[str, set[str]] = {}
    clusters: dict[str, list[str]] = {}
    fleet_clusters: set[str] = set()
    for c in running:
        if c.service not in SERVICES:
            ix.add(c.where, f"runs services.{c.service}, which wiring.py does not know")
            continue
        needs = SERVICES[c.service]
        fields = settings_fields(c.service)
        for name in sorted(c.env):
            if name.startswith("QM_") and name[3:].lower() not in fields:
                ix.add(c.where, f"{name} is not a setting of services.{c.service} (typo?)")
        host = c.env.get("QM_HTTP_HOST")
        if host not in ("0.0.0.0", "::"):
            ix.add(c.where, f"QM_HTTP_HOST is {host!r}: probes and Services cannot reach it")
        port = c.env.get("QM_HTTP_PORT")
        declared = {p.get("name"): p.get("containerPort") for p in c.spec.get("ports") or []}
        if port is None or str(declared.get("http")) != port:
            ix.add(c.where, f"QM_HTTP_PORT {port} is not its `http` port {declared.get('http')}")
        if not c.env.get("QM_KAFKA_BOOTSTRAP"):
            ix.add(c.where, "QM_KAFKA_BOOTSTRAP is not set")
        for store, setting in STORE_SETTING.items():
            if store in needs.stores and setting not in c.env:
                ix.add(c.where, f"{setting} is not set; services.{c.service} needs {store}")
            if store not in needs.stores and setting in c.env:
                ix.add(c.where, f"{setting} is set; services.{c.service} does not use {store}")
        for setting in sorted(needs.files):
            var = f"QM_{setting.upper()}"
            path = c.env.get(var)
            if path is None:
                ix.add(c.where, f"{var} is not set (its default is a repository path)")
                continue
            source = _mounted_file(ix, c, path)
            if source is None:
                ix.add(c.where, f"{var}={path} is on no ConfigMap or Secret volume")
                continue
            keys = ix.data_keys(source[0], obj_id(c.workload)[1], source[1])
            if keys is not None and source[2] not in keys:
                ix.add(c.where, f"{var}: {source[0]} {source[1]} has no key {source[2]}")
            if setting == "fleet_file" and source[0] == "ConfigMap":
                fleet = ix.get("ConfigMap", obj_id(c.workload)[1], source[1])
                text = ((fleet or {}).get("data") or {}).get(source[2], "")
                fleet_clusters |= {
                    str(x.get("name")) for x in (yaml.safe_load(text) or {}).get("clusters") or []
                }
        scales.setdefault(c.env.get("QM_TIME_SCALE", "60 (the default)"), set()).add(c.where)
        if c.service == "executor":
            cluster = c.env.get("QM_EXECUTOR_CLUSTER")
            if not cluster:
                ix.add(c.where, "QM_EXECUTOR_CLUSTER is not set")
            else:
                clusters.setdefault(cluster, []).append(c.where)
            spec = c.workload["spec"]
            if (
                int(spec.get("replicas", 1)) != 1
                or (spec.get("strategy") or {}).get("type") != "Recreate"
            ):
                ix.add(c.where, "an executor must run alone: replicas 1 and strategy Recreate")
    if len(scales) > 1:
        ix.add("QM_TIME_SCALE", f"services disagree on the time scale: {sorted(scales)}")
    for cluster, wheres in clusters.items():
        if len(wheres) > 1:
            ix.add(f"cluster {cluster}", f"several executors: {', '.join(wheres)}")
        if fleet_clusters and cluster not in fleet_clusters:
            ix.add(f"cluster {cluster}", "has an executor but is not in the fleet file")
    for cluster in sorted(fleet_clusters - set(clusters)):
        ix.add(f"cluster {cluster}", "is in the fleet file but no executor runs it")


# --- the network --------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: tuple[tuple[str, str], ...]
    ports: tuple[tuple[str, int], ...] = ()

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)


def _pod(name: str, ns: str, labels: dict[str, str], ports: dict[str, int] | None = None) -> Pod:
    return Pod(name, ns, tuple(sorted(labels.items())), tuple(sorted((ports or {}).items())))


@dataclass
class Network:
    policies: list[Obj]
    namespace_labels: dict[str, dict[str, str]]

    def _ns_labels(self, ns: str) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": ns, **self.namespace_labels.get(ns, {})}

    def _peer(self, peer: Obj, policy_ns: str, pod: Pod) -> bool:
        if "ipBlock" in peer:
            return True  # pod addresses are addresses too: conservatively, it may match
        if "namespaceSelector" in peer:
            if not selector_matches(peer["namespaceSelector"], self._ns_labels(pod.namespace)):
                return False
        elif pod.namespace != policy_ns:
            return False
        return "podSelector" not in peer or selector_matches(peer["podSelector"], pod.label_map)

    @staticmethod
    def _port(rule: Obj, dst: Pod, port: int, protocol: str) -> bool:
        ports = rule.get("ports")
        if not ports:
            return True
        named = dict(dst.ports)
        for p in ports:
            if p.get("protocol", "TCP") != protocol:
                continue
            value = p.get("port")
            if value is None:
                return True
            number = named.get(value) if isinstance(value, str) else value
            if number is not None and number <= port <= int(p.get("endPort", number)):
                return True
        return False

    @staticmethod
    def _types(policy: Obj) -> list[str]:
        spec = policy["spec"]
        implied = ["Ingress", *(["Egress"] if spec.get("egress") else [])]
        return list(spec.get("policyTypes") or implied)

    def _selected(self, pod: Pod, kind: str) -> list[Obj]:
        return [
            p
            for p in self.policies
            if obj_id(p)[1] == pod.namespace
            and kind in self._types(p)
            and selector_matches(p["spec"].get("podSelector"), pod.label_map)
        ]

    def allowed(self, src: Pod, dst: Pod, port: int, protocol: str = "TCP") -> bool:
        out = self._selected(src, "Egress")
        if out and not any(
            self._port(rule, dst, port, protocol)
            and (not rule.get("to") or any(self._peer(pr, src.namespace, dst) for pr in rule["to"]))
            for p in out
            for rule in p["spec"].get("egress") or []
        ):
            return False
        into = self._selected(dst, "Ingress")
        return not into or any(
            self._port(rule, dst, port, protocol)
            and (
                not rule.get("from")
                or any(self._peer(pr, dst.namespace, src) for pr in rule["from"])
            )
            for p in into
            for rule in p["spec"].get("ingress") or []
        )


def strimzi_policies(kafka: Obj) -> list[Obj]:
    """The ingress policy Strimzi writes for a Kafka cluster's listeners."""
    ns, name = obj_id(kafka)[1], obj_id(kafka)[2]
    rules = []
    for listener in kafka["spec"]["kafka"].get("listeners") or []:
        rule: Obj = {"ports": [{"protocol": "TCP", "port": listener["port"]}]}
        if listener.get("networkPolicyPeers"):
            rule["from"] = listener["networkPolicyPeers"]
        rules.append(rule)
    return [
        {
            "kind": "NetworkPolicy",
            "metadata": {"name": f"{name}-network-policy-kafka", "namespace": ns},
            "spec": {
                "podSelector": {
                    "matchLabels": {"strimzi.io/cluster": name, "strimzi.io/kind": "Kafka"}
                },
                "policyTypes": ["Ingress"],
                "ingress": rules,
            },
        }
    ]


def _network(ix: _Index) -> None:
    policies = list(ix.of("NetworkPolicy"))
    for kafka in ix.of("Kafka"):
        policies += strimzi_policies(kafka)
    net = Network(
        policies,
        {obj_id(n)[2]: (n["metadata"].get("labels") or {}) for n in ix.of("Namespace")},
    )
    stores: dict[str, tuple[Pod, int]] = {}
    for kafka in ix.of("Kafka"):
        labels = {"strimzi.io/cluster": obj_id(kafka)[2], "strimzi.io/kind": "Kafka"}
        stores["kafka"] = (_pod("a Kafka broker", obj_id(kafka)[1], labels), 9092)
    for cluster in ix.of("Cluster"):
        labels = {"cnpg.io/cluster": obj_id(cluster)[2], "cnpg.io/podRole": "instance"}
        stores["postgres"] = (_pod("a PostgreSQL instance", obj_id(cluster)[1], labels), 5432)
    services: dict[str, Pod] = {}
    for obj in ix.objects:
        for template in pod_templates(obj):
            labels = (template.get("metadata") or {}).get("labels") or {}
            ports = {
                p["name"]: p["containerPort"]
                for c in containers(template.get("spec") or {})
                for p in c.get("ports") or []
                if "name" in p
            }
            name = labels.get("app.kubernetes.io/name", "")
            pod = _pod(describe(obj_id(obj)), obj_id(obj)[1], labels, ports)
            if name == "redis":
                stores["redis"] = (pod, 6379)
            elif name in SERVICES:
                services.setdefault(name, pod)
    dns = _pod("kube-dns", "kube-system", {"k8s-app": "kube-dns"})
    outsider = _pod("a pod in namespace default", "default", {"app": "anything"})
    prometheus = _pod("Prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"})
    for name, pod in sorted(services.items()):
        for store, (dst, port) in sorted(stores.items()):
            reach = net.allowed(pod, dst, port)
            if store in SERVICES[name].stores and not reach:
                ix.add(pod.name, f"cannot reach {store} ({dst.name}:{port})")
            if store not in SERVICES[name].stores and reach:
                ix.add(pod.name, f"can reach {store} ({dst.name}:{port}), which it does not use")
        for store in sorted(SERVICES[name].stores - set(stores) - {"kafka"}):
            ix.add(pod.name, f"needs {store}, which these manifests do not run")
        if not net.allowed(pod, dns, 53, "UDP"):
            ix.add(pod.name, "cannot resolve names (DNS, UDP 53)")
        if not net.allowed(prometheus, pod, 8080):
            ix.add(pod.name, "Prometheus cannot scrape its metrics (8080)")
        if net.allowed(outsider, pod, 8080) != (name == "gateway"):
            ix.add(pod.name, f"reachable from other namespaces: {name != 'gateway'}")
    for store, (dst, port) in sorted(stores.items()):
        if net.allowed(outsider, dst, port):
            ix.add(dst.name, f"{store} is reachable from other namespaces on {port}")


# --- topics -------------------------------------------------------------------------------


def _topics(ix: _Index) -> None:
    from schemas.topics import TOPICS

    rendered = {str(t["spec"].get("topicName") or obj_id(t)[2]): t for t in ix.of("KafkaTopic")}
    for topic in TOPICS:
        obj = rendered.get(topic.name)
        if obj is None:
            ix.add(f"topic {topic.name}", "is in the registry but has no KafkaTopic")
        elif int(obj["spec"]["partitions"]) != topic.partitions:
            ix.add(
                describe(obj_id(obj)),
                f"{obj['spec']['partitions']} partitions; the registry says {topic.partitions}",
            )
    for name in sorted(set(rendered) - {t.name for t in TOPICS}):
        ix.add(f"topic {name}", "has a KafkaTopic but is not in schemas/topics.py")
