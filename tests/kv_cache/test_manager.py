import pytest
from pagoda.engine.kv_cache.hashing import hash_full_blocks
from pagoda.engine.kv_cache.manager import KVCacheManager
from pagoda.engine.kv_cache.ops import CopyBlock, LoadBlock

BS = 4


def take_copies(m: KVCacheManager) -> list[tuple[int, int]]:
    return [(op.src, op.dst) for op in m.take_ops() if isinstance(op, CopyBlock)]


def run_prefill(m: KVCacheManager, seq: str, tokens: list[int]) -> int:
    """What the scheduler does for a new sequence: look up, allocate the rest, compute, cache."""
    hit = m.get_computed_tokens(seq, tokens)
    assert m.allocate_slots(seq, len(tokens))
    m.cache_blocks(seq, tokens, len(tokens))
    return hit


def snapshot(m: KVCacheManager, seqs: list[str]):
    return (
        {s: m.get_block_table(s) for s in seqs},
        {s: m.get_num_tokens(s) for s in seqs},
        [b.ref_cnt for b in m.block_pool.blocks],
        dict(m.block_pool.cached),
        m.num_free_blocks,
        m.num_cached_blocks,
        m.num_pending_ops,
    )


def test_bad_construction_names_the_field():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, 16)


def test_prefix_hit_across_sequences_with_the_same_prefix():
    m = KVCacheManager(num_blocks=16, block_size=BS, extra_keys=("model", "auto"))
    shared = list(range(100, 108))  # two full blocks
    assert run_prefill(m, "a", shared + [1, 2, 3]) == 0
    assert m.prefix_cache_queries == 11 and m.prefix_cache_hits == 0
    hit = m.get_computed_tokens("b", shared + [7, 7])
    assert hit == 8
    assert m.get_block_table("b") == m.get_block_table("a")[:2]
    assert m.prefix_cache_queries == 21 and m.prefix_cache_hits == 8
    assert [m.block_pool.blocks[i].ref_cnt for i in m.get_block_table("b")] == [2, 2]
    assert m.allocate_slots("b", 10)
    assert m.get_block_table("b")[2] not in m.get_block_table("a")
    assert take_copies(m) == []  # the shared blocks are full: never written, never copied
    m.check_invariants()


def test_hit_leaves_at_least_one_token_to_compute():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(8))
    run_prefill(m, "a", tokens)
    assert m.find_cached_prefix(tokens) == 4
    assert m.get_computed_tokens("b", tokens) == 4  # the whole prompt is cached, one block is recomputed
    assert m.get_computed_tokens("c", tokens + [99]) == 8
    assert m.get_computed_tokens("d", []) == 0
    assert m.get_computed_tokens("e", tokens[:1]) == 0
    m.check_invariants()


def test_a_cached_freed_sequence_hits_after_it_ends():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(13))
    run_prefill(m, "a", tokens)
    m.free("a")
    assert m.num_used_blocks == 0 and m.num_cached_blocks == 3 and m.num_free_blocks == 8
    assert m.get_computed_tokens("b", tokens) == 12
    assert m.num_cached_blocks == 0 and m.num_used_blocks == 3
    m.check_invariants()


def test_different_extra_keys_never_share():
    tokens = list(range(12)) + [5]
    a = KVCacheManager(num_blocks=8, block_size=BS, extra_keys=("model-a", "auto"))
    run_prefill(a, "x", tokens)
    assert a.get_block_hashes("x") == hash_full_blocks(tokens, BS, ("model-a", "auto"))
    for other in [("model-b", "auto"), ("model-a", "fp8_e4m3"), ("model-a",), ()]:
        for bh in hash_full_blocks(tokens, BS, other):
            assert a.block_pool.lookup(bh) is None
    b = KVCacheManager(num_blocks=8, block_size=BS, extra_keys=("model-a", "fp8_e4m3"))
    run_prefill(b, "x", tokens)
    assert set(a.block_pool.cached).isdisjoint(b.block_pool.cached)


def test_eviction_is_lru_and_tail_before_head():
    evicted = []
    m = KVCacheManager(num_blocks=6, block_size=BS, on_evict=lambda bid, bh: evicted.append(bid))
    old = [1] * 12
    new = [2] * 12
    run_prefill(m, "old", old + [0])  # 4 blocks, 3 full and cached
    old_table = m.get_block_table("old")
    m.free("old")
    # 3 empty blocks (2 never used + the uncached partial tail of "old"), then one eviction: "old"'s tail.
    run_prefill(m, "new", new + [0])
    new_table = m.get_block_table("new")
    assert evicted == [old_table[2]]
    assert m.find_cached_prefix(old + [0]) == 8  # head and middle survive
    m.free("new")
    # "old" was released before "new": all of it goes first, each chain tail first.
    assert m.allocate_slots("z", 4 * BS)  # 1 empty block + 3 evictions
    assert evicted == [old_table[2], old_table[1], old_table[0], new_table[2]]
    assert m.find_cached_prefix(old + [0]) == 0
    assert m.find_cached_prefix(new + [0]) == 8
    m.check_invariants()


