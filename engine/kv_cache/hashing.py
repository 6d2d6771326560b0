"""Chained block hashes: the identity of a full block of KV across sequences, processes and tiers.

A block's hash covers its parent's hash, its token ids and the extra keys (``cache_identity``),
so equal hashes mean equal KV for the whole prefix up to and including the block. SHA-256 over a fixed
byte encoding keeps the value stable across processes and machines (the disk tier names files by it);
Python's ``hash()`` is salted per process and must never be used here.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""32 bytes of SHA-256. ``block_hash.hex()`` is the name to use for files and logs."""

HASH_VERSION = b"pagoda-kv-block-hash-v1"
_NO_PARENT = bytes(32)
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def cache_identity(
    fingerprint: str, compute_dtype: object, kv_dtype: object, block_size: int
) -> tuple[str, ...]:
    """What a block's KV depends on besides its tokens: the weights, the dtype the model computes in (an
    INT8 or FP8 cache of a float32 and of a bfloat16 model holds different values in the same format), the
    cache dtype and the block size. The prefix cache's extra keys; joined, the disk tier's identity."""
    return (fingerprint, f"compute:{compute_dtype}", str(kv_dtype), str(block_size))


def adapter_chain_root(adapter_fingerprint: str) -> BlockHash:
    """Where the chain of a request with a LoRA adapter starts, in place of "no parent": every block hash of
    such a request then depends on its adapter, so KV computed through one adapter is never reused by another
    adapter or by the base model, on the device, in the offload tiers or in a router's chains."""
    if not adapter_fingerprint:
        raise ValueError("adapter_fingerprint must not be empty")
    return BlockHash(hashlib.sha256(HASH_VERSION + b"\0lora\0" + adapter_fingerprint.encode()).digest())


def encode_extra_keys(extra_keys: Sequence[str]) -> bytes:
    """Length-prefixed UTF-8 of each key, so ("ab", "c") and ("a", "bc") never collide."""
    parts = [struct.pack("<I", len(extra_keys))]
    for key in extra_keys:
        if not isinstance(key, str):
            raise ValueError(f"extra_keys must be strings, got {key!r} ({type(key).__name__})")
        raw = key.encode("utf-8")
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra: bytes | Sequence[str] = ()
) -> BlockHash:
    """Hash of one block given its parent's hash (None for the first block of a sequence).

    ``extra`` is either the output of :func:`encode_extra_keys` (cheaper when hashing many blocks) or the
    keys themselves.
    """
    if not isinstance(extra, bytes | bytearray):
        extra = encode_extra_keys(extra)
    try:
        tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token_ids must be 64-bit integers: {exc}") from None
    h = hashlib.sha256(HASH_VERSION)
    h.update(_NO_PARENT if parent is None else parent)
    h.update(extra)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(tokens)
    return BlockHash(h.digest())


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes | Sequence[str] = (),
    parent: BlockHash | None = None,
    start_block: int = 0,
    max_blocks: int | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids`` from ``start_block`` on.

    ``parent`` must be the hash of block ``start_block - 1`` (None when starting at 0); a partial last block
    is never hashed because its KV is still growing.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if not isinstance(extra, bytes | bytearray):
        extra = encode_extra_keys(extra)
    end_block = len(token_ids) // block_size
    if max_blocks is not None:
        end_block = min(end_block, start_block + max_blocks)
    hashes: list[BlockHash] = []
    for i in range(start_block, end_block):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes
