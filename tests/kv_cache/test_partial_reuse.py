"""Sub-block prefix reuse: the partial-block index, the copy it plans, and its life through eviction.

The property test keeps a model of the KV memory: every slot holds the token prefix that produced it. Ops
are applied in the order the manager recorded them, then the "forward" writes the slots it computes; a
sequence must then read back, slot by slot, exactly its own prefixes. A copied block used past its first
k tokens, a copy run after the forward, or a stale index entry after an eviction would all show up there.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings
from pagoda.engine.kv_cache.hashing import hash_block_tokens
from pagoda.engine.kv_cache.manager import KVCacheManager
from pagoda.engine.kv_cache.ops import CopyBlock
from pagoda.engine.kv_cache.partial_index import PartialBlockIndex

BS = 16


def _run(m: KVCacheManager, seq_id: str, tokens: list[int]) -> int:
    """Look up, reuse, allocate and 'compute' the whole prompt; returns the tokens found cached."""
    hit = m.get_computed_tokens(seq_id, tokens)
    hit += m.reuse_partial_block(seq_id, tokens)
    assert m.allocate_slots(seq_id, len(tokens))
    m.cache_blocks(seq_id, tokens, len(tokens))
    return hit


def test_reuses_the_matching_head_of_the_next_cached_block():
    m = KVCacheManager(16, BS, enable_partial_prefix_reuse=True)
    a = list(range(100, 148))  # three full blocks
    _run(m, "a", a)
    src = m.get_block_table("a")[2]
    m.free("a")
    m.take_ops()
    b = a[:37] + [7, 8, 9]  # shares 37 tokens: two whole blocks and 5 of the third
    hit = m.get_computed_tokens("b", b)
    assert hit == 32
    assert m.reuse_partial_block("b", b) == 5
    table = m.get_block_table("b")
    assert len(table) == 3
    assert table[2] != src
    assert m.take_ops() == [CopyBlock(src, table[2])]
    assert m.get_num_tokens("b") == 37
    assert m.prefix_cache_hits == 37 and m.partial_reuse_tokens == 5
    m.check_invariants()


def test_a_whole_matching_block_still_leaves_one_token_to_compute():
    m = KVCacheManager(16, BS, enable_partial_prefix_reuse=True)
    a = list(range(200, 248))
    _run(m, "a", a)
    m.free("a")
    assert m.get_computed_tokens("b", a) == 32  # the last whole block is held back for the logits
    assert m.reuse_partial_block("b", a) == 15
    assert m.get_num_tokens("b") == 47


def test_first_block_partial_match_and_no_match():
    m = KVCacheManager(16, BS, enable_partial_prefix_reuse=True)
    a = list(range(16))
    _run(m, "a", a + [99])
    m.free("a")
    assert m.get_computed_tokens("b", a[:10] + [50, 51]) == 0
    assert m.reuse_partial_block("b", a[:10] + [50, 51]) == 10
    assert m.get_computed_tokens("c", [1000, 1001, 1002]) == 0
    assert m.reuse_partial_block("c", [1000, 1001, 1002]) == 0


def test_off_by_flag_and_without_prefix_caching():
    for kwargs in ({"enable_partial_prefix_reuse": False}, {"enable_prefix_caching": False}):
        m = KVCacheManager(16, BS, **{"enable_partial_prefix_reuse": True, **kwargs})
        a = list(range(48))
        _run(m, "a", a)
        m.free("a")
        m.get_computed_tokens("b", a[:20] + [1])
        assert m.reuse_partial_block("b", a[:20] + [1]) == 0
        assert len(m.partial_index) == 0


def test_index_forgets_evicted_blocks_and_reset():
    m = KVCacheManager(4, BS, enable_partial_prefix_reuse=True)
    a = list(range(32))
    _run(m, "a", a + [5])
    m.free("a")
    assert len(m.partial_index) == 2
    # Fill the pool with other tokens: the cached blocks of a are evicted.
    _run(m, "x", list(range(500, 564)))
    assert {b for b, _, _ in m.partial_index.items()} == set(m.get_block_table("x"))
    m.check_invariants()
    m.free("x")
    assert m.get_computed_tokens("b", a[:20] + [1]) == 0
    assert m.reuse_partial_block("b", a[:20] + [1]) == 0
    m.free("b")
    assert m.reset_prefix_cache()
    assert len(m.partial_index) == 0


def test_index_best_match_prefers_the_longest_head():
    idx = PartialBlockIndex()
    idx.add(1, None, [1, 2, 3, 4])
    idx.add(2, None, [1, 2, 9, 9])
    idx.add(3, None, [1, 2, 3, 9])
    assert idx.best_match(None, [1, 2, 3, 4], 4) == (1, 4)
    assert idx.best_match(None, [1, 2, 3, 4], 3) in {(1, 3), (3, 3)}
    assert idx.best_match(None, [5], 4) is None
    idx.remove(1)
    assert idx.best_match(None, [1, 2, 3, 4], 4) == (3, 3)
    idx.remove(1)  # unknown ids are ignored
    assert len(idx) == 2


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["start", "free"]),
        st.lists(st.integers(0, 2), min_size=1, max_size=40),
        st.integers(0, 7),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=ACTIONS, num_blocks=st.integers(3, 12), bs=st.sampled_from([2, 4]))
def test_reads_back_own_kv_through_reuse_and_eviction(actions, num_blocks, bs):
    m = KVCacheManager(num_blocks, bs, enable_partial_prefix_reuse=True, extra_keys=("t",))
    mem: list[list[tuple[int, ...] | None]] = [[None] * bs for _ in range(num_blocks)]
    live: dict[str, list[int]] = {}
    n = 0
    for kind, tokens, pick in actions:
        if kind == "free" and live:
            sid = sorted(live)[pick % len(live)]
            m.free(sid)
            del live[sid]
        elif kind == "start":
            sid = f"s{n}"
            n += 1
            hit = m.get_computed_tokens(sid, tokens)
            hit += m.reuse_partial_block(sid, tokens)
            assert hit < len(tokens)
            if not m.allocate_slots(sid, len(tokens)):
                m.free(sid)
                for op in m.take_ops():  # copies into freed blocks were dropped; run the rest
                    if isinstance(op, CopyBlock):
                        mem[op.dst] = list(mem[op.src])
                continue
            for op in m.take_ops():  # in order, before the forward
                if isinstance(op, CopyBlock):
                    mem[op.dst] = list(mem[op.src])
            table = m.get_block_table(sid)
            for p in range(hit, len(tokens)):  # the forward
                mem[table[p // bs]][p % bs] = tuple(tokens[: p + 1])
            for p in range(len(tokens)):
                assert mem[table[p // bs]][p % bs] == tuple(tokens[: p + 1]), f"slot {p} of {sid}"
            m.cache_blocks(sid, tokens, len(tokens))
            live[sid] = tokens
        m.check_invariants()
        for block_id, parent, held in m.partial_index.items():
            block = m.block_pool.blocks[block_id]
            # An indexed block's memory is what its tokens produced after its parent's prefix.
            assert block.block_hash == hash_block_tokens(parent or None, held, m.extra_key_bytes)
            assert all(
                slot is not None and slot[-1] == t for slot, t in zip(mem[block_id], held, strict=True)
            )
