"""Paged KV cache bookkeeping: block pool, per-sequence block tables, prefix cache by chained hashes.

Importing this package is torch-free (the router hashes block chains with it); KVCacheManager, which needs
torch, loads on first use.
"""

from typing import TYPE_CHECKING, Any

from pagoda.engine.kv_cache.block_pool import Block, BlockPool, FreeBlockQueue
from pagoda.engine.kv_cache.hashing import BlockHash, encode_extra_keys, hash_block_tokens, hash_full_blocks

if TYPE_CHECKING:  # pragma: no cover
    from pagoda.engine.kv_cache.manager import KVCacheManager

__all__ = [
    "Block",
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheManager",
    "encode_extra_keys",
    "hash_block_tokens",
    "hash_full_blocks",
]


def __getattr__(name: str) -> Any:
    if name == "KVCacheManager":
        from pagoda.engine.kv_cache.manager import KVCacheManager

        return KVCacheManager
    raise AttributeError(f"module 'pagoda.engine.kv_cache' has no attribute {name!r}")
