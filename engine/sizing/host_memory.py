"""How much memory the KV cache may take, measured rather than assumed."""

from __future__ import annotations

from pathlib import Path

CPU_KV_FRACTION = 0.2  # share of the memory available to this process (cgroup-aware) on CPU


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text.split()[0])
    except ValueError:
        return None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_host_memory_bytes() -> int:
    """Memory this process can still use: the cgroup's limit minus its usage, or MemAvailable if lower."""
    candidates = []
    limit = _read_int("/sys/fs/cgroup/memory.max")
    usage = _read_int("/sys/fs/cgroup/memory.current")
    if limit is None:  # cgroup v1
        limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        usage = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
        if limit is not None and limit > 1 << 60:  # v1 reports "unlimited" as a huge number
            limit = None
    if limit is not None:
        candidates.append(max(limit - (usage or 0), 0))
    avail = _meminfo_available()
    if avail is not None:
        candidates.append(avail)
    return min(candidates) if candidates else 4 << 30


def cpu_kv_cache_bytes(ranks: int = 1) -> int:
    """One rank's KV budget on CPU: the tensor-parallel ranks of an engine share the host's memory."""
    return int(available_host_memory_bytes() * CPU_KV_FRACTION) // max(ranks, 1)
