"""From the executor's settings to a client of the cluster's API and the backend's options."""

from __future__ import annotations

from kubernetes_asyncio import config
from kubernetes_asyncio.client import ApiClient, Configuration

from schemas.health import SignalKind
from services.executor.kube.backend import KubeOptions
from services.executor.kube.nodes import NodeLabels
from services.executor.kube.pods import PodOptions
from services.executor.kube.provisioning import ProvisioningOptions
from services.executor.settings import ExecutorSettings


async def api_client(settings: ExecutorSettings) -> ApiClient:
    """A kubeconfig when one is named; else the pod's service account; else ~/.kube/config."""
    configuration = Configuration()
    if settings.kube_config is not None:
        await config.load_kube_config(
            config_file=str(settings.kube_config),
            context=settings.kube_context,
            client_configuration=configuration,
            persist_config=False,
        )
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except config.ConfigException:
            await config.load_kube_config(
                context=settings.kube_context,
                client_configuration=configuration,
                persist_config=False,
            )
    return ApiClient(configuration=configuration)


def kube_options(settings: ExecutorSettings) -> KubeOptions:
    pods = PodOptions(
        namespace=settings.kube_namespace,
        cluster=settings.executor_cluster,
        accelerator_resources=dict(settings.kube_accelerator_resources),
        default_resource=settings.kube_gpu_resource,
        fraction_resource=settings.kube_fraction_resource,
        fraction_shares=settings.kube_fraction_shares,
        toleration_keys=tuple(settings.kube_toleration_keys),
        default_image=settings.kube_default_image,
        master_port=settings.kube_master_port,
        priority_classes=dict(settings.kube_priority_classes),
        gang_disruption_budget=settings.kube_gang_disruption_budget,
    )
    return KubeOptions(
        pods=pods,
        unschedulable_after_s=settings.kube_unschedulable_after_s,
        retry_for_s=settings.kube_retry_for_s,
        quarantine_taint=settings.kube_quarantine_taint,
    )


def node_labels(settings: ExecutorSettings) -> NodeLabels:
    return NodeLabels(
        accelerator=settings.kube_accelerator_label,
        nvlink=settings.kube_nvlink_label,
        rack=settings.kube_rack_label,
        block=settings.kube_block_label,
        price_tier=settings.kube_price_tier_label,
        gpu_resource=settings.kube_gpu_resource,
        accelerator_resources=dict(settings.kube_accelerator_resources),
        quarantine_taint=settings.kube_quarantine_taint,
        pinned=tuple(settings.kube_pinned_labels),
    )


def device_loss_kind(settings: ExecutorSettings) -> SignalKind:
    return SignalKind(settings.kube_device_loss_probe)


def provisioning_options(settings: ExecutorSettings, labels: NodeLabels) -> ProvisioningOptions:
    return ProvisioningOptions(
        namespace=settings.kube_namespace,
        cluster=settings.executor_cluster,
        pool_label=settings.kube_pool_label,
        provisioning_class=settings.kube_provisioning_class,
        resource=labels.resource,
        toleration_keys=tuple(settings.kube_toleration_keys),
        retry_failed_after_s=settings.kube_pool_retry_failed_after_s,
        timeout_s=settings.kube_provisioning_timeout_s,
    )