def test_uncached_blocks_are_used_before_evicting():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    run_prefill(m, "a", list(range(9)))  # 3 blocks, 2 cached
    m.free("a")
    assert m.allocate_slots("b", 6 * BS)  # 6 blocks: 5 empty + the uncached tail of "a"
    assert m.num_cached_blocks == 2 and m.block_pool.num_evictions == 0
    assert m.find_cached_prefix(list(range(9))) == 8
    m.check_invariants()


def test_copy_on_write_after_fork():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(6))  # one full block and a half-full one
    run_prefill(m, "p", tokens)
    pt = m.get_block_table("p")
    m.fork("p", "c")
    assert m.get_block_table("c") == pt
    assert [m.block_pool.blocks[i].ref_cnt for i in pt] == [2, 2]
    assert m.num_used_blocks == 2
    assert m.num_blocks_needed("c", 7) == 1
    assert m.allocate_slots("c", 7)  # writes token 6 into the shared half-full block
    ct = m.get_block_table("c")
    assert ct[0] == pt[0] and ct[1] != pt[1]
    assert take_copies(m) == [(pt[1], ct[1])]
    assert take_copies(m) == []
    assert m.get_block_table("p") == pt
    assert m.block_pool.blocks[pt[1]].ref_cnt == 1 and m.block_pool.blocks[pt[0]].ref_cnt == 2
    assert m.allocate_slots("p", 7)  # the parent now owns its block alone: write in place
    assert take_copies(m) == [] and m.get_block_table("p") == pt
    m.check_invariants()
    m.free("p")
    m.free("c")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_fork_on_a_block_boundary_needs_no_copy():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    run_prefill(m, "p", list(range(8)))
    m.fork("p", "c")
    assert m.allocate_slots("c", 9) and m.allocate_slots("p", 9)
    assert take_copies(m) == []
    assert m.get_block_table("c")[:2] == m.get_block_table("p")[:2]
    assert m.get_block_table("c")[2] != m.get_block_table("p")[2]
    m.check_invariants()


def test_many_forks_each_copy_once():
    m = KVCacheManager(num_blocks=16, block_size=BS)
    run_prefill(m, "p", list(range(5)))
    for i in range(3):
        m.fork("p", f"c{i}")
    for s in ["c0", "c1", "c2", "p"]:
        assert m.allocate_slots(s, 6)
    copies = take_copies(m)
    src = m.get_block_table("p")[1]
    assert len(copies) == 3 and {c[0] for c in copies} == {src}
    assert len({c[1] for c in copies}) == 3
    assert m.block_pool.blocks[src].ref_cnt == 1
    m.check_invariants()


def test_failed_allocation_changes_nothing():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    run_prefill(m, "p", list(range(6)))
    m.fork("p", "c")
    assert m.allocate_slots("x", 4)  # 3 of 4 blocks used now
    before = snapshot(m, ["p", "c", "x"])
    assert not m.can_allocate("c", 9)  # copy + 1 new block, only 1 free
    assert not m.allocate_slots("c", 9)
    assert not m.allocate_slots("new", 8)
    assert snapshot(m, ["p", "c", "x"]) == before
    assert not m.has_seq("new")
    assert m.can_allocate("c", 8) and m.allocate_slots("c", 8)  # the copy alone fits
    m.check_invariants()


def test_failed_allocation_leaves_cached_blocks_alone():
    evicted = []
    m = KVCacheManager(num_blocks=3, block_size=BS, on_evict=lambda b, h: evicted.append(b))
    run_prefill(m, "a", list(range(9)))
    m.free("a")
    before = snapshot(m, [])
    assert not m.allocate_slots("b", 4 * BS)
    assert snapshot(m, []) == before and evicted == []


def test_chunked_prefill_caches_the_same_blocks_as_one_shot():
    tokens = list(range(30))
    one = KVCacheManager(num_blocks=16, block_size=BS)
    run_prefill(one, "s", tokens)
    chunked = KVCacheManager(num_blocks=16, block_size=BS)
    assert chunked.get_computed_tokens("s", tokens) == 0
    done = 0
    for chunk in (3, 5, 1, 7, 14):
        done += chunk
        assert chunked.allocate_slots("s", done)
        chunked.cache_blocks("s", tokens, done)
        assert chunked.get_num_tokens("s") == done
    assert set(chunked.block_pool.cached) == set(one.block_pool.cached)
    assert len(chunked.block_pool.cached) == 7
    chunked.check_invariants()


