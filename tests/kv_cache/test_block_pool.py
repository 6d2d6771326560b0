import pytest
from pagoda.engine.kv_cache.block_pool import Block, BlockPool, FreeBlockQueue
from pagoda.engine.kv_cache.hashing import hash_block_tokens


def h(i: int):
    return hash_block_tokens(None, [i])


def ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


# -- FreeBlockQueue ---------------------------------------------------------------------------------------
def test_queue_is_fifo_and_unlinks_from_the_middle():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert ids(q) == [1, 3, 4, 2, 0]
    assert [q.popleft().block_id for _ in range(5)] == [1, 3, 4, 2, 0]
    assert len(q) == 0


def test_queue_refuses_misuse():
    b = Block(0)
    q = FreeBlockQueue([b])
    with pytest.raises(AssertionError, match="already"):
        q.append(b)
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(AssertionError, match="not in a free queue"):
        q.remove(b)


# -- BlockPool --------------------------------------------------------------------------------------------
def test_new_pool_is_all_free():
    pool = BlockPool(8)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks) == (8, 0, 0)
    pool.check_invariants()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_num_blocks_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)


def test_allocate_and_free_keep_counts_exact():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 3)
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1  # the failed call took nothing
    pool.free_blocks(got)
    assert pool.num_free_blocks == 4
    with pytest.raises(AssertionError, match="freed more times"):
        pool.free_blocks([got[0]])
    pool.check_invariants()


def test_least_recently_freed_is_handed_out_first():
    pool = BlockPool(4)
    a = pool.get_new_blocks(4)
    pool.free_blocks([a[2], a[0], a[3], a[1]])
    assert [b.block_id for b in pool.get_new_blocks(4)] == [2, 0, 3, 1]


def test_empty_blocks_go_before_cached_ones_and_eviction_is_lru():
    evicted = []
    pool = BlockPool(4, on_evict=lambda bid, bh: evicted.append((bid, bh)))
    blocks = pool.get_new_blocks(4)
    for i in (0, 1, 2):
        assert pool.cache_block(blocks[i], h(i))
    pool.free_blocks([blocks[1], blocks[0], blocks[3], blocks[2]])  # 1 is least recently released
    assert pool.num_cached_blocks == 3 and pool.num_free_blocks == 4
    first = pool.get_new_blocks(1)[0]
    assert first.block_id == 3 and evicted == []  # the uncached block is used before any eviction
    second = pool.get_new_blocks(1)[0]
    assert second.block_id == 1 and evicted == [(1, h(1))]
    assert second.block_hash is None and pool.lookup(h(1)) is None
    assert pool.lookup(h(0)) == 0 and pool.num_evictions == 1
    pool.check_invariants()


def test_touch_takes_a_cached_block_out_of_the_eviction_queue():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, h(7))
    pool.free_blocks([b])
    assert pool.num_cached_blocks == 1
    pool.touch([pool.get_cached_block(h(7))])
    assert b.ref_cnt == 1 and pool.num_cached_blocks == 0 and pool.num_free_blocks == 1
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.check_invariants()


def test_one_index_entry_per_hash():
    pool = BlockPool(3)
    a, b, _ = pool.get_new_blocks(3)
    assert pool.cache_block(a, h(1))
    assert not pool.cache_block(b, h(1))  # same KV already indexed
    assert b.block_hash is None and pool.lookup(h(1)) == a.block_id
    assert not pool.cache_block(a, h(1))  # already there: no-op
    with pytest.raises(AssertionError, match="another hash"):
        pool.cache_block(a, h(2))
    pool.check_invariants()


def test_prefix_caching_off_never_indexes():
    pool = BlockPool(2, enable_prefix_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_block(a, h(1))
    assert pool.insert_external(h(1)) is None
    pool.free_blocks([a])
    assert pool.num_cached_blocks == 0
    pool.check_invariants()


def test_insert_external_registers_a_fresh_block():
    pool = BlockPool(2)
    block = pool.insert_external(h(5))
    assert block is not None and block.ref_cnt == 1 and pool.lookup(h(5)) == block.block_id
    assert pool.insert_external(h(5)) is None  # already cached
    pool.free_blocks([block])
    assert pool.num_cached_blocks == 1
    pool.check_invariants()
    (other,) = pool.get_new_blocks(1)
    assert pool.insert_external(h(6)) is not None
    assert pool.insert_external(h(8)) is None  # pool exhausted
    assert other.block_id != block.block_id


def test_reset_prefix_cache_refused_while_referenced():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(2))
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(h(1)) == a.block_id and pool.num_cached_blocks == 1
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and pool.num_cached_blocks == 0 and pool.num_free_blocks == 3
    assert a.block_hash is None and b.block_hash is None
    pool.check_invariants()


def test_check_invariants_catches_corruption():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    a.ref_cnt = 0  # referenced count lost but not queued
    with pytest.raises(AssertionError, match="in no free queue"):
        pool.check_invariants()
    a.ref_cnt = 1
    pool.cached[h(1)] = a  # index entry the block does not know about
    with pytest.raises(AssertionError):
        pool.check_invariants()
