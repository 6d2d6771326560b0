"""Pagoda's test kit: the emulated cluster (kmock's Kubernetes emulator over HTTP) and the operator under kopf.

Test code, never shipped: pytest puts tests/support on sys.path (pyproject.toml), the benchmark does the same.
"""

from pagoda_testkit.cluster import (
    CRD_FILE,
    EXAMPLES,
    GPU_NODES,
    INFD,
    ROOT,
    STS,
    Cluster,
    ClusterThread,
    chart_operator_args,
    emulated_cluster,
    example,
    kubeconfig,
    node,
    pod_of,
    running_operator,
)
from pagoda_testkit.emulator import PagodaEmulator

__all__ = [
    "CRD_FILE",
    "EXAMPLES",
    "GPU_NODES",
    "INFD",
    "ROOT",
    "STS",
    "Cluster",
    "ClusterThread",
    "PagodaEmulator",
    "chart_operator_args",
    "emulated_cluster",
    "example",
    "kubeconfig",
    "node",
    "pod_of",
    "running_operator",
]
