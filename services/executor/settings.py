"""Executor settings (env prefix QM_)."""

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from services.common.settings import ServiceSettings


class ExecutorSettings(ServiceSettings):
    executor_cluster: str = "onprem-h100"
    default_duration_s: float = 300.0
    heartbeat_interval_s: float = 5.0
    capacity_interval_s: float = 30.0
    tick_interval_s: float = 0.05
    # Wall seconds between job.progress reports of running gangs (telemetry, not outboxed).
    progress_interval_s: float = 2.0
    # Random fault mode (also started over HTTP: POST /faults/random, `qm fault random`):
    # faults per fleet hour for the whole cluster (0: off), drawn from this seed.
    fault_seed: int | None = None
    fault_rate_per_hour: float = 0.0
    # Placements wait in the broker at most this long. Every poll is a broker round trip and
    # there is an executor per cluster, so they poll less often than the scheduling path.
    fetch_max_wait_ms: int = 100
    # No lingering (common/consumer.py, Linger): a placement's way to its run starting, and so
    # to the capacity turning over, is what a full fleet waits on.
    batch_linger_ms: int = Field(default=0, ge=0, le=10_000)
    # A stop order for a job not running here is kept this long (wall seconds) so that a
    # placement of the canceled job still on its way is refused; pruned every
    # `tombstone_prune_every_s`.
    tombstone_retention_s: float = 3600.0
    tombstone_prune_every_s: float = 300.0
    # Which backend runs the work: the simulated fleet (the fleet file's nodes, accelerated
    # time) or a Kubernetes cluster (kubernetes-asyncio; set QM_TIME_SCALE=1 with it).
    executor_backend: Literal["simulated", "kubernetes"] = "simulated"
    # --- the kubernetes backend (docs/executor.md, "The kubernetes backend") ---
    # A kubeconfig file; unset: the pod's service account (in-cluster), else ~/.kube/config.
    kube_config: Path | None = None
    kube_context: str | None = None
    kube_namespace: str = "quartermaster-jobs"
    # A pod kube-scheduler finds no node for is refused back to the scheduler after this long.
    kube_unschedulable_after_s: float = 120.0
    # Node labels: accelerator type (values mapped through the policy's accelerator types),
    # topology, price tier.
    kube_accelerator_label: str = "quartermaster.io/accelerator"
    kube_nvlink_label: str = "quartermaster.io/nvlink-domain"
    kube_rack_label: str = "topology.kubernetes.io/rack"
    kube_block_label: str = "topology.kubernetes.io/zone"
    kube_price_tier_label: str = "quartermaster.io/price-tier"
    # Extended resources: per accelerator-type prefix (others: kube_gpu_resource), and the
    # cluster's sharing resource for fractions of a device, `kube_fraction_shares` per device.
    kube_gpu_resource: str = "nvidia.com/gpu"
    kube_accelerator_resources: dict[str, str] = {"TPU": "google.com/tpu"}
    kube_fraction_resource: str = "nvidia.com/gpu.shared"
    kube_fraction_shares: int = 4
    kube_toleration_keys: tuple[str, ...] = ("nvidia.com/gpu", "google.com/tpu")
    kube_default_image: str | None = None
    kube_master_port: int = 29500
    # Node labels a pod also selects on, with the chosen node's values: GKE admits a TPU pod
    # only with the slice's accelerator and topology selectors.
    kube_pinned_labels: tuple[str, ...] = (
        "cloud.google.com/gke-tpu-accelerator",
        "cloud.google.com/gke-tpu-topology",
    )
    # The job's priority class -> the cluster's PriorityClass name (unset: none on the pods).
    kube_priority_classes: dict[str, str] = {}
    # A PodDisruptionBudget per gang, so a node drain waits rather than breaking a gang.
    kube_gang_disruption_budget: bool = True
    # A node the health service quarantines is cordoned and tainted with this key (empty: the
    # backend leaves the node alone).
    kube_quarantine_taint: str = "quartermaster.io/quarantined"
    # A drop in a node's allocatable accelerators is reported on node.probe as this kind.
    kube_device_loss_probe: str = "pcie_error"
    # Failed API calls of an action are retried with backoff up to this long.
    kube_retry_for_s: float = 60.0
    # Elastic pools on Kubernetes (docs/autoscaler.md): the label a pool's node group puts on
    # its nodes (value: the pool's name), the ProvisioningRequest class asked of
    # cluster-autoscaler, and how long a pool whose request failed asks nothing more.
    kube_pool_label: str = "quartermaster.io/pool"
    kube_provisioning_class: str = "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
    kube_pool_retry_failed_after_s: float = 300.0
    # A request not provisioned this long failed (cluster-autoscaler keeps retrying a stockout
    # without saying Failed); unset: twice the pool's provision_s plus a minute.
    kube_provisioning_timeout_s: float | None = None


# A cluster's `backend:` entry in the fleet file (docs/executor.md) and the settings it sets.
_FLEET_BACKEND_KEYS = {
    "kind": "executor_backend",
    "kubeconfig": "kube_config",
    "context": "kube_context",
    "namespace": "kube_namespace",
}


def with_fleet_backend(
    settings: ExecutorSettings, fleet: Mapping[str, Any], fleet_file: Path
) -> ExecutorSettings:
    """The settings with what the fleet file says of this cluster's backend filled in; what the
    environment set wins. A relative kubeconfig path is relative to the fleet file."""
    entry = next(
        (
            c
            for c in fleet.get("clusters") or []
            if isinstance(c, Mapping) and c.get("name") == settings.executor_cluster
        ),
        None,
    )
    raw = entry.get("backend") if entry is not None else None
    if raw is None:
        return settings
    where = f"{fleet_file}: cluster {settings.executor_cluster!r}: backend"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping such as {{kind: kubernetes, ...}}")
    unknown = sorted(set(raw) - set(_FLEET_BACKEND_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(_FLEET_BACKEND_KEYS)}")
    update: dict[str, Any] = {}
    for key, field in _FLEET_BACKEND_KEYS.items():
        if key in raw and field not in settings.model_fields_set:
            value = raw[key]
            if field == "kube_config":
                value = fleet_file.parent / Path(str(value))
            update[field] = value
    try:
        return ExecutorSettings.model_validate({**settings.model_dump(), **update})
    except ValidationError as error:
        raise ValueError(f"{where}: {error}") from error
