"""Sub-block prefix reuse: cached full blocks by their parent's hash, with the token ids they hold.

A prefix hit by chained hashes stops at the last whole block that matches. The block after it may still
share its first k tokens with a cached block that continues the same parent: this index finds that block,
so the KV cache manager can copy it into a fresh block and count k more tokens as computed. The manager
keeps the index in step with the block pool's cache index (add when a block is registered, remove when it
is evicted or the cache is reset).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.engine.kv_cache.hashing import BlockHash

_ROOT = b""  # parent key of a sequence's first block


class PartialBlockIndex:
    """parent hash -> {block_id: token ids of that cached full block}."""

    def __init__(self) -> None:
        self._children: dict[bytes, dict[int, tuple[int, ...]]] = {}
        self._parent_of: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._parent_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._parent_of

    def add(self, block_id: int, parent: BlockHash | None, token_ids: Sequence[int]) -> None:
        """Index a block just registered in the cache under a hash whose parent is ``parent``."""
        if block_id in self._parent_of:
            self.remove(block_id)
        key = _ROOT if parent is None else bytes(parent)
        self._children.setdefault(key, {})[block_id] = tuple(token_ids)
        self._parent_of[block_id] = key

    def remove(self, block_id: int) -> None:
        """Forget a block (evicted); unknown ids are ignored."""
        key = self._parent_of.pop(block_id, None)
        if key is None:
            return
        siblings = self._children[key]
        del siblings[block_id]
        if not siblings:
            del self._children[key]

    def clear(self) -> None:
        self._children.clear()
        self._parent_of.clear()

    def best_match(
        self, parent: BlockHash | None, token_ids: Sequence[int], max_tokens: int
    ) -> tuple[int, int] | None:
        """(block_id, k): the cached child of ``parent`` whose first k tokens equal ``token_ids[:k]``, k as
        large as possible but at most ``max_tokens``; None when no child shares even one token."""
        siblings = self._children.get(_ROOT if parent is None else bytes(parent))
        if not siblings or max_tokens < 1:
            return None
        want = tuple(token_ids[:max_tokens])
        best: tuple[int, int] | None = None
        for block_id, held in siblings.items():
            k = 0
            for a, b in zip(held, want, strict=False):
                if a != b:
                    break
                k += 1
            if k and (best is None or k > best[1]):
                best = (block_id, k)
                if k == len(want):
                    break
        return best

    def items(self) -> list[tuple[int, bytes, tuple[int, ...]]]:
        """(block_id, parent key, token ids) of every indexed block. For checks and tests."""
        return [(b, key, self._children[key][b]) for b, key in self._parent_of.items()]
