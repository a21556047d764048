"""Per-resource rules the API server applies (its registry "strategies"): defaults and status on
create, what an update of a pod may change, validation, field-selector values, and when
`metadata.generation` moves. Only the rules a scheduler backend can trip over are here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import Any

from tests.kubeapi.selectors import label_key_error, label_value_error

Obj = dict[str, Any]
# (field path, error type, detail): rendered as `field: type: detail`, as the API does.
Cause = tuple[str, str, str]


@dataclass(frozen=True)
class ResourceType:
    """One row of the resource table: what the API serves under group/version/plural."""

    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    status: bool = False  # has a `status` subresource
    builtin: bool = True  # False for custom resources: no strategic merge patch, as in the API
    fields: tuple[str, ...] = ()  # field-selector labels beyond metadata.name/namespace
    short_names: tuple[str, ...] = ()
    name_rule: str = "subdomain"  # "subdomain", "label" or "dns1035"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        """How the API names the resource in messages: `pods`, `leases.coordination.k8s.io`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def singular(self) -> str:
        return self.kind.lower()


def custom_resource(
    group: str,
    version: str,
    plural: str,
    kind: str,
    *,
    namespaced: bool = True,
    status: bool = True,
) -> ResourceType:
    """A resource as a CustomResourceDefinition would serve it."""
    return ResourceType(group, version, plural, kind, namespaced, status, builtin=False)


POD_FIELDS = (
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.nominatedNodeName",
)
EVENT_FIELDS = (
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
)


def _core(plural: str, kind: str, **options: Any) -> ResourceType:
    return ResourceType("", "v1", plural, kind, **options)


# The resource table: serving another resource is one more line here (or double.register(...)).
BUILTIN_RESOURCES = (
    _core("namespaces", "Namespace", namespaced=False, status=True, name_rule="label"),
    _core("nodes", "Node", namespaced=False, status=True, fields=("spec.unschedulable",)),
    _core("pods", "Pod", status=True, fields=POD_FIELDS),
    _core("services", "Service", status=True, name_rule="dns1035"),
    _core("events", "Event", fields=EVENT_FIELDS),
    _core("configmaps", "ConfigMap"),
    _core("secrets", "Secret", fields=("type",)),
    _core("serviceaccounts", "ServiceAccount"),
    _core("podtemplates", "PodTemplate"),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease"),
    ResourceType("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", status=True),
    ResourceType("scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", namespaced=False),
    custom_resource("autoscaling.x-k8s.io", "v1", "provisioningrequests", "ProvisioningRequest"),
)

# Field-selector labels whose value is not simply the field at that path.
_FIELD_PATHS = {"source": "source.component"}
_FIELD_DEFAULTS = {"spec.unschedulable": "false", "spec.hostNetwork": "false"}


def rfc3339(at: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if at is None else at))


def field_value(obj: Obj, label: str) -> str:
    """The string a field selector compares for `label` (booleans as true/false, absent as "")."""
    node: Any = obj
    for part in _FIELD_PATHS.get(label, label).split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if node is None:
        return _FIELD_DEFAULTS.get(label, "")
    if isinstance(node, bool):
        return "true" if node else "false"
    return str(node)


# --- quantities -----------------------------------------------------------------------------

_QUANTITY_RE = re.compile(
    r"^(?P<number>[+-]?(?:\d+\.?\d*|\.\d+))"
    r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)|[eE](?P<exponent>[+-]?\d+))?$"
)
_SUFFIXES = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(10) ** e for s, e in (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6))},
    **{s: Decimal(10) ** e for s, e in (("G", 9), ("T", 12), ("P", 15), ("E", 18))},
}


@lru_cache(maxsize=4096)
def parse_quantity(text: str) -> Decimal:
    """A Kubernetes quantity ("500m", "2", "16Gi", "1e3") as a number; ValueError if malformed."""
    match = _QUANTITY_RE.match(str(text).strip())
    if match is None:
        raise ValueError(f"quantities must match the regular expression {_QUANTITY_RE.pattern!r}")
    try:
        number = Decimal(match["number"])
    except InvalidOperation as error:
        raise ValueError(str(error)) from error
    if match["exponent"]:
        return number * Decimal(10) ** int(match["exponent"])
    return number * _SUFFIXES.get(match["suffix"] or "", Decimal(1))


def is_extended_resource(name: str) -> bool:
    """Extended resources (`nvidia.com/gpu`, `google.com/tpu`) cannot be overcommitted: the API
    insists on whole numbers and requests equal to limits."""
    domain, slash, _ = name.partition("/")
    return bool(slash) and not domain.endswith("kubernetes.io") and not name.startswith("requests.")


# --- names and metadata -----------------------------------------------------------------------

