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
    emulated_cluster,
    example,
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
    "emulated_cluster",
    "example",
    "node",
    "pod_of",
    "running_operator",
]
