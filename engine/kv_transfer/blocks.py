"""The two block stores of a prefill/decode split, both bounded in bytes and in time.

`HeldBlocks` (producer): the host copies of a finished remote-prefill request's full prompt blocks, kept
until the decode engine fetches them (once) or `hold_seconds` pass; the device blocks themselves stay
ordinary prefix-cache blocks, so holding never takes KV space from running requests.

`StagedBlocks` (consumer): verified blocks received from a producer, keyed by their chained hash, until the
scheduler's prefix lookup loads them into the device cache (`load_prefix`, the same path the offload tiers
take). A staged block is used only where the consumer's own hash of its own prompt tokens equals the key,
so a producer that prefilled other tokens (or another model) can only cause a miss, never wrong KV.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pagoda.engine.kv_cache.hashing import BlockHash, hash_block_tokens
from pagoda.engine.offload.host_tier import tensor_bytes

DEFAULT_HOLD_SECONDS = 30.0
DEFAULT_HELD_BYTES = 1 << 30
DEFAULT_STAGED_BYTES = 1 << 30


@dataclass
class _Held:
    blocks: list[tuple[BlockHash, torch.Tensor]]
    nbytes: int
    deadline: float


class HeldBlocks:
    """Producer side: request id -> its prefilled blocks (host tensors), oldest dropped first past the
    budget; thread-safe (the engine step puts, the transfer server's threads take)."""

    def __init__(
        self, hold_seconds: float = DEFAULT_HOLD_SECONDS, max_bytes: int = DEFAULT_HELD_BYTES
    ) -> None:
        self.hold_seconds = float(hold_seconds)
        self.max_bytes = int(max_bytes)
        self._items: OrderedDict[str, _Held] = OrderedDict()
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.expired = 0  # entries released unfetched (time or budget)

    def __len__(self) -> int:
        return len(self._items)

    def put(self, request_id: str, blocks: list[tuple[BlockHash, torch.Tensor]]) -> None:
        nbytes = sum(tensor_bytes(t) for _, t in blocks)
        with self._lock:
            self._expire(time.monotonic())
            old = self._items.pop(request_id, None)
            if old is not None:
                self.used_bytes -= old.nbytes
            while self._items and self.used_bytes + nbytes > self.max_bytes:
                self._drop_oldest()
            if nbytes > self.max_bytes:
                self.expired += 1
                return
            self._items[request_id] = _Held(blocks, nbytes, time.monotonic() + self.hold_seconds)
            self.used_bytes += nbytes

    def take(self, request_id: str) -> list[tuple[BlockHash, torch.Tensor]] | None:
        """The request's blocks, released from the store (a second fetch gets None)."""
        with self._lock:
            self._expire(time.monotonic())
            held = self._items.pop(request_id, None)
            if held is None:
                return None
            self.used_bytes -= held.nbytes
            return held.blocks

    def expire(self) -> None:
        with self._lock:
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        while self._items:
            first = next(iter(self._items.values()))
            if first.deadline > now:
                return
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, held = self._items.popitem(last=False)
        self.used_bytes -= held.nbytes
        self.expired += 1


class StagedBlocks:
    """Consumer side: verified received blocks by hash, LRU within a byte budget and a time limit; read by the
    scheduler's thread only (staging runs between steps, on the same thread)."""

    def __init__(self, max_bytes: int = DEFAULT_STAGED_BYTES, ttl_seconds: float = 120.0) -> None:
        self.max_bytes = int(max_bytes)
        self.ttl_seconds = float(ttl_seconds)
        self._blocks: OrderedDict[BlockHash, tuple[torch.Tensor, float]] = OrderedDict()
        self.used_bytes = 0
        self.loaded_tokens = 0  # tokens a request took from here instead of computing them

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def put(self, block_hash: BlockHash, data: torch.Tensor) -> None:
        size = tensor_bytes(data)
        if size > self.max_bytes:
            return
        now = time.monotonic()
        self._expire(now)
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        while self._blocks and self.used_bytes + size > self.max_bytes:
            self._pop_oldest()
        self._blocks[block_hash] = (data, now + self.ttl_seconds)
        self.used_bytes += size

    def _pop_oldest(self) -> None:
        _, (old, _) = self._blocks.popitem(last=False)
        self.used_bytes -= tensor_bytes(old)

    def _expire(self, now: float) -> None:
        while self._blocks and next(iter(self._blocks.values()))[1] <= now:
            self._pop_oldest()

    def pop(self, block_hash: BlockHash) -> torch.Tensor | None:
        item = self._blocks.pop(block_hash, None)
        if item is None:
            return None
        self.used_bytes -= tensor_bytes(item[0])
        return item[0]

    def load_prefix(self, kv, seq_id: str, token_ids: Sequence[int], num_hit_tokens: int) -> int:
        """Extend ``seq_id``'s prefix hit of ``num_hit_tokens`` with staged blocks that continue its hash chain
        (`kv` is the KVCacheManager); returns the tokens loaded, a multiple of the block size. At least one
        prompt token is always left to compute: its logits are what the step is for."""
        if not self._blocks or not kv.enable_prefix_caching:
            return 0
        self._expire(time.monotonic())
        bs = kv.block_size
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        first = num_hit_tokens // bs
        if first >= max_blocks or num_hit_tokens % bs:
            return 0
        hashes = kv.get_block_hashes(seq_id)
        parent = hashes[first - 1] if first > 0 else kv.chain_root(seq_id)
        extra = kv.extra_key_bytes
        found: list[tuple[BlockHash, torch.Tensor]] = []
        for i in range(first, max_blocks):
            block_hash = (
                hashes[i]
                if i < len(hashes)
                else hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], extra)
            )
            parent = block_hash
            if block_hash not in self._blocks or kv.block_pool.get_cached_block(block_hash) is not None:
                break
            found.append((block_hash, self._blocks[block_hash][0]))
        if not found:
            return 0
        n = kv.load_blocks(seq_id, [h for h, _ in found], [d for _, d in found])
        for block_hash, _ in found[:n]:
            self.pop(block_hash)
        self.loaded_tokens += n * bs
        return n * bs