_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NAME_RULES: dict[str, tuple[re.Pattern[str], int, str]] = {
    "subdomain": (_SUBDOMAIN_RE, 253, "a lowercase RFC 1123 subdomain"),
    "label": (_LABEL_RE, 63, "a lowercase RFC 1123 label"),
    "dns1035": (_DNS1035_RE, 63, "a DNS-1035 label (starting with a letter)"),
}


def dns_label_error(name: str) -> str | None:
    if len(name) > 63 or not _LABEL_RE.match(name):
        return (
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-'"
        )
    return None


def _name_causes(rt: ResourceType, name: str) -> list[Cause]:
    pattern, limit, what = _NAME_RULES[rt.name_rule]
    if len(name) > limit or not pattern.match(name):
        return [("metadata.name", "Invalid value", f'"{name}": must be {what} (<= {limit})')]
    return []


def _map_causes(path: str, mapping: Any, check_values: bool) -> list[Cause]:
    if mapping is None:
        return []
    if not isinstance(mapping, dict):
        return [(path, "Invalid value", "must be a map of strings")]
    causes = []
    for key, value in mapping.items():
        if error := label_key_error(key):
            causes.append((path, "Invalid value", f'"{key}": {error}'))
        if check_values and (error := label_value_error(value)):
            causes.append((f"{path}", "Invalid value", f'"{value}": {error}'))
        elif not isinstance(value, str):
            causes.append((f"{path}[{key}]", "Invalid value", "must be a string"))
    return causes


def validate(rt: ResourceType, obj: Obj) -> list[Cause]:
    """Everything the API would answer 422 Invalid for, as (field, type, detail) causes."""
    meta = obj.get("metadata") or {}
    causes = _name_causes(rt, str(meta.get("name", "")))
    causes += _map_causes("metadata.labels", meta.get("labels"), check_values=True)
    causes += _map_causes("metadata.annotations", meta.get("annotations"), check_values=False)
    finalizers = meta.get("finalizers", [])
    if not isinstance(finalizers, list) or not all(isinstance(f, str) for f in finalizers):
        causes.append(("metadata.finalizers", "Invalid value", "must be a list of strings"))
    if rt.key == "pods":
        causes += _pod_causes(obj)
    return causes


# --- pods -------------------------------------------------------------------------------------


def _pod_causes(pod: Obj) -> list[Cause]:
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return [("spec", "Required value", "a pod needs a spec")]
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        return [("spec.containers", "Required value", "a pod needs at least one container")]
    causes: list[Cause] = []
    seen: set[str] = set()
    for kind in ("initContainers", "containers"):
        for index, container in enumerate(spec.get(kind) or []):
            causes += _container_causes(f"spec.{kind}[{index}]", container, seen)
    return causes


def _container_causes(path: str, container: Any, seen: set[str]) -> list[Cause]:
    if not isinstance(container, dict):
        return [(path, "Invalid value", "must be an object")]
    name, causes = container.get("name"), []
    if not name:
        causes.append((f"{path}.name", "Required value", ""))
    elif error := dns_label_error(str(name)):
        causes.append((f"{path}.name", "Invalid value", f'"{name}": {error}'))
    elif name in seen:
        causes.append((f"{path}.name", "Duplicate value", f'"{name}"'))
    seen.add(str(name))
    if not container.get("image"):
        causes.append((f"{path}.image", "Required value", ""))
    return causes + _resource_causes(f"{path}.resources", container.get("resources") or {})


def _resource_causes(path: str, resources: Obj) -> list[Cause]:
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    causes: list[Cause] = []
    for kind, values in (("limits", limits), ("requests", requests)):
        for name, value in values.items():
            try:
                amount = parse_quantity(str(value))
            except ValueError as error:
                causes.append((f"{path}.{kind}[{name}]", "Invalid value", f'"{value}": {error}'))
                continue
            if is_extended_resource(name) and amount != amount.to_integral_value():
                causes.append(
                    (f"{path}.{kind}[{name}]", "Invalid value", f'"{value}": must be an integer')
                )
    return causes + _limit_causes(path, limits, requests)


def _limit_causes(path: str, limits: Obj, requests: Obj) -> list[Cause]:
    causes: list[Cause] = []
    for name, value in requests.items():
        try:
            request = parse_quantity(str(value))
            limit = parse_quantity(str(limits[name])) if name in limits else None
        except ValueError:
            continue  # reported above
        if is_extended_resource(name) and limit is None:
            causes.append(
                (
                    f"{path}.limits",
                    "Required value",
                    "Limit must be set for non overcommitable resources",
                )
            )
        elif is_extended_resource(name) and request != limit:
            causes.append(
                (
                    f"{path}.requests",
                    "Invalid value",
                    f'"{value}": must be equal to {name} limit of {limits[name]}',
                )
            )
        elif limit is not None and request > limit:
            causes.append(
                (
                    f"{path}.requests",
                    "Invalid value",
                    f'"{value}": must be less than or equal to {name} limit of {limits[name]}',
                )
            )
    return causes


