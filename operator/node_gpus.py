"""Which GPU a node has when GPU Feature Discovery's labels are missing: GKE's accelerator label, or a
well-known cloud instance type. Each answer names a GPU of the sizing catalogue and, for instance types,
how many the machine has (the device plugin's allocatable count wins where there is one)."""

from __future__ import annotations

import re

GKE_ACCELERATOR = "cloud.google.com/gke-accelerator"
INSTANCE_TYPE = ("node.kubernetes.io/instance-type", "beta.kubernetes.io/instance-type")
# cloud.google.com/gke-accelerator value -> catalogue name
GKE_ACCELERATORS = {
    "nvidia-tesla-t4": "T4",
    "nvidia-tesla-v100": "V100-16GB",
    "nvidia-tesla-a100": "A100-40GB-SXM",
    "nvidia-a100-80gb": "A100-80GB-SXM",
    "nvidia-l4": "L4",
    "nvidia-h100-80gb": "H100-SXM",
    "nvidia-h100-mega-80gb": "H100-SXM",
    "nvidia-h200-141gb": "H200",
    "nvidia-b200": "B200",
}
# instance type (a whole-string pattern) -> (catalogue name, GPUs; None: from the pattern's group `n`)
_SIZES_4_8 = {"12xlarge": 4, "24xlarge": 4, "48xlarge": 8}  # g5 / g6 / g6e: the big sizes, else 1
INSTANCE_TYPES: list[tuple[str, str, int | None]] = [
    # AWS
    (r"p5\.48xlarge", "H100-SXM", 8),
    (r"p5en?\.48xlarge", "H200", 8),
    (r"p6-b200\.48xlarge", "B200", 8),
    (r"p4d\.24xlarge", "A100-40GB-SXM", 8),
    (r"p4de\.24xlarge", "A100-80GB-SXM", 8),
    (r"g5\.\w+", "A10G", 0),
    (r"g6\.\w+", "L4", 0),
    (r"g6e\.\w+", "L40S", 0),
    (r"g4dn\.(12xlarge)", "T4", 4),
    (r"g4dn\.metal", "T4", 8),
    (r"g4dn\.\w+", "T4", 1),
    # Google Cloud
    (r"a3-(?:high|mega|edge)gpu-(?P<n>\d+)g", "H100-SXM", None),
    (r"a3-ultragpu-(?P<n>\d+)g", "H200", None),
    (r"a4-highgpu-(?P<n>\d+)g", "B200", None),
    (r"a2-(?:high|mega)gpu-(?P<n>\d+)g", "A100-40GB-SXM", None),
    (r"a2-ultragpu-(?P<n>\d+)g", "A100-80GB-SXM", None),
    (r"g2-standard-(?:24)", "L4", 2),
    (r"g2-standard-(?:48)", "L4", 4),
    (r"g2-standard-(?:96)", "L4", 8),
    (r"g2-standard-\d+", "L4", 1),
    # Azure
    (r"Standard_ND96isr_H100_v5", "H100-SXM", 8),
    (r"Standard_ND96isr_H200_v5", "H200", 8),
    (r"Standard_ND96asr_v4", "A100-40GB-SXM", 8),
    (r"Standard_ND96amsr_A100_v4", "A100-80GB-SXM", 8),
    (r"Standard_NC24ads_A100_v4", "A100-80GB-PCIe", 1),
    (r"Standard_NC48ads_A100_v4", "A100-80GB-PCIe", 2),
    (r"Standard_NC96ads_A100_v4", "A100-80GB-PCIe", 4),
    (r"Standard_NC40ads_H100_v5", "H100-NVL", 1),
    (r"Standard_NC80adis_H100_v5", "H100-NVL", 2),
    (r"Standard_NC64as_T4_v3", "T4", 4),
    (r"Standard_NC\d+as_T4_v3", "T4", 1),
]


def from_labels(labels: dict[str, str]) -> tuple[str, int | None, str] | None:
    """(catalogue name, GPU count or None, where it came from) for a node without GFD labels, or None."""
    accelerator = labels.get(GKE_ACCELERATOR)
    if accelerator:
        name = GKE_ACCELERATORS.get(accelerator.strip().lower())
        return (name, None, f"{GKE_ACCELERATOR}={accelerator}") if name else None
    for key in INSTANCE_TYPE:
        value = labels.get(key)
        if not value:
            continue
        for pattern, name, count in INSTANCE_TYPES:
            m = re.fullmatch(pattern, value)
            if m is None:
                continue
            if count is None:
                count = int(m.group("n"))
            elif count == 0:  # g5 / g6 / g6e: by size
                count = _SIZES_4_8.get(value.split(".", 1)[1], 1)
            return name, count, f"{key}={value}"
        return None
    return None
