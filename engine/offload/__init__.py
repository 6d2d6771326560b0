"""KV offload tiers below the device pool: host RAM, then a directory on local NVMe."""

from __future__ import annotations

import logging

import torch
from pagoda.engine.config import EngineConfig
from pagoda.engine.offload.disk_tier import DirectoryInUseError, DiskTier
from pagoda.engine.offload.host_tier import HostTier
from pagoda.engine.offload.manager import OffloadManager
from pagoda.engine.offload.sizing import default_host_bytes

log = logging.getLogger("pagoda.engine.offload")

__all__ = [
    "DirectoryInUseError",
    "DiskTier",
    "HostTier",
    "OffloadManager",
    "build_offload",
    "default_host_bytes",
]


def build_offload(
    config: EngineConfig,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    identity: str,
) -> OffloadManager | None:
    """The scheduler's offload manager, or None when no tier is configured. ``block_shape`` is one block
    of every layer: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
    host = config.host_tier_bytes
    if host is None:
        host = default_host_bytes(device.type, swap=config.preemption_mode == "swap")
    if host <= 0 and not config.kv_offload_disk_dir:
        if config.preemption_mode == "swap":
            log.warning("preemption_mode=swap without a host tier: preempted sequences will be recomputed")
        return None
    if not config.enable_prefix_caching:
        log.warning("KV offload tiers need prefix caching (block hashes are their keys); tiers are off")
        return None
    manager = OffloadManager(
        block_shape,
        dtype,
        pin_memory=device.type == "cuda",
        host_bytes=host,
        disk_dir=config.kv_offload_disk_dir,
        disk_bytes=config.kv_offload_disk_bytes,
        identity=identity,
    )
    log.info(
        "KV offload: host tier %s, disk tier %s",
        f"{host / 2**20:.0f} MiB" if manager.host is not None else "off",
        f"{config.kv_offload_disk_dir} ({(config.kv_offload_disk_bytes or 0) / 2**20:.0f} MiB)"
        if manager.disk is not None
        else "off",
    )
    return manager
