"""The engine's KV event log (engine/kv_cache/events.py) and the router's reader of it (router/index.py):
ordering, bounded memory, loss -> re-sync from a snapshot, and the block pool's hooks."""

from __future__ import annotations

from pagoda.engine.kv_cache.block_pool import BlockPool
from pagoda.engine.kv_cache.events import KVEventLog
from pagoda.engine.kv_cache.hashing import hash_block_tokens
from pagoda.router.index import BlockIndex


def h(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def follow(log: KVEventLog, index: BlockIndex) -> bool:
    """One reader round as the router does it; True when a snapshot was needed."""
    if index.synced and index.apply(log.since(index.seq, index.epoch)):
        return False
    index.load_snapshot(log.snapshot())
    return True


def test_batches_are_numbered_in_order_and_hold_events_in_publication_order():
    log = KVEventLog(max_batch_events=3)
    for i in range(5):
        log.stored("device", h(i))
    log.removed("device", h(1))
    log.removed("device", h(99))  # never stored: nothing to say
    log.stored("device", h(0))  # already there: nothing to say
    out = log.since(0)
    assert out["resync"] is False
    assert [b["seq"] for b in out["batches"]] == [1, 2]  # 3 events sealed early, the rest sealed on read
    events = [tuple(e) for b in out["batches"] for e in b["events"]]
    assert events == [("stored", "device", h(i).hex()) for i in range(5)] + [
        ("removed", "device", h(1).hex())
    ]
    assert log.since(2)["batches"] == [] and log.since(1)["batches"][0]["seq"] == 2


def test_reader_follows_exactly_and_resyncs_after_falling_behind_the_bound():
    log = KVEventLog(max_batches=4, max_batch_events=1)
    index = BlockIndex()
    assert follow(log, index) is True  # first contact: snapshot
    log.stored("device", h(1))
    log.stored("host", h(2))
    assert follow(log, index) is False
    assert index.tiers["device"] == {h(1).hex()} and index.tiers["host"] == {h(2).hex()}
    # 10 one-event batches while the reader sleeps: only the last 4 are kept, so it must re-sync
    for i in range(10, 20):
        log.stored("disk", h(i))
    log.removed("host", h(2))
    assert log.since(index.seq, index.epoch)["resync"] is True
    assert follow(log, index) is True
    assert index.tiers["disk"] == {h(i).hex() for i in range(10, 20)}
    assert index.tiers["host"] == set() and index.seq == log.seq
    log.cleared("disk")
    assert follow(log, index) is False and index.tiers["disk"] == set()


def test_a_gap_or_another_epoch_means_resync():
    log = KVEventLog(max_batch_events=1)
    index = BlockIndex()
    follow(log, index)
    log.stored("device", h(1))
    log.stored("device", h(2))
    answer = log.since(index.seq, index.epoch)
    del answer["batches"][0]  # batch 1 lost in transit
    assert index.apply(answer) is False
    assert h(2).hex() not in index.tiers["device"]  # nothing after the gap was applied
    restarted = KVEventLog()
    assert restarted.since(index.seq, index.epoch)["resync"] is True  # a new process lifetime
    assert index.apply(restarted.since(0)) is False  # epoch differs


def test_sync_tier_publishes_the_difference_only():
    log = KVEventLog()
    assert log.sync_tier("host", [h(1), h(2)]) == 2
    assert log.sync_tier("host", [h(2), h(3)]) == 2  # 1 removed, 3 stored
    assert log.sync_tier("host", [h(2), h(3)]) == 0
    events = [tuple(e) for b in log.since(0)["batches"] for e in b["events"]]
    assert ("removed", "host", h(1).hex()) in events and ("stored", "host", h(3).hex()) in events
    assert log.snapshot()["tiers"]["host"] == sorted([h(2).hex(), h(3).hex()])


def test_block_pool_publishes_cache_evict_and_reset():
    pool = BlockPool(2)
    log = KVEventLog()
    pool.events = log
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(2))
    pool.free_blocks([b, a])
    assert log.counts()["device"] == 2
    (c,) = pool.get_new_blocks(1)  # evicts h(2), released first
    assert log.snapshot()["tiers"]["device"] == [h(1).hex()]
    pool.free_blocks([c])
    ext = pool.insert_external(h(3))
    assert ext is not None and log.counts()["device"] == 2
    pool.free_blocks([ext])
    assert pool.reset_prefix_cache() is True
    events = [tuple(e) for bt in log.since(0)["batches"] for e in bt["events"]]
    assert events == [
        ("stored", "device", h(1).hex()),
        ("stored", "device", h(2).hex()),
        ("removed", "device", h(2).hex()),
        ("stored", "device", h(3).hex()),
        ("cleared", "device", ""),
    ]
    assert log.counts()["device"] == 0
