"""Physical KV blocks: reference counts, O(1) free queues and the prefix-cache index.

Unreferenced blocks sit in one of two doubly linked queues, both first-in first-out:

- ``free_queue``: blocks that hold nothing worth keeping (never cached, or their cache entry dropped);
- ``evictable_queue``: blocks that still hold a cached prefix, least recently released first.

Allocation takes from ``free_queue`` first and evicts from ``evictable_queue`` only when it is empty, so a
cached prefix survives as long as the pool has any other room. Every operation on the allocation and
release paths is O(1) per block handed out or taken back; nothing scans the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from pagoda.engine.kv_cache.events import NULL_EVENTS
from pagoda.engine.kv_cache.hashing import BlockHash

EvictHook = Callable[[int, BlockHash], None]


class Block:
    """One physical block. ``prev_free``/``next_free`` link it into a free queue while unreferenced."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of blocks between two sentinels: O(1) append, pop from the front, unlink."""

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: Block) -> None:
        """Add at the back (it leaves last)."""
        if block.prev_free is not None or block.next_free is not None:
            raise AssertionError(f"{block} is already in a free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def popleft(self) -> Block:
        """Take the block at the front (the one queued longest ago)."""
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("pop from an empty FreeBlockQueue")
        self.remove(first)
        return first

    def remove(self, block: Block) -> None:
        """Unlink ``block`` from wherever it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise AssertionError(f"{block} is not in a free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self) -> Iterator[Block]:
        """Front to back. For checks and tests only: O(n)."""
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    """All physical blocks of one KV cache, with their reference counts and the cache index hash -> block.

    ``on_evict(block_id, block_hash)`` is called when a cached, unreferenced block is taken for reuse,
    before it is handed out; the offload tiers use it to copy the block's KV down a tier before the next
    forward overwrites it.
    """

    def __init__(
        self, num_blocks: int, enable_prefix_caching: bool = True, on_evict: EvictHook | None = None
    ):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.on_evict = on_evict
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.evictable_queue = FreeBlockQueue()
        self.cached: dict[BlockHash, Block] = {}
        self.num_evictions = 0
        self.events = NULL_EVENTS  # a KVEventLog when a server publishes block events (events.py)

    # -- counts -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks obtainable now: empty ones plus cached ones that may be evicted."""
        return len(self.free_queue) + len(self.evictable_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold a cached prefix."""
        return len(self.evictable_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # -- allocation and release ---------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[Block]:
        """``n`` blocks with ref count 1, evicting cached blocks least recently released first if needed."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, only {self.num_free_blocks} are free")
        out: list[Block] = []
        for _ in range(n):
            if len(self.free_queue):
                block = self.free_queue.popleft()
            else:
                block = self.evictable_queue.popleft()
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        block_hash = block.block_hash
        assert block_hash is not None and self.cached.get(block_hash) is block
        del self.cached[block_hash]
        block.block_hash = None
        self.num_evictions += 1
        self.events.removed("device", block_hash)
        if self.on_evict is not None:
            self.on_evict(block.block_id, block_hash)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block; an unreferenced cached block leaves the evictable queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._queue_of(block).remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block, in the order given: the first block to reach zero is the
        first to be evicted later, so pass a sequence's blocks tail first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"{block} freed more times than it was referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._queue_of(block).append(block)

    def _queue_of(self, block: Block) -> FreeBlockQueue:
        return self.evictable_queue if block.block_hash is not None else self.free_queue

    # -- cache index --------------------------------------------------------------------------------------
    def lookup(self, block_hash: BlockHash) -> int | None:
        """The id of the block cached under ``block_hash``, or None."""
        block = self.cached.get(block_hash)
        return None if block is None else block.block_id

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: Block, block_hash: BlockHash) -> bool:
        """Register a referenced, full, computed block under ``block_hash``.

        Returns False (and changes nothing) when another block already holds that hash: the two hold the
        same KV, and one index entry is enough.
        """
        if not self.enable_prefix_caching:
            return False
        if block.ref_cnt <= 0:
            raise AssertionError(f"only referenced blocks can be cached, got {block}")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise AssertionError(f"{block} is already cached under another hash")
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self.events.stored("device", block_hash)
        return True

    def insert_external(self, block_hash: BlockHash) -> Block | None:
        """Allocate a block and register it under ``block_hash``, for KV loaded from another tier.

        The block comes back with ref count 1: the caller writes the KV into it, then either hands the
        reference to a sequence or releases it with :meth:`free_blocks` (it then stays cached). Returns None
        when the hash is already cached, prefix caching is off, or no block is free.
        """
        if not self.enable_prefix_caching or block_hash in self.cached or self.num_free_blocks == 0:
            return None
        (block,) = self.get_new_blocks(1)
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self.events.stored("device", block_hash)
        return block

    def reset_prefix_cache(self, reserved: int = 0) -> bool:
        """Forget every cached prefix. Refused (False, no change) while any block is referenced (beyond the
        ``reserved`` ones its owner holds for good), because a running sequence's blocks would silently
        lose their cache entries."""
        if self.num_used_blocks > reserved:
            return False
        while len(self.evictable_queue):
            block = self.evictable_queue.popleft()
            block.block_hash = None
            self.free_queue.append(block)
        self.cached.clear()
        self.events.cleared("device")
        return True

    # -- checks -------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError when the queues, ref counts and cache index disagree. O(num_blocks)."""
        seen: set[int] = set()
        for queue, cached in ((self.free_queue, False), (self.evictable_queue, True)):
            count = 0
            prev = queue._head
            for block in queue:
                assert block.prev_free is prev, f"broken back link at {block}"
                assert block.block_id not in seen, f"{block} is queued twice"
                seen.add(block.block_id)
                assert block.ref_cnt == 0, f"{block} is queued as free but referenced"
                if cached:
                    assert block.block_hash is not None, f"{block} is evictable but not cached"
                    assert self.cached.get(block.block_hash) is block, f"{block} is not in the cache index"
                else:
                    assert block.block_hash is None, f"{block} is in the free queue but still cached"
                prev = block
                count += 1
            assert queue._tail.prev_free is prev, "broken tail link"
            assert count == len(queue), f"queue length {len(queue)} but {count} blocks linked"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            if block.ref_cnt == 0:
                assert block.block_id in seen, f"{block} is unreferenced but in no free queue"
            else:
                assert block.prev_free is None and block.next_free is None, (
                    f"{block} is referenced and linked"
                )
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, (
                    f"{block} has a hash missing from the index"
                )
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"index entry {block_hash.hex()[:8]} points at {block}"
        if not self.enable_prefix_caching:
            assert not self.cached, "prefix caching is off but the index is not empty"
