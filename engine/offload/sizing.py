"""Default host-tier size when ``--kv-offload-host-bytes`` is not given, by the sizing plan's rule."""

from __future__ import annotations

from pagoda.engine.sizing.host_memory import _read_int
from pagoda.engine.sizing.planner import HOST_LIMIT_SHARE, HOST_RUNTIME_BYTES

SWAP_SHARE_CPU = 0.1  # CPU + swap: this share of the memory still available, for preempted sequences


def pod_memory_limit_bytes() -> int | None:
    """The cgroup's memory limit (v2, then v1), or None when unlimited."""
    limit = _read_int("/sys/fs/cgroup/memory.max")
    if limit is None:
        limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        if limit is not None and limit > 1 << 60:
            limit = None
    return limit


def default_host_bytes(device_type: str, *, swap: bool = False) -> int:
    """GPU: 90% of the pod's memory limit minus the runtime reserve (0 with no limit: never sized from the
    node's total RAM). CPU: the KV cache already lives in host RAM, so no tier, unless swap preemption
    asks for one (a share of the memory still available)."""
    if device_type == "cpu":
        if not swap:
            return 0
        from pagoda.engine.sizing.host_memory import available_host_memory_bytes

        return int(available_host_memory_bytes() * SWAP_SHARE_CPU)
    limit = pod_memory_limit_bytes()
    if limit is None:
        return 0
    return max(int(limit * HOST_LIMIT_SHARE) - HOST_RUNTIME_BYTES, 0)
