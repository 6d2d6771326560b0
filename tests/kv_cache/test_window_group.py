"""The window group of the KV cache manager: sliding layers keep only the blocks their window still reads.

Window 8 tokens, blocks of 4: a query at position p reads keys p - 7 .. p, so a step that starts writing at
position s needs the window group's blocks from (s - 7) // 4 on, and the ones before go back to the pool.
"""

from __future__ import annotations

import pytest
from pagoda.engine.kv_cache.events import KVEventLog
from pagoda.engine.kv_cache.manager import KVCacheManager
from pagoda.engine.kv_cache.ops import CopyBlock

BS = 4
W = 8


def manager(num_blocks: int = 64, num_window_blocks: int = 16, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(
        num_blocks,
        BS,
        enable_prefix_caching=caching,
        window=W,
        num_window_blocks=num_window_blocks,
    )


def run(kv: KVCacheManager, seq: str, tokens: list[int], start: int, chunk: int) -> None:
    """Compute ``tokens[start:]`` of ``seq`` in chunks, as the scheduler would, checking every step."""
    done = start
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        assert kv.allocate_slots(seq, done + n)
        table = kv.get_window_block_table(seq)
        # every key the step's queries read is in the window table
        first = max(0, done - W + 1) // BS
        assert all(b != 0 for b in table[first : -(-(done + n) // BS)])
        assert all(b == 0 for b in table[: max(0, first)])
        done += n
        kv.cache_blocks(seq, tokens, done)
        kv.check_invariants()


def held(kv: KVCacheManager, seq: str) -> int:
    return sum(1 for b in kv.get_window_block_table(seq) if b != 0)


def test_decode_keeps_the_window_only():
    kv = manager()
    tokens = list(range(100))
    kv.get_computed_tokens("a", tokens)
    run(kv, "a", tokens, 0, 1)
    # the last write started at 99: keys 92..99 -> blocks 23 and 24 (100 tokens -> 25 blocks)
    assert kv.get_window_block_table("a")[:23] == [0] * 23
    assert held(kv, "a") == 2
    assert len(kv.get_block_table("a")) == 25  # the full group keeps everything
    assert kv.num_free_window_blocks == 16 - 1 - 2


def test_chunks_hold_window_plus_chunk():
    kv = manager()
    tokens = list(range(64))
    kv.get_computed_tokens("a", tokens)
    run(kv, "a", tokens, 0, 16)
    # the last chunk wrote 48..63: from key 41 on -> blocks 10..15
    assert held(kv, "a") == 6


def test_a_small_window_pool_serves_long_sequences_and_reuses_blocks():
    # 3 blocks per sequence at most while decoding; 2 sequences, 1 null block: 7 blocks suffice
    kv = manager(num_blocks=128, num_window_blocks=7, caching=False)
    for seq in ("a", "b"):
        kv.get_computed_tokens(seq, [])
    for step in range(200):
        for seq in ("a", "b"):
            assert kv.allocate_slots(seq, step + 1), (seq, step)
        kv.check_invariants()
    kv.free("a")
    kv.free("b")
    assert kv.num_free_window_blocks == 6
    kv.check_invariants()


def test_allocation_fails_cleanly_when_the_window_pool_is_short():
    kv = manager(num_blocks=64, num_window_blocks=4, caching=False)
    kv.get_computed_tokens("a", [])
    assert kv.can_allocate("a", 12) and kv.allocate_slots("a", 12)  # 3 blocks
    kv.get_computed_tokens("b", [])
    assert not kv.can_allocate("b", 1)
    assert not kv.allocate_slots("b", 1)
    assert kv.get_block_table("b") == [] and kv.num_free_blocks == 61
    # a's next step needs its block 3 and lets block 0 go (its window starts at key 12 - 7 = 5): it fits
    # in a full pool
    assert kv.can_allocate("a", 13) and kv.allocate_slots("a", 13)
    assert kv.get_window_block_table("a")[0] == 0 and kv.num_free_window_blocks == 0
    assert not kv.allocate_slots("b", 1)
    kv.free("a")
    assert kv.allocate_slots("b", 1)
    kv.check_invariants()


def test_prefix_hit_needs_the_window_blocks_before_its_end():
    kv = manager(num_blocks=64, num_window_blocks=12)
    tokens = list(range(40))
    kv.get_computed_tokens("a", tokens)
    run(kv, "a", tokens, 0, 8)
    kv.free("a")
    # every window block stayed cached when it left the window: the whole prefix hits
    assert kv.find_cached_prefix(tokens + [7]) == 40
    assert kv.get_computed_tokens("b", tokens + [7]) == 40
    # a hit at 40 needs keys 33.. -> window blocks 8 and 9; the rest of b's window table is null
    table = kv.get_window_block_table("b")
    assert table[:8] == [0] * 8 and 0 not in table[8:10]
    kv.check_invariants()
    kv.free("b")
    # evict the window group's cache: another sequence takes every window block
    kv.get_computed_tokens("x", [])
    assert kv.allocate_slots("x", 11 * BS - 3)  # its prompt chunk takes 11 window blocks
    # blocks 8, 9 of the chain are gone from the window group: the full group alone cannot serve
    assert kv.find_cached_prefix(tokens + [7]) == 0
    kv.check_invariants()


def test_prefix_hit_is_shortened_to_what_the_window_group_holds():
    kv = manager(num_blocks=64, num_window_blocks=20)
    tokens = list(range(40))
    kv.get_computed_tokens("a", tokens)
    run(kv, "a", tokens, 0, 1)
    hashes = kv.get_block_hashes("a")
    kv.free("a")
    pool = kv.window_pool
    assert all(pool.get_cached_block(h) is not None for h in hashes)
    for h in hashes[8:]:  # the window group loses the chain's blocks 8 and 9
        block = pool.get_cached_block(h)
        pool.touch([block])
        pool._evict(block)
        pool.free_blocks([block])
    # 40 would need window blocks 8, 9; 36 needs 7, 8; 32 needs 6, 7: the hit is 32 tokens
    assert kv.find_cached_prefix(tokens + [7]) == 32
    assert kv.get_computed_tokens("b", tokens + [7]) == 32
    assert kv.get_window_block_table("b")[:6] == [0] * 6
    kv.check_invariants()
    # computing on from the hit: every step still finds its window, and the chain is cached again
    run(kv, "b", tokens + [7], 32, 3)
    assert all(pool.get_cached_block(h) is not None for h in hashes)


def test_fork_shares_then_copies_window_blocks():
    kv = manager()
    tokens = list(range(10))
    kv.get_computed_tokens("p", tokens)
    run(kv, "p", tokens, 0, 10)
    kv.fork("p", "c")
    kv.check_invariants()
    assert kv.get_window_block_table("c") == kv.get_window_block_table("p")
    kv.take_ops()
    assert kv.allocate_slots("c", 11)  # writes into the shared, partly filled block 2
    ops = kv.take_ops()
    shared = kv.get_window_block_table("p")[2]
    assert CopyBlock(kv.get_block_table("p")[2], kv.get_block_table("c")[2]) in ops
    assert CopyBlock(shared, kv.get_window_block_table("c")[2], window=True) in ops
    kv.check_invariants()
    kv.free("p")
    kv.free("c")
    kv.check_invariants()


def test_freed_sequence_drops_its_pending_window_copies():
    kv = manager()
    kv.get_computed_tokens("p", [])
    assert kv.allocate_slots("p", 6)
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 7)
    kv.free("c")
    assert not [op for op in kv.take_ops() if isinstance(op, CopyBlock)]


def test_events_announce_only_blocks_both_groups_hold():
    kv = manager(num_blocks=64, num_window_blocks=12)
    log = KVEventLog()
    kv.set_event_log(log)
    tokens = list(range(40))
    kv.get_computed_tokens("a", tokens)
    run(kv, "a", tokens, 0, 8)
    kv.free("a")
    assert log.counts().get("device") == 10
    kv.get_computed_tokens("x", [])
    assert kv.allocate_slots("x", 11 * BS - 3)  # evicts every cached window block
    assert not log.counts().get("device")
    kv.free("x")
    assert kv.reset_prefix_cache()
    kv.check_invariants()


def test_sinks_and_tiers_are_refused():
    with pytest.raises(ValueError, match="offload tiers"):
        KVCacheManager(8, BS, window=W, num_window_blocks=4, should_save=lambda h: True)
    kv = manager()
    kv.get_computed_tokens("a", [])
    assert kv.allocate_slots("a", 20)
    with pytest.raises(ValueError, match="attention sinks"):
        kv.drop_blocks("a", 1, 1)
    with pytest.raises(ValueError, match="offload tier"):
        kv.append_loaded_blocks("a", [], [])


def test_without_a_window_nothing_changes():
    kv = KVCacheManager(8, BS)
    assert kv.get_window_block_table("a") is None and kv.num_free_window_blocks == 0
    kv.get_computed_tokens("a", [])
    assert kv.allocate_slots("a", 32) and not kv.can_allocate("b", 1)


def test_an_all_sliding_models_bookkeeping_pool_never_binds():
    """Every layer slides: the full group's pool, sized by kv_split.bookkeeping_blocks, holds every table of
    as many sequences of max_model_len tokens as the window pool admits; the window pool is what binds."""
    from pagoda.engine.sizing.kv_split import bookkeeping_blocks

    max_len, window_blocks = 64, 16  # 16 blocks a sequence in the full group, 3 window blocks a decoder
    num_blocks = bookkeeping_blocks(window_blocks, W, BS, max_len, max_num_seqs=256)
    # (16 - 1) window blocks, a sequence past the window holding at least (8 - 1) // 4 + 1 = 2 of them:
    # at most 7 such, each with 17 table blocks at most -> 15 x ceil(17 / 2) + 17
    assert num_blocks == 15 * 9 + 17
    kv = manager(num_blocks, window_blocks)
    seqs = []
    for i in range(20):  # decoding sequences of 64 tokens until the window pool refuses
        seq, tokens = f"s{i}", [1000 * i + t for t in range(max_len)]
        kv.get_computed_tokens(seq, tokens)
        if not kv.can_allocate(seq, 1):
            break
        done = 0
        while done < max_len and kv.allocate_slots(seq, done + 1):
            done += 1
            kv.cache_blocks(seq, tokens, done)
        seqs.append((seq, done))
        if done < max_len:
            break
    # 7 sequences of 64 tokens (2 window blocks each), the 8th's first block takes the window pool's last
    assert [done for _, done in seqs] == [max_len] * 7 + [4]
    assert kv.num_free_window_blocks == 0  # the window pool ran out ...
    assert kv.num_free_blocks == num_blocks - 7 * 16 - 1 == 39  # ... with the full group's to spare
    kv.check_invariants()


def test_usage_is_the_fuller_pools():
    """vllm:kv_cache_usage_perc's number: the larger of the pools' usage; the null block counts in neither."""
    kv = manager(num_blocks=12, num_window_blocks=9)  # 8 usable window blocks
    assert kv.pool_usage == {"full": 0.0, "window": 0.0} and kv.usage == 0.0
    tokens = list(range(40))
    kv.get_computed_tokens("a", tokens)
    run(kv, "a", tokens[:12], 0, 12)  # one chunk of 12: its 3 blocks in both pools
    assert kv.pool_usage == {"full": 3 / 12, "window": 3 / 8} and kv.usage == 3 / 8
    run(kv, "a", tokens, 12, 1)  # decode to 40 tokens: 10 full blocks, the window's 2
    assert kv.pool_usage == {"full": 10 / 12, "window": 2 / 8} and kv.usage == 10 / 12
    kv.free("a")
    assert kv.usage == 0.0
