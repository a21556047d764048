"""Offline validation of rendered objects.

Kubernetes kinds: kubernetes-validate (the OpenAPI schemas of each Kubernetes release, shipped in
its wheel) in strict mode, so an unknown or misspelt field is an error, against KUBERNETES_VERSION.

Custom resources (Strimzi, CloudNativePG, the Prometheus operator's ServiceMonitor) have no
schema there. They get structural checks of our own: JSON schemas written here for the fields
these manifests use (closed where we know the whole object, so a typo fails), and checks across
objects (a topic's cluster exists, replication fits the brokers, a ServiceMonitor selects a
Service and a port it has). They were written from the operators' documentation and CRDs
(Strimzi 1.2 `kafka.strimzi.io/v1`, CloudNativePG 1.30, prometheus-operator
`monitoring.coreos.com/v1`); they are not those CRDs, and an operator upgrade may accept more.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
from kubernetes_validate import utils as kv

from qmk8s.kustomize import describe, obj_id
from qmk8s.yamlio import Obj

# The oldest Kubernetes release the operators we depend on support (CloudNativePG 1.30: 1.34
# to 1.36; Strimzi 1.2: 1.30 and later). `render.py check --kube-version` checks another.
KUBERNETES_VERSION = "1.34"


@dataclass(frozen=True)
class Problem:
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


# --- schemas of our own -------------------------------------------------------------------

QUANTITY = r"^[+-]?(\d+(\.\d*)?|\.\d+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?\d+))?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
SCALARS = {"type": "object", "additionalProperties": {"type": ["string", "integer", "boolean"]}}
ANY_OBJECT = {"type": "object"}


def closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


RESOURCES = closed(
    {
        "requests": {
            "type": "object",
            "additionalProperties": {"type": "string", "pattern": QUANTITY},
        },
        "limits": {
            "type": "object",
            "additionalProperties": {"type": "string", "pattern": QUANTITY},
        },
    }
)
LABEL_SELECTOR = closed(
    {
        "matchLabels": STRINGS,
        "matchExpressions": {
            "type": "array",
            "items": closed(
                {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
                ("key", "operator"),
            ),
        },
    }
)
METADATA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": DNS_SUBDOMAIN, "maxLength": 253},
        "namespace": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63},
        "labels": STRINGS,
        "annotations": STRINGS,
    },
    "required": ["name", "namespace"],
    "additionalProperties": False,
}


def resource(api: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return closed(
        {
            "apiVersion": {"const": api},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


JVM = closed(
    {
        "-Xms": {"type": "string", "pattern": r"^[0-9]+[mMgG]?$"},
        "-Xmx": {"type": "string", "pattern": r"^[0-9]+[mMgG]?$"},
        "-XX": SCALARS,
        "gcLoggingEnabled": {"type": "boolean"},
        "javaSystemProperties": {"type": "array"},
    }
)
KAFKA_VOLUME = closed(
    {
        "id": {"type": "integer", "minimum": 0},
        "type": {"enum": ["ephemeral", "persistent-claim"]},
        "size": {"type": "string", "pattern": QUANTITY},
        "sizeLimit": {"type": "string", "pattern": QUANTITY},
        "class": {"type": "string"},
        "deleteClaim": {"type": "boolean"},
        "kraftMetadata": {"enum": ["shared"]},
    },
    ("id", "type"),
)
KAFKA_NODE_POOL = resource(
    "kafka.strimzi.io/v1",
    "KafkaNodePool",
    closed(
        {
            "replicas": {"type": "integer", "minimum": 0},
            "roles": {
                "type": "array",
                "minItems": 1,
                "uniqueItems": True,
                "items": {"enum": ["controller", "broker"]},
            },
            "storage": closed(
                {
                    "type": {"enum": ["jbod", "ephemeral", "persistent-claim"]},
                    "volumes": {"type": "array", "minItems": 1, "items": KAFKA_VOLUME},
                    "size": {"type": "string", "pattern": QUANTITY},
                    "deleteClaim": {"type": "boolean"},
                    "kraftMetadata": {"enum": ["shared"]},
                },
                ("type",),
            ),
            "resources": RESOURCES,
            "jvmOptions": JVM,
            "template": ANY_OBJECT,
        },
        ("replicas", "roles", "storage"),
    ),
)
KAFKA = resource(
    "kafka.strimzi.io/v1",
    "Kafka",
    closed(
        {
            "kafka": closed(
                {
                    "version": {"type": "string", "pattern": r"^\d+\.\d+\.\d+$"},
                    "metadataVersion": {"type": "string", "pattern": r"^\d+\.\d+(-IV\d+)?$"},
                    "listeners": {
                        "type": "array",
                        "minItems": 1,
                        "items": closed(
                            {
                                "name": {"type": "string", "pattern": "^[a-z0-9]{1,11}$"},
                                "port": {"type": "integer", "minimum": 9092},
                                "type": {
                                    "enum": [
                                        "internal",
                                        "route",
                                        "loadbalancer",
                                        "nodeport",
                                        "ingress",
                                        "cluster-ip",
                                    ]
                                },
                                "tls": {"type": "boolean"},
                                "authentication": ANY_OBJECT,
                                "configuration": ANY_OBJECT,
                                "networkPolicyPeers": {
                                    "type": "array",
                                    "items": closed(
                                        {
                                            "podSelector": LABEL_SELECTOR,
                                            "namespaceSelector": LABEL_SELECTOR,
                                            "ipBlock": ANY_OBJECT,
                                        }
                                    ),
                                },
                            },
                            ("name", "port", "type", "tls"),
                        ),
                    },
                    "config": SCALARS,
                    "authorization": ANY_OBJECT,
                    "rack": ANY_OBJECT,
                    "metricsConfig": ANY_OBJECT,
                    "logging": ANY_OBJECT,
                    "template": ANY_OBJECT,
                    "livenessProbe": ANY_OBJECT,
                    "readinessProbe": ANY_OBJECT,
                },
                ("listeners",),
            ),
            "entityOperator": closed(
                {
                    "topicOperator": closed(
                        {
                            "resources": RESOURCES,
                            "reconciliationIntervalMs": {"type": "integer"},
                            "logging": ANY_OBJECT,
                            "jvmOptions": JVM,
                        }
                    ),
                    "userOperator": ANY_OBJECT,
                    "template": ANY_OBJECT,
                }
            ),
            "cruiseControl": ANY_OBJECT,
            "kafkaExporter": ANY_OBJECT,
            "clusterCa": ANY_OBJECT,
            "clientsCa": ANY_OBJECT,
            "maintenanceTimeWindows": {"type": "array", "items": {"type": "string"}},
        },
        ("kafka",),
    ),
)
KAFKA_TOPIC = resource(
    "kafka.strimzi.io/v1",
    "KafkaTopic",
    closed(
        {
            "topicName": {"type": "string"},
            "partitions": {"type": "integer", "minimum": 1},
            "replicas": {"type": "integer", "minimum": 1, "maximum": 32767},
            "config": SCALARS,
        },
        ("partitions", "replicas"),
    ),
)
CNPG_CLUSTER = resource(
    "postgresql.cnpg.io/v1",
    "Cluster",
    closed(
        {
            "instances": {"type": "integer", "minimum": 1},
            "imageName": {"type": "string"},
            "description": {"type": "string"},
            "primaryUpdateStrategy": {"enum": ["unsupervised", "supervised"]},
            "primaryUpdateMethod": {"enum": ["switchover", "restart"]},
            "enableSuperuserAccess": {"type": "boolean"},
            "enablePDB": {"type": "boolean"},
            "bootstrap": closed(
                {
                    "initdb": closed(
                        {
                            "database": {"type": "string", "minLength": 1},
                            "owner": {"type": "string", "minLength": 1},
                            "secret": closed({"name": {"type": "string"}}, ("name",)),
                            "encoding": {"type": "string"},
                            "postInitApplicationSQL": {"type": "array"},
                        },
                        ("database", "owner"),
                    )
                }
            ),
            "postgresql": closed(
                {
                    "parameters": STRINGS,
                    "synchronous": closed(
                        {
                            "method": {"enum": ["any", "first"]},
                            "number": {"type": "integer", "minimum": 1},
                            "dataDurability": {"enum": ["required", "preferred"]},
                        },
                        ("method", "number"),
                    ),
                    "pg_hba": {"type": "array", "items": {"type": "string"}},
                }
            ),
            "storage": closed(
                {
                    "size": {"type": "string", "pattern": QUANTITY},
                    "storageClass": {"type": "string"},
                    "resizeInUseVolumes": {"type": "boolean"},
                },
                ("size",),
            ),
            "walStorage": ANY_OBJECT,
            "resources": RESOURCES,
            "affinity": ANY_OBJECT,
            "monitoring": ANY_OBJECT,
            "backup": ANY_OBJECT,
            "topologySpreadConstraints": {"type": "array"},
            "inheritedMetadata": ANY_OBJECT,
        },
        ("instances", "storage"),
    ),
)
SERVICE_MONITOR = resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    closed(
        {
            "selector": LABEL_SELECTOR,
            "namespaceSelector": ANY_OBJECT,
            "jobLabel": {"type": "string"},
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": closed(
                    {
                        "port": {"type": "string"},
                        "targetPort": {"type": ["string", "integer"]},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": {"type": "string", "pattern": DURATION},
                        "scrapeTimeout": {"type": "string", "pattern": DURATION},
                        "honorLabels": {"type": "boolean"},
                        "relabelings": {"type": "array"},
                        "metricRelabelings": {"type": "array"},
                    }
                ),
            },
        },
        ("selector", "endpoints"),
    ),
)
CUSTOM: dict[tuple[str, str], dict[str, Any]] = {
    ("kafka.strimzi.io/v1", "Kafka"): KAFKA,
    ("kafka.strimzi.io/v1", "KafkaNodePool"): KAFKA_NODE_POOL,
    ("kafka.strimzi.io/v1", "KafkaTopic"): KAFKA_TOPIC,
    ("postgresql.cnpg.io/v1", "Cluster"): CNPG_CLUSTER,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
}


# --- validation ---------------------------------------------------------------------------


def validate(objects: list[Obj], version: str = KUBERNETES_VERSION) -> list[Problem]:
    """Every object against its schema, then the checks across custom resources."""
    problems: list[Problem] = []
    for obj in objects:
        where = describe(obj_id(obj))
        key = (str(obj.get("apiVersion")), str(obj.get("kind")))
        if key in CUSTOM:
            validator = jsonschema.Draft202012Validator(CUSTOM[key])
            for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.path)):
                path = ".".join(str(p) for p in error.path)
                problems.append(Problem(where, f"{path}: {error.message}"))
            continue
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as error:
            path = ".".join(str(p) for p in error.path)
            problems.append(Problem(where, f"Kubernetes {version}: {path}: {error.message}"))
        except kv.SchemaNotFoundError:
            problems.append(
                Problem(where, f"no schema for {key[0]} {key[1]} in Kubernetes {version}")
            )
    problems.extend(cross_checks(objects))
    return problems


def _of(objects: list[Obj], kind: str) -> Iterator[Obj]:
    return (o for o in objects if o.get("kind") == kind)


def _ns(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("namespace") or "")


def _name(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def selector_matches(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against labels; empty matches all."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def cross_checks(objects: list[Obj]) -> list[Problem]:
    problems: list[Problem] = []
    add: Callable[[Obj, str], None] = lambda o, m: problems.append(  # noqa: E731
        Problem(describe(obj_id(o)), m)
    )
    kafkas = {(_ns(k), _name(k)): k for k in _of(objects, "Kafka")}
    pools: dict[tuple[str, str], list[Obj]] = {}
    for pool in _of(objects, "KafkaNodePool"):
        cluster = (pool["metadata"].get("labels") or {}).get("strimzi.io/cluster")
        if (_ns(pool), cluster) not in kafkas:
            add(pool, f"label strimzi.io/cluster={cluster} names no Kafka in its namespace")
            continue
        pools.setdefault((_ns(pool), str(cluster)), []).append(pool)
        volumes = (pool["spec"].get("storage") or {}).get("volumes") or []
        ids = [v.get("id") for v in volumes]
        if len(ids) != len(set(ids)):
            add(pool, "storage volume ids repeat")
        if sum(1 for v in volumes if v.get("kraftMetadata")) > 1:
            add(pool, "more than one volume holds the KRaft metadata")
    brokers: dict[tuple[str, str], int] = {}
    for key, kafka in kafkas.items():
        members = pools.get(key, [])
        roles = {r for p in members for r in p["spec"].get("roles") or []}
        if not {"controller", "broker"} <= roles:
            add(kafka, f"node pools give roles {sorted(roles)}; KRaft needs controller and broker")
        count = sum(
            int(p["spec"].get("replicas", 0)) for p in members if "broker" in p["spec"]["roles"]
        )
        controllers = sum(
            int(p["spec"].get("replicas", 0)) for p in members if "controller" in p["spec"]["roles"]
        )
        if controllers % 2 == 0:
            add(kafka, f"{controllers} controllers: a KRaft quorum needs an odd number")
        brokers[key] = count
        config = kafka["spec"]["kafka"].get("config") or {}
        for setting in (
            "default.replication.factor",
            "offsets.topic.replication.factor",
            "transaction.state.log.replication.factor",
        ):
            value = _int(config.get(setting))
            if value is not None and value > count:
                add(kafka, f"{setting} {value} > {count} brokers")
        isr, rf = (
            _int(config.get("min.insync.replicas")),
            _int(config.get("default.replication.factor")),
        )
        if isr is not None and rf is not None and isr > rf:
            add(kafka, f"min.insync.replicas {isr} > default.replication.factor {rf}")
    names: dict[tuple[str, str], Obj] = {}
    for topic in _of(objects, "KafkaTopic"):
        cluster = (topic["metadata"].get("labels") or {}).get("strimzi.io/cluster")
        key = (_ns(topic), str(cluster))
        if key not in kafkas:
            add(topic, f"label strimzi.io/cluster={cluster} names no Kafka in its namespace")
            continue
        spec = topic["spec"]
        real = str(spec.get("topicName") or _name(topic))
        if not re.fullmatch(r"[a-zA-Z0-9._-]{1,249}", real):
            add(topic, f"{real!r} is not a legal Kafka topic name")
        if (key[0], real) in names:
            add(topic, f"topic {real} is declared twice")
        names[(key[0], real)] = topic
        replicas = int(spec["replicas"])
        if replicas > brokers.get(key, 0):
            add(topic, f"replicas {replicas} > {brokers.get(key, 0)} brokers")
        isr = _int((spec.get("config") or {}).get("min.insync.replicas"))
        if isr is not None and isr > replicas:
            add(topic, f"min.insync.replicas {isr} > replicas {replicas}: no write could succeed")
    for cluster in _of(objects, "Cluster"):
        spec = cluster["spec"]
        sync = (spec.get("postgresql") or {}).get("synchronous")
        if sync and int(sync["number"]) >= int(spec["instances"]):
            add(cluster, f"synchronous.number {sync['number']} needs more instances")
    for monitor in _of(objects, "ServiceMonitor"):
        services = [
            s
            for s in _of(objects, "Service")
            if _ns(s) == _ns(monitor)
            and selector_matches(monitor["spec"]["selector"], s["metadata"].get("labels") or {})
        ]
        if not services:
            add(monitor, "its selector matches no Service")
        for endpoint in monitor["spec"]["endpoints"]:
            port = endpoint.get("port")
            for service in services:
                if port not in {p.get("name") for p in service["spec"].get("ports") or []}:
                    add(monitor, f"Service {_name(service)} has no port named {port}")
    return problems
