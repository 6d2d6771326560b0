"""GPU discovery: which GPU products the schedulable nodes carry, read from GPU Feature Discovery labels, else
from GKE's accelerator label or a well-known instance type (node_gpus.py). A node that has GPUs (the device
plugin's `nvidia.com/gpu`, or `nvidia.com/gpu.present`) but none of these is kept as unidentified, so a
deployment that finds no GPU can say which nodes need a label."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.sizing import GPUInfo, SizingError, lookup_gpu, parse_gfd_labels
from pagoda.operator import node_gpus as fallback

LABEL_PRODUCT = "nvidia.com/gpu.product"
UNIDENTIFIED = ""  # product_label of a node with GPUs the operator cannot name
RENDERED_NODE = "(rendered)"  # the one node of a `pagoda render --gpu` pool: a plan may span any number
LWS_API = "leaderworkerset.x-k8s.io/v1"  # a replica spanning nodes: one LeaderWorkerSet group per replica
# The API groups the reconciler asks the API server about (Kube.has_api); each turns an optional object on.
PROMETHEUS_OPERATOR_API = "monitoring.coreos.com/v1"  # a ServiceMonitor per deployment
KEDA_API = "keda.sh/v1alpha1"  # a KEDA ScaledObject instead of the HorizontalPodAutoscaler
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"  # spec.gateway: an InferencePool and its picker


@dataclass(frozen=True)
class Capabilities:
    """What the cluster serves beyond Kubernetes itself, where the operator's objects depend on it: the
    reconciler discovers it, `pagoda render` (no cluster) is told it with flags."""

    prometheus_operator: bool = False  # PROMETHEUS_OPERATOR_API served
    keda: bool = False  # KEDA_API served
    lws: bool = False  # LWS_API served: a replica spanning nodes is a LeaderWorkerSet group
    gateway_api: bool = False  # INFERENCE_POOL_API served: spec.gateway's InferencePool and picker


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
    source: str = "GPU Feature Discovery"  # where the product came from (a label and its value otherwise)

    @property
    def identified(self) -> bool:
        return self.product_label != UNIDENTIFIED

    def info(self) -> GPUInfo:
        return parse_gfd_labels(dict(self.labels))


@dataclass
class GPUPool:
    """All schedulable nodes with the same product label."""

    product_label: str
    info: GPUInfo
    nodes: list[str] = field(default_factory=list)
    gpus_per_node: int = 0  # the most any one node has
    selector: dict[str, str] = field(default_factory=dict)  # the node label engine pods are placed by
    source: str = "GPU Feature Discovery"


def _selector(gpus: NodeGPUs) -> dict[str, str]:
    """GFD's product label, or the label the GPU was identified by (GKE's accelerator, the instance type)."""
    if "=" in gpus.source:
        key, _, value = gpus.source.partition("=")
        return {key: value}
    return {LABEL_PRODUCT: gpus.product_label}


def _allocatable(node: dict[str, Any]) -> int | None:
    value = ((node.get("status") or {}).get("allocatable") or {}).get("nvidia.com/gpu")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _gfd_like(name: str, count: int) -> dict[str, str]:
    """The labels GFD would write for a catalogue GPU (so one parser reads every node)."""
    spec = lookup_gpu(name)
    major, minor = spec.compute_capability
    return {
        LABEL_PRODUCT: spec.labels[0],
        "nvidia.com/gpu.memory": str(spec.memory_mib),
        "nvidia.com/gpu.count": str(count),
        "nvidia.com/gpu.compute.major": str(major),
        "nvidia.com/gpu.compute.minor": str(minor),
    }


def node_gpus(node: dict[str, Any]) -> NodeGPUs | None:
    """The GPUs of a schedulable, Ready node: from GFD labels, else GKE's accelerator label or the instance
    type; an unidentified NodeGPUs for a node with GPUs none of these name; None for anything else."""
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    if (node.get("spec") or {}).get("unschedulable"):
        return None
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") != "True":
            return None
    allocatable = _allocatable(node)
    source = "GPU Feature Discovery"
    if LABEL_PRODUCT in labels:
        gfd = {k: str(v) for k, v in labels.items() if k.startswith("nvidia.com/gpu.")}
    else:
        found = fallback.from_labels({k: str(v) for k, v in labels.items()})
        if found is None:
            has_gpus = (allocatable or 0) > 0 or str(
                labels.get("nvidia.com/gpu.present", "")
            ).lower() == "true"
            if not has_gpus:
                return None
            return NodeGPUs(meta.get("name", ""), UNIDENTIFIED, 0, allocatable or 0, 0, 0, source="")
        name, count, source = found
        gfd = _gfd_like(name, allocatable if allocatable is not None else count or 1)
    try:
        info = parse_gfd_labels(gfd)
    except SizingError:
        return None
    major, minor = info.compute_capability
    return NodeGPUs(
        node=meta.get("name", ""),
        product_label=gfd[LABEL_PRODUCT],
        memory_mib=info.memory_mib,
        count=allocatable if allocatable is not None else info.count,
        compute_major=major,
        compute_minor=minor,
        labels=tuple(sorted(gfd.items())),
        source=source,
    )


def unidentified(nodes: Iterable[NodeGPUs]) -> list[str]:
    """Names of the nodes with GPUs the operator cannot name."""
    return sorted(n.node for n in nodes if not n.identified)


def unidentified_message(names: list[str]) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"node(s) {shown} have NVIDIA GPUs the operator cannot identify: no GPU Feature Discovery labels "
        f"(nvidia.com/gpu.product), no {fallback.GKE_ACCELERATOR} it knows, no instance type it knows. Install "
        "GPU Feature Discovery (the NVIDIA GPU Operator does), or label the node, e.g. `kubectl label node "
        f"{names[0]} nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3 nvidia.com/gpu.memory=81559 "
        "nvidia.com/gpu.compute.major=9 nvidia.com/gpu.compute.minor=0`; the operator re-plans when it changes"
    )


def pools(nodes: Iterable[NodeGPUs]) -> dict[str, GPUPool]:
    """Group nodes by product label, sorted by label so every choice made from them is deterministic."""
    out: dict[str, GPUPool] = {}
    for gpus in sorted((n for n in nodes if n.identified), key=lambda n: (n.product_label, n.node)):
        # Nodes identified another way than by GFD form pools of their own: pods are placed by that label.
        key = gpus.product_label if "=" not in gpus.source else f"{gpus.product_label} ({gpus.source})"
        pool = out.get(key)
        if pool is None:
            pool = out[key] = GPUPool(
                gpus.product_label, gpus.info(), selector=_selector(gpus), source=gpus.source
            )
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
