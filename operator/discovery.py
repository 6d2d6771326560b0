"""GPU discovery: which GPU products the schedulable nodes carry, read from GPU Feature Discovery labels."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.sizing import GPUInfo, SizingError, lookup_gpu, parse_gfd_labels

LABEL_PRODUCT = "nvidia.com/gpu.product"


@dataclass(frozen=True)
class NodeGPUs:
    """One schedulable node's GPUs as the operator needs them (hashable, so inventories compare cheaply)."""

    node: str
    product_label: str
    memory_mib: int
    count: int
    compute_major: int
    compute_minor: int
    labels: tuple[tuple[str, str], ...] = ()

    def info(self) -> GPUInfo:
        return parse_gfd_labels(dict(self.labels))


@dataclass
class GPUPool:
    """All schedulable nodes with the same product label."""

    product_label: str
    info: GPUInfo
    nodes: list[str] = field(default_factory=list)
    gpus_per_node: int = 0  # the most any one node has


def node_gpus(node: dict[str, Any]) -> NodeGPUs | None:
    """The GPUs of a schedulable, Ready node with GFD labels; None for anything else."""
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    if LABEL_PRODUCT not in labels:
        return None
    if (node.get("spec") or {}).get("unschedulable"):
        return None
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") != "True":
            return None
    gfd = {k: str(v) for k, v in labels.items() if k.startswith("nvidia.com/gpu.")}
    try:
        info = parse_gfd_labels(gfd)
    except SizingError:
        return None
    allocatable = ((node.get("status") or {}).get("allocatable") or {}).get("nvidia.com/gpu")
    count = info.count
    if allocatable is not None:
        try:
            count = int(allocatable)
        except ValueError:
            pass
    major, minor = info.compute_capability
    return NodeGPUs(
        node=meta.get("name", ""),
        product_label=labels[LABEL_PRODUCT],
        memory_mib=info.memory_mib,
        count=count,
        compute_major=major,
        compute_minor=minor,
        labels=tuple(sorted(gfd.items())),
    )


def pools(nodes: Iterable[NodeGPUs]) -> dict[str, GPUPool]:
    """Group nodes by product label, sorted by label so every choice made from them is deterministic."""
    out: dict[str, GPUPool] = {}
    for gpus in sorted(nodes, key=lambda n: (n.product_label, n.node)):
        pool = out.get(gpus.product_label)
        if pool is None:
            pool = out[gpus.product_label] = GPUPool(gpus.product_label, gpus.info())
        pool.nodes.append(gpus.node)
        pool.gpus_per_node = max(pool.gpus_per_node, gpus.count)
    return out


def matching_pools(product: str, available: dict[str, GPUPool]) -> list[GPUPool]:
    """Pools whose GPU is the asked-for product; raises SizingError if the product is unknown.

    A label (NVIDIA-L40S) matches that GPU; a bare family name (H100, A100) matches every variant of it, so
    `product: H100` schedules on SXM and PCIe nodes alike.
    """
    if product in available:
        return [available[product]]
    wanted = lookup_gpu(product)
    family = product.strip().upper()
    bare = not family.startswith(("NVIDIA-", "TESLA-"))

    def matches(pool: GPUPool) -> bool:
        spec = pool.info.spec
        if spec is None:
            return False
        name = spec.name.upper()
        return spec.name == wanted.name or (bare and (name == family or name.startswith(family + "-")))

    return [p for p in available.values() if matches(p)]