def test_resume_after_preemption_reuses_generated_tokens():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(5))
    run_prefill(m, "s", prompt)
    seq = list(prompt)
    for t in range(10, 14):  # decode 4 tokens; each step writes the previous sample
        seq.append(t)
        assert m.allocate_slots("s", len(seq))
        m.cache_blocks("s", seq, len(seq))
    m.free("s")  # preempted (recompute)
    assert m.get_computed_tokens("s", seq) == 8
    assert m.prefix_cache_hits == 8
    m.check_invariants()


def test_prefix_caching_off():
    m = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    tokens = list(range(12))
    assert run_prefill(m, "a", tokens) == 0
    assert m.block_pool.cached == {}
    m.free("a")
    assert m.get_computed_tokens("b", tokens) == 0
    assert m.prefix_cache_queries == 0 and m.prefix_cache_hits == 0
    assert m.num_cached_blocks == 0 and m.num_free_blocks == 8
    m.check_invariants()


def test_usage_and_counts():
    m = KVCacheManager(num_blocks=10, block_size=BS)
    assert m.usage == 0.0
    assert m.allocate_slots("a", 9)
    assert (m.num_used_blocks, m.num_free_blocks, m.usage) == (3, 7, 0.3)
    m.cache_blocks("a", list(range(9)), 9)
    m.free("a")
    assert (m.num_used_blocks, m.num_free_blocks, m.num_cached_blocks, m.usage) == (0, 10, 2, 0.0)


def test_reset_prefix_cache():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(9))
    run_prefill(m, "a", tokens)
    assert m.reset_prefix_cache() is False
    assert m.find_cached_prefix(tokens) == 8
    m.free("a")
    assert m.reset_prefix_cache() is True
    assert m.find_cached_prefix(tokens) == 0 and m.num_cached_blocks == 0
    m.check_invariants()


def test_misuse_is_a_clear_error():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    run_prefill(m, "a", list(range(5)))
    with pytest.raises(ValueError, match="already has blocks"):
        m.get_computed_tokens("a", [1, 2, 3])
    with pytest.raises(ValueError, match="num_tokens"):
        m.allocate_slots("a", -1)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        m.cache_blocks("a", [1, 2], 3)
    with pytest.raises(ValueError, match="unknown seq_id"):
        m.fork("missing", "x")
    with pytest.raises(ValueError, match="child_id"):
        m.fork("a", "a")
    m.free("missing")  # aborting an unknown or already freed request is harmless
    m.free("a")
    m.free("a")
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_check_invariants_catches_a_leaked_reference():
    m = KVCacheManager(num_blocks=4, block_size=BS)
    assert m.allocate_slots("a", 4)
    m.block_pool.blocks[m.get_block_table("a")[0]].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref count"):
        m.check_invariants()


def test_eviction_hook_gets_the_block_and_its_hash():
    seen = []
    m = KVCacheManager(num_blocks=2, block_size=BS, on_evict=lambda bid, bh: seen.append((bid, bh)))
    tokens = list(range(9))
    assert m.get_computed_tokens("a", tokens) == 0
    assert m.allocate_slots("a", 8)
    m.cache_blocks("a", tokens, 8)
    hashes, table = m.get_block_hashes("a"), m.get_block_table("a")
    m.free("a")
    assert m.allocate_slots("b", 1)
    assert seen == [(table[1], hashes[1])]  # tail first
    assert m.block_pool.lookup(hashes[1]) is None


def test_find_cached_prefix_takes_nothing_and_counts_nothing():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(9))
    run_prefill(m, "a", tokens)
    m.free("a")
    queries, hits, cached = m.prefix_cache_queries, m.prefix_cache_hits, m.num_cached_blocks
    assert m.find_cached_prefix(tokens) == 8
    assert m.find_cached_prefix([42] + tokens) == 0
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.num_cached_blocks) == (queries, hits, cached)


def test_num_blocks_needed_counts_new_blocks_and_copies():
    m = KVCacheManager(num_blocks=16, block_size=BS)
    assert m.num_blocks_needed("new", 0) == 0
    assert m.num_blocks_needed("new", 9) == 3
    run_prefill(m, "p", list(range(6)))
    assert m.num_blocks_needed("p", 8) == 0 and m.num_blocks_needed("p", 9) == 1
    m.fork("p", "c")
    assert m.num_blocks_needed("c", 7) == 1  # the copy
    assert m.num_blocks_needed("c", 13) == 3  # the copy and two new blocks
    assert m.num_blocks_needed("c", 6) == 0  # nothing new is written


