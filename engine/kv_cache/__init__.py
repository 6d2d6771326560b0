"""Paged KV cache bookkeeping: block pool, per-sequence block tables, prefix cache by chained hashes."""

from pagoda.engine.kv_cache.block_pool import Block, BlockPool, FreeBlockQueue
from pagoda.engine.kv_cache.hashing import BlockHash, encode_extra_keys, hash_block_tokens, hash_full_blocks
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
