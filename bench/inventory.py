"""A cluster's inventory event (`cluster.capacity`) of identical nodes, for benchmarks and tests
that feed a scheduler without an executor."""

from __future__ import annotations

from schemas.events import ClusterCapacity, NodeInfo


def inventory(
    cluster: str = "c1",
    kind: str = "H100",
    count: int = 2,
    *,
    devices: int = 8,
    cpu: float = 64,
    memory_gb: float = 512,
    name: str = "n{i}",
    rack_size: int = 0,
    block_size: int = 0,
    generation: str = "hopper",
    relative_speed: float = 3.0,
    tier: str = "reserved",
) -> ClusterCapacity:
    """`count` nodes named by `name` (formatted with `i` and `cluster`); racks and blocks of
    `rack_size` and `block_size` nodes (0: all in one), an NVLink domain each."""
    return ClusterCapacity(
        cluster=cluster,
        location="here",
        kind="on_prem",
        prices={kind: {tier: 2.0}},
        nodes=[
            NodeInfo(
                node_id=name.format(i=i, cluster=cluster),
                block=f"b{i // block_size}" if block_size else "b",
                rack=f"r{i // rack_size}" if rack_size else "r",
                nvlink_domain=f"{cluster}-d{i}",
                accelerator_type=kind,
                generation=generation,
                accelerator_memory_gb=80,
                relative_speed=relative_speed,
                accelerators=devices,
                cpu=cpu,
                memory_gb=memory_gb,
                price_tier=tier,
            )
            for i in range(count)
        ],
    )