def test_blocks_loaded_from_a_lower_tier_extend_the_prefix_hit():
    m = KVCacheManager(num_blocks=8, block_size=BS, extra_keys=("m",))
    tokens = list(range(13))
    hashes = hash_full_blocks(tokens, BS, m.extra_key_bytes)
    run_prefill(m, "a", tokens[:5])  # only the first block is cached on the device
    m.free("a")
    assert m.get_computed_tokens("b", tokens) == 4
    assert m.get_block_hashes("b")[:2] == hashes[:2]
    loaded = [m.block_pool.insert_external(h) for h in hashes[1:3]]
    assert all(b is not None and b.ref_cnt == 1 for b in loaded)
    with pytest.raises(ValueError, match="same length"):
        m.append_loaded_blocks("b", loaded, hashes[1:2])
    m.append_loaded_blocks("b", loaded, hashes[1:3])
    assert m.get_num_tokens("b") == 12 and len(m.get_block_table("b")) == 3
    m.check_invariants()
    assert m.allocate_slots("b", 13) and take_copies(m) == []
    m.cache_blocks("b", tokens, 13)
    m.free("b")
    assert m.find_cached_prefix(tokens + [1]) == 12
    m.check_invariants()


def test_freeing_a_copy_target_drops_its_pending_copy():
    """A copy-on-write whose target block is freed before the copy ran must not run later: the block may
    meanwhile hold other KV (e.g. loaded from a tier), which the stale copy would overwrite."""
    m = KVCacheManager(num_blocks=8, block_size=BS)
    run_prefill(m, "p", list(range(6)))
    m.fork("p", "c")
    assert m.allocate_slots("c", 7)  # records a copy into c's fresh block
    assert m.num_pending_ops == 1
    m.free("c")
    assert m.take_ops() == []
    m.check_invariants()


def test_copy_then_free_then_load_into_the_same_block_keeps_the_loaded_kv():
    """The ordering bug: a copy-on-write recorded for a block, the block freed (its sequence preempted in
    the same schedule) and reused for a tier load. Applying the recorded ops in order must leave the
    loaded KV in the block, never the stale copy."""
    m = KVCacheManager(num_blocks=3, block_size=BS, should_save=lambda h: True)
    run_prefill(m, "p", list(range(6)))  # one full block, one half-full block
    m.take_ops()
    m.fork("p", "c")
    assert m.allocate_slots("c", 7)  # copy p's half-full block into the last free block
    (copy,) = m._ops.ops
    m.free("c")
    other = hash_full_blocks(list(range(50, 54)), BS, m.extra_key_bytes)
    m.get_computed_tokens("q", list(range(50, 55)))
    assert m.load_blocks("q", other, ["loaded"]) == 1
    assert m.get_block_table("q") == [copy.dst]  # the freed copy target was reused for the load
    mem = {b: f"kv{b}" for b in range(3)}
    for op in m.take_ops():
        if isinstance(op, CopyBlock):
            mem[op.dst] = mem[op.src]
        elif isinstance(op, LoadBlock):
            mem[op.block_id] = op.data
    assert mem[copy.dst] == "loaded"
    m.check_invariants()


def test_sink_eviction_keeps_the_written_sinks_and_rotates_private_copies():
    """Attention sinks (one sink block): the written sink stays cached and referenced aside, the table gets
    a copy whose keys are rotated from it by the whole offset at every eviction; the window keeps its blocks
    and cache entries; a fork's evictions copy a shared sink copy before rotating it."""
    from pagoda.engine.kv_cache.ops import RotateBlock

    m = KVCacheManager(num_blocks=12, block_size=BS)
    tokens = list(range(4 * BS))
    run_prefill(m, "p", tokens)
    written, w1, w2, w3 = m.get_block_table("p")
    m.take_ops()
    assert m.drop_blocks("p", 1, 1)  # the block after the sink goes
    sink_copy = m.get_block_table("p")[0]
    assert m.get_block_table("p") == [sink_copy, w2, w3] and sink_copy != written
    assert m.take_ops() == [CopyBlock(written, sink_copy), RotateBlock(written, sink_copy, BS)]
    assert m.get_position_offset("p") == BS
    assert m.block_pool.blocks[written].ref_cnt == 1 and m.block_pool.blocks[written].block_hash is not None
    assert m.block_pool.blocks[w2].block_hash is not None  # unchanged KV: still a valid prefix block
    m.check_invariants()
    m.fork("p", "c")
    assert m.drop_blocks("c", 1, 1)  # the child's sink copy is shared: copied, then rotated from the written
    c_copy = m.get_block_table("c")[0]
    assert c_copy not in (sink_copy, written)
    assert m.take_ops() == [CopyBlock(sink_copy, c_copy), RotateBlock(written, c_copy, 2 * BS)]
    assert m.drop_blocks("p", 1, 1)  # the parent's copy is its own again: rotated in place, never re-rotated
    assert m.take_ops() == [RotateBlock(written, sink_copy, 2 * BS)]
    m.check_invariants()
    m.free("p")
    m.free("c")
    m.check_invariants()
    assert m.num_used_blocks == 0 and m.find_cached_prefix(tokens) == 3 * BS  # the prefix is still cached
