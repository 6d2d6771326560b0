"""Host-RAM tier: the middle floor of the pagoda, an LRU of KV blocks kept in (pinned) CPU memory.

A block is one tensor ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` keyed by its chained hash.
What falls out of the LRU is handed to ``on_evict`` (the disk tier) so it can sink one floor further.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch
from pagoda.engine.kv_cache.hashing import BlockHash

SpillHook = Callable[[BlockHash, torch.Tensor], None]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HostTier:
    """LRU within a byte budget. ``used_bytes`` never exceeds ``capacity_bytes``."""

    name = "host"

    def __init__(self, capacity_bytes: int, on_evict: SpillHook | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"kv_offload_host_bytes must not be negative, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.on_evict = on_evict
        self._blocks: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.evictions = 0
        self.store_bytes = 0
        self.load_bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def put(self, block_hash: BlockHash, data: torch.Tensor) -> bool:
        """Keep ``data`` (owned by the tier from now on) under ``block_hash``; False if it can never fit."""
        size = tensor_bytes(data)
        if size > self.capacity_bytes:
            return False
        spilled: list[tuple[BlockHash, torch.Tensor]] = []
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return True
            while self.used_bytes + size > self.capacity_bytes:
                old_hash, old = self._blocks.popitem(last=False)
                self.used_bytes -= tensor_bytes(old)
                self.evictions += 1
                spilled.append((old_hash, old))
            self._blocks[block_hash] = data
            self.used_bytes += size
            self.store_bytes += size
        if self.on_evict is not None:
            for old_hash, old in spilled:
                self.on_evict(old_hash, old)
        return True

    def touch(self, block_hash: BlockHash) -> bool:
        """Mark the block most recently used; False when the tier does not hold it."""
        with self._lock:
            if block_hash not in self._blocks:
                return False
            self._blocks.move_to_end(block_hash)
            return True

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block (most recently used from now on), or None."""
        with self._lock:
            data = self._blocks.get(block_hash)
            if data is None:
                return None
            self._blocks.move_to_end(block_hash)
            self.load_bytes += tensor_bytes(data)
            return data

    def items(self) -> list[tuple[BlockHash, torch.Tensor]]:
        """Oldest first (a copy of the list: safe to iterate while the tier changes)."""
        with self._lock:
            return list(self._blocks.items())

    def pop_all(self) -> list[tuple[BlockHash, torch.Tensor]]:
        """Empty the tier (no spill); oldest first."""
        with self._lock:
            out = list(self._blocks.items())
            self._blocks.clear()
            self.used_bytes = 0
        return out

    def snapshot(self) -> dict[str, float]:
        return {
            "bytes_used": float(self.used_bytes),
            "bytes_capacity": float(self.capacity_bytes),
            "blocks": float(len(self._blocks)),
            "load_bytes": float(self.load_bytes),
            "store_bytes": float(self.store_bytes),
            "evictions": float(self.evictions),
        }