def default_pod_spec(spec: Obj) -> None:
    """The defaults the API fills in, so a PUT without them compares equal to the stored pod."""
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        if not isinstance(container, dict):
            continue
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        image = str(container.get("image", ""))
        latest = ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")
        container.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
        resources = container.setdefault("resources", {})
        # Requests default to limits, resource by resource (so `limits: {nvidia.com/gpu: 1}` is
        # also a request).
        for name, value in (resources.get("limits") or {}).items():
            resources.setdefault("requests", {}).setdefault(name, value)


def qos_class(spec: Obj) -> str:
    containers = [c for c in spec.get("containers") or [] if isinstance(c, dict)]
    resources = [c.get("resources") or {} for c in containers]
    compute = ("cpu", "memory")
    if not any(
        (r.get(k) or {}).get(n) for r in resources for k in ("limits", "requests") for n in compute
    ):
        return "BestEffort"
    guaranteed = all(
        (r.get("limits") or {}).get(n)
        and (r.get("limits") or {}).get(n) == (r.get("requests") or {}).get(n)
        for r in resources
        for n in compute
    )
    return "Guaranteed" if guaranteed else "Burstable"


# What `kubectl` and the API call the fields a pod update may change.
_POD_MUTABLE = (
    "spec.containers[*].image, spec.initContainers[*].image, spec.activeDeadlineSeconds, "
    "spec.tolerations, spec.schedulingGates (deletion only)"
)


def _pod_spec_fixed_part(spec: Obj, gated: bool) -> Obj:
    fixed = {
        k: v
        for k, v in spec.items()
        if k not in ("activeDeadlineSeconds", "tolerations", "schedulingGates")
    }
    if gated:  # a pod behind a scheduling gate may still have its placement constraints changed
        fixed.pop("nodeSelector", None)
        fixed.pop("affinity", None)
    for kind in ("containers", "initContainers"):
        if kind in fixed:
            fixed[kind] = [{**c, "image": None} for c in fixed[kind] if isinstance(c, dict)]
    return fixed


def pod_update_causes(old: Obj, new: Obj) -> list[Cause]:
    """A pod's spec is immutable but for a few fields; scheduling gates may only be removed."""
    old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
    old_gates = {gate.get("name") for gate in old_spec.get("schedulingGates") or []}
    added = [
        g.get("name")
        for g in new_spec.get("schedulingGates") or []
        if g.get("name") not in old_gates
    ]
    causes: list[Cause] = []
    if added:
        causes.append(
            (
                "spec.schedulingGates",
                "Forbidden",
                f"only deletion is allowed, but found new scheduling gate {added[0]!r}",
            )
        )
    gated = bool(old_gates)
    if _pod_spec_fixed_part(old_spec, gated) != _pod_spec_fixed_part(new_spec, gated):
        causes.append(
            ("spec", "Forbidden", f"pod updates may not change fields other than {_POD_MUTABLE}")
        )
    return causes


# --- create and update preparation ------------------------------------------------------------


def prepare_create(rt: ResourceType, obj: Obj, allocate_ip: Callable[[], str]) -> None:
    """Defaults and initial status, as each resource's strategy sets them on create."""
    if rt.key == "pods":
        spec = obj.setdefault("spec", {})
        if isinstance(spec, dict):
            default_pod_spec(spec)
            obj["status"] = {"phase": "Pending", "qosClass": qos_class(spec)}
    elif rt.key == "services":
        spec = obj.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        if not spec.get("clusterIP"):
            spec["clusterIP"] = allocate_ip()
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        obj["status"] = {"loadBalancer": {}}
    elif rt.key == "namespaces":
        obj["status"] = {"phase": "Active"}
    elif not rt.builtin and rt.status:
        obj.pop("status", None)  # a custom resource's status is written through /status only


def prepare_update(rt: ResourceType, old: Obj, new: Obj) -> list[Cause]:
    """Defaults and per-resource update rules; returns the causes for a 422."""
    if rt.key == "pods" and isinstance(new.get("spec"), dict):
        default_pod_spec(new["spec"])
        return pod_update_causes(old, new)
    if rt.key == "services" and isinstance(new.get("spec"), dict):
        # The cluster IP is allocated once; an update that leaves it out keeps it.
        for field in ("clusterIP", "clusterIPs", "type"):
            if field in (old.get("spec") or {}):
                new["spec"].setdefault(field, old["spec"][field])
    return []


def spec_changed(old: Obj, new: Obj) -> bool:
    """Generation moves when anything but metadata and status changes (a simplification: the
    API leaves generation unset for some kinds, such as ConfigMap; here every object has one)."""
    ignored = ("metadata", "status", "kind", "apiVersion")
    keys = (set(old) | set(new)) - set(ignored)
    return any(old.get(key) != new.get(key) for key in keys)
