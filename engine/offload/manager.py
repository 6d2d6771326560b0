"""OffloadManager: moves KV blocks between the device pool and the host and disk tiers.

Write path: the block pool's eviction hook records (block id, hash) of cached blocks it hands out for
reuse; the new owner only writes during the next forward, so :meth:`save_evicted` (called by the engine
after ``schedule()`` and before anything writes KV) still finds the data intact and copies it down a tier.

Read path: after the device prefix hit, :meth:`load_prefix` continues the chain of block hashes into the
host tier, then the disk tier, and writes every found block into a fresh device block registered under
its hash, so the scheduler counts those tokens as computed. At least one prompt token is always left to
compute (its logits are what the step is for).

Swap preemption: :meth:`swap_out` copies a preempted sequence's computed full blocks to the host tier at
once, so its resume pulls them back instead of recomputing them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from pagoda.engine.attention.base import LayerKVCache
from pagoda.engine.kv_cache.hashing import BlockHash, hash_block_tokens
from pagoda.engine.kv_cache.manager import KVCacheManager
from pagoda.engine.offload.disk_tier import DiskTier
from pagoda.engine.offload.host_tier import HostTier

log = logging.getLogger("pagoda.engine.offload")


class OffloadManager:
    def __init__(
        self,
        kv: KVCacheManager,
        kv_caches: list[LayerKVCache],
        *,
        host_bytes: int,
        disk_dir: str | None = None,
        disk_bytes: int | None = None,
        identity: str = "",
    ) -> None:
        self.kv = kv
        self.kv_caches = kv_caches
        first = kv_caches[0].kv
        self.device = first.device
        self.dtype = first.dtype
        # One block, all layers: [num_layers, 2, block_size, num_kv_heads, head_dim].
        self.block_shape = (len(kv_caches), *first.shape[:1], *first.shape[2:])
        self.block_bytes = first.element_size() * int(torch.Size(self.block_shape).numel())
        self.disk: DiskTier | None = None
        if disk_dir:
            if disk_bytes is None:
                raise ValueError("kv_offload_disk_bytes is required with kv_offload_disk_dir")
            self.disk = DiskTier(disk_dir, disk_bytes, identity)
        self.host: HostTier | None = None
        if host_bytes > 0:
            self.host = HostTier(host_bytes, on_evict=self._spill_to_disk if self.disk is not None else None)
        self._pin = self.device.type == "cuda"
        self._evicted: list[tuple[int, BlockHash]] = []
        self.queries = {"host": 0, "disk": 0}  # tokens looked up past the device hit, cumulative
        self.hits = {"host": 0, "disk": 0}
        # One step's worth, drained by the engine.
        self._step_hits = {"host": 0, "disk": 0}
        self._step_seconds: dict[str, dict[str, list[float]]] = {}
        kv.block_pool.on_evict = self._on_device_evict

    @property
    def tiers(self) -> list[HostTier | DiskTier]:
        return [t for t in (self.host, self.disk) if t is not None]

    # -- write path ------------------------------------------------------------------------------------
    def _on_device_evict(self, block_id: int, block_hash: BlockHash) -> None:
        self._evicted.append((block_id, block_hash))

    def save_evicted(self) -> None:
        """Copy the blocks evicted since the last call down a tier. Must run before any KV write."""
        if not self._evicted:
            return
        evicted, self._evicted = self._evicted, []
        todo = [(bid, h) for bid, h in evicted if not self._held_below(h)]
        if todo:
            self._store([bid for bid, _ in todo], [h for _, h in todo])

    def _held_below(self, block_hash: BlockHash) -> bool:
        if self.host is not None and self.host.touch(block_hash):
            return True
        return self.host is None and self.disk is not None and block_hash in self.disk

    def _store(self, block_ids: list[int], hashes: list[BlockHash]) -> None:
        start = time.perf_counter()
        data = self._gather(block_ids)
        tier = self.host if self.host is not None else self.disk
        if tier is None:
            return
        for i, block_hash in enumerate(hashes):
            tier.put(block_hash, data[i])
        if tier is self.host:
            self._observe("host", "store_seconds", time.perf_counter() - start)

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """[n, num_layers, 2, block_size, kv_heads, head_dim] on the host (pinned on CUDA)."""
        ids = torch.tensor(block_ids, device=self.device)
        out = torch.empty((len(block_ids), *self.block_shape), dtype=self.dtype, pin_memory=self._pin)
        for layer, cache in enumerate(self.kv_caches):
            out[:, layer].copy_(cache.kv.index_select(1, ids).transpose(0, 1), non_blocking=self._pin)
        if self._pin:
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def _spill_to_disk(self, block_hash: BlockHash, data: torch.Tensor) -> None:
        if self.disk is not None:
            self.disk.put(block_hash, data)

    def swap_out(self, block_ids: Sequence[int]) -> None:
        """Push a preempted sequence's cached (computed, full) blocks to the first tier now."""
        if not self.tiers:
            return
        pool = self.kv.block_pool
        todo = []
        for bid in block_ids:
            block_hash = pool.blocks[bid].block_hash
            if block_hash is not None and not self._held_below(block_hash):
                todo.append((bid, block_hash))
        if todo:
            self.save_evicted()  # keep the order: older evictions first
            self._store([bid for bid, _ in todo], [h for _, h in todo])

    # -- read path -------------------------------------------------------------------------------------
    def load_prefix(self, seq_id: str, token_ids: Sequence[int], num_hit_tokens: int) -> int:
        """Extend ``seq_id``'s device prefix hit of ``num_hit_tokens`` with blocks from the lower tiers;
        returns how many tokens were loaded (a multiple of the block size)."""
        tiers = self.tiers
        if not tiers or not self.kv.enable_prefix_caching:
            return 0
        bs = self.kv.block_size
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        first = num_hit_tokens // bs
        if first >= max_blocks:
            return 0
        hashes = self.kv.get_block_hashes(seq_id)
        parent = hashes[first - 1] if first > 0 else None
        extra = self.kv._extra
        found: list[tuple[BlockHash, torch.Tensor, str]] = []
        disk_from = max_blocks  # first block the disk tier was asked about
        for i in range(first, max_blocks):
            if i < len(hashes):
                block_hash = hashes[i]
            else:
                block_hash = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], extra)
            parent = block_hash
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
        self.save_evicted()
        blocks = []
        for block_hash, _, _ in found:
            block = self.kv.block_pool.insert_external(block_hash)
            if block is None:
                break
            blocks.append(block)
        self.save_evicted()  # insert_external may have evicted blocks whose data must go down first
        if not blocks:
            return 0
        found = found[: len(blocks)]
        start = time.perf_counter()
        self._scatter([b.block_id for b in blocks], [d for _, d, _ in found])
        elapsed = time.perf_counter() - start
        self.kv.append_loaded_blocks(seq_id, blocks, [h for h, _, _ in found])
        for name in ("host", "disk"):
            n = sum(bs for _, _, src in found if src == name)
            if n:
                self.hits[name] += n
                self._step_hits[name] += n
        n_host = sum(1 for _, _, src in found if src == "host")
        if n_host:
            self._observe("host", "load_seconds", elapsed * n_host / len(found))
        return len(blocks) * bs

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

    def _scatter(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        ids = torch.tensor(block_ids, device=self.device)
        stacked = torch.stack(data)  # [n, L, 2, bs, H, D] on the host
        if self._pin:
            stacked = stacked.to(self.device, non_blocking=True)
        for layer, cache in enumerate(self.kv_caches):
            cache.kv.index_copy_(1, ids, stacked[:, layer].transpose(0, 1))

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

    def demote_cached(self, tier: str = "host") -> int:
        """Move every unreferenced cached device block down to ``tier`` ("host", or "disk", which also
        drains the host tier) and forget it on the device; returns the blocks moved. For benchmarks and
        draining an idle engine; refused (0) while any block is in use."""
        pool = self.kv.block_pool
        if pool.num_used_blocks > 0:
            return 0
        target = self.host if tier == "host" else self.disk
        if target is None:
            raise ValueError(f"no {tier} tier is configured")
        self.save_evicted()
        todo = [(b.block_id, h) for h, b in pool.cached.items()]
        for i in range(0, len(todo), 64):
            part = todo[i : i + 64]
            data = self._gather([bid for bid, _ in part])
            for j, (_, block_hash) in enumerate(part):
                target.put(block_hash, data[j])
        if tier == "disk":
            if self.host is not None:
                for block_hash, data in self.host.pop_all():
                    self.disk.put(block_hash, data)
            self.disk.flush()
        self.kv.reset_prefix_cache()
        return len(todo)

    def close(self, persist: bool = True) -> None:
        """Stop the disk writer. With ``persist``, first write the device's cached blocks and the host
        tier down to disk, so a restart on the same directory serves every prefix this engine knew."""
        if self.disk is None:
            return
        if persist and self.disk.enabled:
            self.save_evicted()
            pool = self.kv.block_pool
            cached = [(bid, h) for h, bid in ((h, b.block_id) for h, b in pool.cached.items())]
            todo = [
                (bid, h)
                for bid, h in cached
                if h not in self.disk and (self.host is None or h not in self.host)
            ]
            for i in range(0, len(todo), 64):
                part = todo[i : i + 64]
                data = self._gather([bid for bid, _ in part])
                for j, (_, block_hash) in enumerate(part):
                    self.disk.put(block_hash, data[j])
            if self.host is not None:
                for block_hash, data in self.host.items():
                    self.disk.put(block_hash, data)
        self.disk.close()
