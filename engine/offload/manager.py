"""OffloadManager: the scheduler's view of the host and disk tiers below the device pool.

It plans, the model runner moves bytes. Write path: when the block pool hands a cached block out for reuse,
the KV cache manager asks :meth:`should_save` and, unless a tier already holds that hash, records a
SaveBlock op ahead of anything that reuses the block; the runner reads the block to the host before the
step's forward and the engine hands the data back through :meth:`store`.

Read path: after the device prefix hit, :meth:`load_prefix` continues the chain of block hashes into the
host tier, then the disk tier (which verifies every block it reads: a bad file is a miss), and asks the KV
cache manager to allocate and register a block per hit with a LoadBlock op carrying the host data. At least
one prompt token is always left to compute (its logits are what the step is for).

Swap preemption: :meth:`swap_out` records saves of a preempted sequence's computed full blocks, so its
resume pulls them back instead of recomputing them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from pagoda.engine.kv_cache.hashing import BlockHash, hash_block_tokens
from pagoda.engine.kv_cache.manager import KVCacheManager
from pagoda.engine.kv_cache.ops import SaveBlock
from pagoda.engine.offload.disk_tier import DiskTier
from pagoda.engine.offload.host_tier import HostTier

log = logging.getLogger("pagoda.engine.offload")


class OffloadManager:
    def __init__(
        self,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        host_bytes: int,
        disk_dir: str | None = None,
        disk_bytes: int | None = None,
        identity: str = "",
        pin_memory: bool = False,
    ) -> None:
        """``block_shape``: one block, all layers: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        self.dtype = dtype
        self.block_shape = tuple(block_shape)
        self.block_bytes = torch.empty((), dtype=dtype).element_size() * int(torch.Size(block_shape).numel())
        self.disk: DiskTier | None = None
        if disk_dir:
            if disk_bytes is None:
                raise ValueError("kv_offload_disk_bytes is required with kv_offload_disk_dir")
            self.disk = DiskTier(disk_dir, disk_bytes, identity)
        self.host: HostTier | None = None
        if host_bytes > 0:
            self.host = HostTier(host_bytes, on_evict=self._spill_to_disk if self.disk is not None else None)
        self._pin = pin_memory
        self.queries = {"host": 0, "disk": 0}  # tokens looked up past the device hit, cumulative
        self.hits = {"host": 0, "disk": 0}
        # One step's worth, drained by the engine.
        self._step_hits = {"host": 0, "disk": 0}
        self._step_seconds: dict[str, dict[str, list[float]]] = {}

    @property
    def tiers(self) -> list[HostTier | DiskTier]:
        return [t for t in (self.host, self.disk) if t is not None]

    # -- write path ------------------------------------------------------------------------------------
    def should_save(self, block_hash: BlockHash) -> bool:
        """An evicted or swapped-out block goes down unless a tier already holds its hash."""
        if self.host is not None:
            return not self.host.touch(block_hash)
        return self.disk is not None and block_hash not in self.disk

    def store(self, saved: list[tuple[BlockHash, torch.Tensor]], seconds: float = 0.0) -> None:
        """Put blocks the runner read from the device into the first tier (host, else disk)."""
        tier = self.host if self.host is not None else self.disk
        if tier is None or not saved:
            return
        start = time.perf_counter()
        for block_hash, data in saved:
            tier.put(block_hash, data)
        if tier is self.host:
            self._observe("host", "store_seconds", seconds + time.perf_counter() - start)

    def store_to(self, tier_name: str, saved: list[tuple[BlockHash, torch.Tensor]]) -> None:
        """Put blocks straight into one tier ("host", or "disk", which also drains the host tier)."""
        target = self.host if tier_name == "host" else self.disk
        if target is None:
            raise ValueError(f"no {tier_name} tier is configured")
        for block_hash, data in saved:
            target.put(block_hash, data)
        if tier_name == "disk":
            if self.host is not None:
                for block_hash, data in self.host.pop_all():
                    self.disk.put(block_hash, data)
            self.disk.flush()

    def _spill_to_disk(self, block_hash: BlockHash, data: torch.Tensor) -> None:
        if self.disk is not None:
            self.disk.put(block_hash, data)

    def swap_out(self, kv: KVCacheManager, seq_id: str) -> None:
        """Record saves of a preempted sequence's cached (computed, full) blocks, before it frees them."""
        if self.tiers:
            kv.save_blocks(seq_id)

    def persist_ops(self, kv: KVCacheManager) -> list[SaveBlock]:
        """Saves of every cached device block that no tier holds yet (for a clean shutdown)."""
        return [
            SaveBlock(b.block_id, h)
            for h, b in kv.block_pool.cached.items()
            if (self.disk is None or h not in self.disk) and (self.host is None or h not in self.host)
        ]

    # -- read path -------------------------------------------------------------------------------------
    def load_prefix(
        self, kv: KVCacheManager, seq_id: str, token_ids: Sequence[int], num_hit_tokens: int
    ) -> int:
        """Extend ``seq_id``'s device prefix hit of ``num_hit_tokens`` with blocks from the lower tiers;
        returns how many tokens will be loaded (a multiple of the block size)."""
        tiers = self.tiers
        if not tiers or not kv.enable_prefix_caching:
            return 0
        bs = kv.block_size
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        first = num_hit_tokens // bs
        if first >= max_blocks:
            return 0
        hashes = kv.get_block_hashes(seq_id)
        parent = hashes[first - 1] if first > 0 else kv.chain_root(seq_id)
        extra = kv.extra_key_bytes
        found: list[tuple[BlockHash, torch.Tensor, str]] = []
        disk_from = max_blocks  # first block the disk tier was asked about
        start = time.perf_counter()
        for i in range(first, max_blocks):
            if i < len(hashes):
                block_hash = hashes[i]
            else:
                block_hash = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], extra)
            parent = block_hash
            if kv.block_pool.get_cached_block(block_hash) is not None:
                break  # cached on the device under another sequence's chain: leave it to the lookup
            got = self._lookup(block_hash)
            if got is None or got[1] == "disk":
                disk_from = min(disk_from, i)
            if got is None:
                break
            found.append((block_hash, *got))
        if self.host is not None:
            self.queries["host"] += (max_blocks - first) * bs
        if self.disk is not None:
            self.queries["disk"] += (max_blocks - disk_from) * bs
        if not found:
            return 0
        n = kv.load_blocks(seq_id, [h for h, _, _ in found], [d for _, d, _ in found])
        found = found[:n]
        elapsed = time.perf_counter() - start
        for name in ("host", "disk"):
            loaded = sum(bs for _, _, src in found if src == name)
            if loaded:
                self.hits[name] += loaded
                self._step_hits[name] += loaded
        n_host = sum(1 for _, _, src in found if src == "host")
        if n_host and found:
            self._observe("host", "load_seconds", elapsed * n_host / len(found))
        return n * bs

    def _lookup(self, block_hash: BlockHash) -> tuple[torch.Tensor, str] | None:
        if self.host is not None:
            data = self.host.get(block_hash)
            if data is not None:
                return data, "host"
        if self.disk is not None:
            start = time.perf_counter()
            data = self.disk.get(block_hash, self.block_shape, self.dtype)
            if data is not None:
                if self._pin:
                    data = data.pin_memory()
                if self.host is not None:
                    self.host.put(block_hash, data)  # disk -> host -> device
                self._observe("disk", "read_seconds", time.perf_counter() - start)
                return data, "disk"
        return None

    # -- stats -----------------------------------------------------------------------------------------
    def _observe(self, tier: str, key: str, seconds: float) -> None:
        self._step_seconds.setdefault(tier, {}).setdefault(key, []).append(seconds)

    def take_step_stats(self) -> tuple[dict[str, int], dict[str, dict[str, list[float]]]]:
        """(tokens loaded per source, latency lists per tier) since the last call."""
        hits = {k: v for k, v in self._step_hits.items() if v}
        self._step_hits = {"host": 0, "disk": 0}
        seconds, self._step_seconds = self._step_seconds, {}
        if self.disk is not None:
            stores = self.disk.take_store_seconds()
            if stores:
                seconds.setdefault("disk", {})["store_seconds"] = stores
        for per_tier in seconds.values():
            reads = per_tier.pop("read_seconds", None)
            if reads:
                per_tier.setdefault("load_seconds", []).extend(reads)
        return hits, seconds

    def snapshot(self) -> dict[str, dict[str, float]]:
        out = {}
        for tier in self.tiers:
            snap = tier.snapshot()
            snap["queries"] = float(self.queries[tier.name])
            snap["hits"] = float(self.hits[tier.name])
            out[tier.name] = snap
        return out

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        """Stop the disk writer (after the engine stored its last saves)."""
        if self.disk is not None:
            if self.disk.enabled and self.host is not None:
                for block_hash, data in self.host.items():
                    self.disk.put(block_hash, data)
            self.disk.close()
