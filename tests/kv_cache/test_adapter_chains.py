"""A LoRA adapter's requests chain their block hashes from the adapter's root: their KV is never reused by
another adapter or the base model, whether by whole blocks, by sub-block reuse or from an offload tier."""

from __future__ import annotations

import torch
from pagoda.engine.kv_cache.hashing import adapter_chain_root, hash_full_blocks
from pagoda.engine.kv_cache.manager import KVCacheManager
from pagoda.engine.offload.manager import OffloadManager

BS = 4
EXTRA = ("model-x", "compute:float32", "float32", str(BS))
A, B = adapter_chain_root("adapter-a"), adapter_chain_root("adapter-b")
TOKENS = list(range(100, 113))  # three full blocks and one token


def prefill(m: KVCacheManager, seq: str, tokens: list[int], root=None) -> int:
    hit = m.get_computed_tokens(seq, tokens, root)
    assert m.allocate_slots(seq, len(tokens))
    m.cache_blocks(seq, tokens, len(tokens))
    return hit


def test_every_block_hash_depends_on_the_adapter():
    base = hash_full_blocks(TOKENS, BS, EXTRA)
    a = hash_full_blocks(TOKENS, BS, EXTRA, parent=A)
    b = hash_full_blocks(TOKENS, BS, EXTRA, parent=B)
    assert len(base) == len(a) == len(b) == 3
    for i in range(3):
        assert len({base[i], a[i], b[i]}) == 3, f"block {i} shares a hash across adapters"
    assert adapter_chain_root("adapter-a") == A  # stable: routers and the disk tier compute the same


def test_kv_is_shared_within_an_adapter_and_never_across():
    m = KVCacheManager(32, BS, extra_keys=EXTRA)
    assert prefill(m, "a1", TOKENS, A) == 0
    assert prefill(m, "base", TOKENS) == 0
    assert prefill(m, "b1", TOKENS, B) == 0
    assert prefill(m, "a2", TOKENS, A) == 12  # same adapter: three whole blocks
    assert prefill(m, "base2", TOKENS) == 12
    assert (
        m.find_cached_prefix(TOKENS, B) == 12 and m.find_cached_prefix(TOKENS, adapter_chain_root("c")) == 0
    )
    assert m.get_block_hashes("a2") == hash_full_blocks(TOKENS, BS, EXTRA, parent=A)
    assert m.chain_root("a2") == A and m.chain_root("base") is None
    m.fork("a2", "a2-child")
    assert m.chain_root("a2-child") == A
    m.check_invariants()


def test_sub_block_reuse_stays_within_the_adapter():
    m = KVCacheManager(32, BS, extra_keys=EXTRA, enable_partial_prefix_reuse=True)
    prefill(m, "a1", TOKENS, A)
    m.check_invariants()  # the partial index holds A's first block under A's root
    probe = TOKENS[:3] + [999, 998]  # the first three tokens of A's first block, then others
    m.get_computed_tokens("base", probe)
    assert m.reuse_partial_block("base", probe) == 0
    m.get_computed_tokens("b", probe, B)
    assert m.reuse_partial_block("b", probe) == 0
    m.get_computed_tokens("a", probe, A)
    assert m.reuse_partial_block("a", probe) == 3
    m.check_invariants()


def test_offload_tiers_hold_an_adapters_blocks_under_its_chain():
    shape = (1, 2, BS, 1, 2)
    offload = OffloadManager(shape, torch.float32, host_bytes=1 << 20)
    a_hashes = hash_full_blocks(TOKENS, BS, EXTRA, parent=A)
    offload.store([(h, torch.full(shape, float(i))) for i, h in enumerate(a_hashes)])
    m = KVCacheManager(32, BS, extra_keys=EXTRA, should_save=offload.should_save)
    m.get_computed_tokens("base", TOKENS)
    assert offload.load_prefix(m, "base", TOKENS, 0) == 0
    m.get_computed_tokens("b", TOKENS, B)
    assert offload.load_prefix(m, "b", TOKENS, 0) == 0
    m.get_computed_tokens("a", TOKENS, A)
    assert offload.load_prefix(m, "a", TOKENS, 0) == 12
    assert m.get_block_hashes("a") == a_hashes
    m.check_invariants()
