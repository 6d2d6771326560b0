"""Per-sequence block tables over one BlockPool: allocation on demand, prefix hits, forks and copy-on-write.

The scheduler drives it in this order for a sequence:

1. ``get_computed_tokens`` once when the sequence (re)starts: the cached prefix becomes its first blocks;
2. before each step ``allocate_slots(seq, total_tokens_after_the_step)``; the tokens from the previous total
   up to the new one are the ones the step writes, and a shared block among them is copied first;
3. after each step ``cache_blocks(seq, token_ids, num_computed_tokens)`` registers the blocks that became full;
4. ``fork`` for extra samples (n > 1), ``free`` when the sequence finishes, is aborted or preempted.

A model with sliding-window layers beside full-attention ones (Gemma 2/3) may give the manager a second pool,
the window group (``window``, ``num_window_blocks``): every sequence then has a second table aligned with the
first (logical block i in both), the one the sliding layers read. Its entries for blocks no query of the
sequence can see any more (more than ``window`` positions behind the next token to write) go back to the
window pool and read as the null block 0, which the pool reserves and the kernels mask out. A prefix hit
needs the full group's blocks and the window group's last blocks before the hit's end (``window_hit_ok``).

Every device-cache write that is not a forward (copy-on-write copies, saves of evicted blocks down a tier,
loads from a tier) is recorded in one ordered log, ``take_ops`` hands it to the model runner with the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from pagoda.engine.kv_cache.block_pool import Block, BlockPool, EvictHook
from pagoda.engine.kv_cache.hashing import BlockHash, encode_extra_keys, hash_block_tokens, hash_full_blocks
from pagoda.engine.kv_cache.ops import CopyBlock, KVOp, KVOpLog, LoadBlock, RotateBlock, SaveBlock
from pagoda.engine.kv_cache.partial_index import PartialBlockIndex


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _SeqState:
    blocks: list[Block] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose slots were handed out: the next write starts here
    hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of its first full blocks
    num_cached: int = 0  # leading blocks already offered to the cache index
    root: BlockHash | None = None  # parent of the first block: None, or a LoRA adapter's chain root
    # Attention sinks: after an eviction nothing more is cached (cache_limit 0): later blocks hold KV that
    # depended on dropped context, and the table's sinks are rotated copies. The sinks as written stay
    # aside (sink_sources, referenced, still cached) as the source of every rotation; position_offset
    # counts the tokens evicted since the table was built.
    cache_limit: int | None = None
    sink_sources: list[Block] = field(default_factory=list)
    position_offset: int = 0
    # The window group's table, aligned with ``blocks``: None for a block that left the window (or was never
    # needed there: before a prefix hit's window). Empty when the manager has no window group.
    win: list[Block | None] = field(default_factory=list)


class KVCacheManager:
    """Block tables, prefix cache and accounting for one KV cache of ``num_blocks`` blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_keys: tuple[str, ...] = (),
        enable_partial_prefix_reuse: bool = False,
        on_evict: EvictHook | None = None,
        should_save: Callable[[BlockHash], bool] | None = None,
        window: int | None = None,
        num_window_blocks: int = 0,
    ) -> None:
        """``on_evict`` observes every eviction; ``should_save(hash)`` says whether an evicted block's KV
        goes down a tier (a SaveBlock op, ordered before anything that reuses the block). ``window``: the
        sliding layers' window in tokens, with a pool of ``num_window_blocks`` blocks for them (block 0 of
        it reserved as the null block); None keeps one pool for every layer."""
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if window is not None:
            if window < 1 or num_window_blocks < 2:
                raise ValueError(
                    f"a window group needs a window of at least 1 token and at least 2 blocks, got "
                    f"window={window!r}, num_window_blocks={num_window_blocks!r}"
                )
            if should_save is not None or enable_partial_prefix_reuse:
                raise ValueError(
                    "the sliding-window cache runs without offload tiers and partial prefix reuse"
                )
        self.window = window
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_partial_prefix_reuse = enable_partial_prefix_reuse and enable_prefix_caching
        self.extra_keys = tuple(extra_keys)
        self._extra = encode_extra_keys(self.extra_keys)
        self._observer = on_evict
        self._should_save = should_save
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching, self._on_evict)
        self.window_pool: BlockPool | None = None
        self.num_window_blocks = 0
        if window is not None:
            self.window_pool = BlockPool(num_window_blocks, enable_prefix_caching)
            self.num_window_blocks = num_window_blocks
            (self._null,) = self.window_pool.get_new_blocks(1)  # block 0, never handed to a table
            assert self._null.block_id == 0
        self._seqs: dict[str, _SeqState] = {}
        self.partial_index = PartialBlockIndex()
        self._ops = KVOpLog()
        self.prefix_cache_queries = 0  # tokens looked up, cumulative
        self.prefix_cache_hits = 0  # tokens found, cumulative
        self.partial_reuse_tokens = 0  # of which found by sub-block reuse, cumulative

    # -- accounting ---------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks obtainable now: empty plus evictable cached ones."""
        return self.block_pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks still holding a cached prefix (they count as free too)."""
        return self.block_pool.num_cached_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_used_blocks

    @property
    def usage(self) -> float:
        """The fuller pool's usage, 0..1 (vllm:kv_cache_usage_perc): either pool running out blocks admission,
        so with a window group this is the larger of the two (``pool_usage``)."""
        return max(self.pool_usage.values())

    @property
    def pool_usage(self) -> dict[str, float]:
        """Each pool's blocks in use over its usable blocks: ``full`` and, with a window group, ``window``
        (whose reserved null block counts as neither used nor usable)."""
        usage = {"full": self.num_used_blocks / self.num_blocks}
        if self.window_pool is not None:
            usable = self.num_window_blocks - 1
            usage["window"] = (self.window_pool.num_used_blocks - 1) / usable
        return usage

    @property
    def extra_key_bytes(self) -> bytes:
        """The encoded extra keys, for hashing blocks the same way outside the manager."""
        return self._extra

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    def has_seq(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def get_block_table(self, seq_id: str) -> list[int]:
        state = self._seqs.get(seq_id)
        return [] if state is None else [b.block_id for b in state.blocks]

    def get_window_block_table(self, seq_id: str) -> list[int] | None:
        """The sliding layers' table of ``seq_id`` (0 for blocks out of the window); None without a window
        group."""
        if self.window_pool is None:
            return None
        state = self._seqs.get(seq_id)
        return [] if state is None else [0 if b is None else b.block_id for b in state.win]

    @property
    def num_free_window_blocks(self) -> int:
        """Window-pool blocks obtainable now (0 without a window group)."""
        return 0 if self.window_pool is None else self.window_pool.num_free_blocks

    def set_event_log(self, events) -> None:
        """Publish device block events to ``events``: a hash is announced once every group holds it and
        withdrawn when one group lets it go, so the router never counts a block the engine cannot serve."""
        if self.window_pool is None:
            self.block_pool.events = events
            return
        both = _BothGroups(events)
        self.block_pool.events = both.group(0)
        self.window_pool.events = both.group(1)

    def get_num_tokens(self, seq_id: str) -> int:
        """Tokens of ``seq_id`` that have slots (prefix hits plus everything allocated since)."""
        state = self._seqs.get(seq_id)
        return 0 if state is None else state.num_tokens

    def chain_root(self, seq_id: str) -> BlockHash | None:
        """The parent of ``seq_id``'s first block (its LoRA adapter's root, or None)."""
        state = self._seqs.get(seq_id)
        return None if state is None else state.root

    def get_position_offset(self, seq_id: str) -> int:
        """Attention sinks: tokens evicted from ``seq_id``'s cache since its table was built, which its rotary
        positions add to cache positions (0 for any other sequence)."""
        state = self._seqs.get(seq_id)
        return 0 if state is None else state.position_offset

    def get_block_hashes(self, seq_id: str) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``seq_id`` known so far (for the offload tiers)."""
        state = self._seqs.get(seq_id)
        return [] if state is None else list(state.hashes)

    def _on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        self.partial_index.remove(block_id)
        if self._observer is not None:
            self._observer(block_id, block_hash)
        if self._should_save is not None and self._should_save(block_hash):
            self._ops.append(SaveBlock(block_id, block_hash))

    # -- prefix cache -------------------------------------------------------------------------------------
    def _max_hit_blocks(self, num_tokens: int) -> int:
        # Leave at least one token to compute: its logits are what the step is for.
        return max(0, (num_tokens - 1) // self.block_size)

    def _window_start(self, pos: int) -> int:
        """The first logical block a query at position ``pos`` reads in a sliding layer (0 without a window
        group): keys ``pos - window + 1 .. pos`` are in its window."""
        if self.window is None:
            return 0
        return max(0, pos - self.window + 1) // self.block_size

    def _hit_blocks(self, token_ids: Sequence[int], root: BlockHash | None) -> tuple[list[BlockHash], int]:
        """(the chained hashes looked up, the blocks of the longest usable hit): the full group's blocks
        0..n-1 must be cached, and with a window group also its blocks from ``_window_start(n * bs)`` to n-1,
        the ones the first computed token reads; a hit the window group cannot serve is shortened."""
        bs = self.block_size
        parent = root
        hashes: list[BlockHash] = []
        for i in range(self._max_hit_blocks(len(token_ids))):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], self._extra)
            hashes.append(parent)
            if self.block_pool.get_cached_block(parent) is None:
                return hashes, self._window_hit(hashes, i)
        return hashes, self._window_hit(hashes, len(hashes))

    def _window_hit(self, hashes: list[BlockHash], n: int) -> int:
        """The longest hit of at most ``n`` blocks the window group can serve (``n`` without one)."""
        if self.window_pool is None:
            return n
        run = 0  # window-cached blocks ending at the block before the candidate's end
        runs = []
        for i in range(n):
            run = run + 1 if self.window_pool.get_cached_block(hashes[i]) is not None else 0
            runs.append(run)
        while n > 0 and runs[n - 1] < n - self._window_start(n * self.block_size):
            n -= 1
        return n

    def find_cached_prefix(self, token_ids: Sequence[int], root: BlockHash | None = None) -> int:
        """How many tokens ``get_computed_tokens`` would return now; no references, no counters."""
        if not self.enable_prefix_caching:
            return 0
        return self._hit_blocks(token_ids, root)[1] * self.block_size

    def get_computed_tokens(
        self, seq_id: str, token_ids: Sequence[int], root: BlockHash | None = None
    ) -> int:
        """Start ``seq_id``'s block table with the longest cached chain of full blocks matching
        ``token_ids`` (references taken) and return the tokens it covers, a multiple of block_size that
        leaves at least one token to compute. Counts a query of len(token_ids) tokens and the hits.
        ``root`` starts the chain (a LoRA adapter's, `hashing.adapter_chain_root`); None for the base model."""
        state = self._seqs.get(seq_id)
        if state is not None and state.blocks:
            raise ValueError(f"seq_id {seq_id!r} already has blocks; free it before looking up its prefix")
        state = _SeqState(root=root)
        self._seqs[seq_id] = state
        if not self.enable_prefix_caching:
            return 0
        hashes, n = self._hit_blocks(token_ids, root)
        state.hashes = hashes
        hits = [self.block_pool.get_cached_block(h) for h in hashes[:n]]
        self.block_pool.touch(hits)
        state.blocks = hits
        if self.window_pool is not None:
            lo = self._window_start(n * self.block_size)
            win = [self.window_pool.get_cached_block(h) for h in hashes[lo:n]]
            self.window_pool.touch(win)
            state.win = [None] * lo + win
        state.num_cached = n
        state.num_tokens = n * self.block_size
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += state.num_tokens
        return state.num_tokens

    def append_loaded_blocks(self, seq_id: str, blocks: list[Block], hashes: list[BlockHash]) -> None:
        """Extend ``seq_id``'s prefix hit with blocks loaded from an offload tier (each already cached under
        its hash, one reference held for the sequence); ``hashes`` continue the chain of the hit."""
        state = self._state(seq_id)
        if self.window_pool is not None:
            raise ValueError("blocks loaded from an offload tier have no window-group blocks")
        if len(blocks) != len(hashes):
            raise ValueError(
                f"blocks and hashes must have the same length, got {len(blocks)} and {len(hashes)}"
            )
        if state.num_tokens != len(state.blocks) * self.block_size or state.num_cached != len(state.blocks):
            raise ValueError(
                f"seq_id {seq_id!r} has blocks beyond its prefix hit; load right after the lookup"
            )
        state.hashes = state.hashes[: len(state.blocks)] + list(hashes)
        state.blocks.extend(blocks)
        state.num_cached = len(state.blocks)
        state.num_tokens = len(state.blocks) * self.block_size

    def cache_blocks(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """The first ``num_computed_tokens`` of ``token_ids`` hold computed KV in ``seq_id``'s blocks:
        register each full block among them in the cache index (first holder of a hash wins)."""
        if not self.enable_prefix_caching:
            return
        state = self._state(seq_id)
        if not 0 <= num_computed_tokens <= len(token_ids):
            raise ValueError(
                f"num_computed_tokens must be between 0 and len(token_ids)={len(token_ids)}, "
                f"got {num_computed_tokens}"
            )
        num_full = min(num_computed_tokens // self.block_size, len(state.blocks))
        if state.cache_limit is not None:
            num_full = min(num_full, state.cache_limit)
        if num_full <= state.num_cached:
            return
        if len(state.hashes) < num_full:
            known = len(state.hashes)
            state.hashes += hash_full_blocks(
                token_ids,
                self.block_size,
                self._extra,
                parent=state.hashes[-1] if known else state.root,
                start_block=known,
                max_blocks=num_full - known,
            )
        bs = self.block_size
        for i in range(state.num_cached, num_full):
            block = state.blocks[i]
            if self.block_pool.cache_block(block, state.hashes[i]) and self.enable_partial_prefix_reuse:
                parent = state.hashes[i - 1] if i else state.root
                self.partial_index.add(block.block_id, parent, token_ids[i * bs : (i + 1) * bs])
            if state.win and state.win[i] is not None:
                self.window_pool.cache_block(state.win[i], state.hashes[i])
        state.num_cached = num_full

    def reset_prefix_cache(self) -> bool:
        """Drop the cache index; False (and no change) while any block is referenced."""
        if self.window_pool is not None and self.window_pool.num_used_blocks > 1:
            return False
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.window_pool is not None:
            self.window_pool.reset_prefix_cache(reserved=1)
        self.partial_index.clear()
        return True

    def reuse_partial_block(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Right after the lookup (and any tier loads): find a cached block that continues the last matched
        block and shares its first k tokens with the next ones of ``token_ids``; copy it into a fresh block
        (a CopyBlock op, ordered before the forward, which then writes slots k.. of the copy) and return k,
        the tokens gained (0 when off, nothing matches or the pool is full). At least one token is always
        left to compute, and never more of the cached block than its first k tokens is counted."""
        if not self.enable_partial_prefix_reuse:
            return 0
        state = self._state(seq_id)
        bs = self.block_size
        m = len(state.blocks)
        if state.num_tokens != m * bs:
            return 0
        max_k = min(bs - 1, len(token_ids) - 1 - m * bs)
        parent = state.hashes[m - 1] if m else state.root
        match = self.partial_index.best_match(parent, token_ids[m * bs : m * bs + bs], max_k)
        if match is None or self.block_pool.num_free_blocks < 1:
            return 0
        src_id, k = match
        src = self.block_pool.blocks[src_id]
        # Hold the source while taking the fresh block, so the allocation cannot evict it.
        self.block_pool.touch([src])
        if self.block_pool.num_free_blocks < 1:
            self.block_pool.free_blocks([src])
            return 0
        (dst,) = self.block_pool.get_new_blocks(1)
        self._ops.append(CopyBlock(src.block_id, dst.block_id))
        self.block_pool.free_blocks([src])
        state.blocks.append(dst)
        state.num_tokens = m * bs + k
        self.prefix_cache_hits += k
        self.partial_reuse_tokens += k
        return k

    # -- allocation ---------------------------------------------------------------------------------------
    def _plan(self, seq_id: str, num_tokens: int) -> tuple[int, list[int]]:
        """(new blocks to append, table indices to copy on write) for covering ``num_tokens`` tokens."""
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        state = self._seqs.get(seq_id)
        if state is None:
            return _cdiv(num_tokens, self.block_size), []
        needed = _cdiv(num_tokens, self.block_size)
        num_new = max(0, needed - len(state.blocks))
        cow: list[int] = []
        if num_tokens > state.num_tokens:
            for i in range(state.num_tokens // self.block_size, min(needed, len(state.blocks))):
                if state.blocks[i].ref_cnt > 1:
                    cow.append(i)
        return num_new, cow

    def _plan_window(self, state: _SeqState | None, num_tokens: int) -> tuple[int, list[int], list[int]]:
        """The window group's part of covering ``num_tokens``: (table indices whose blocks leave the window,
        indices that get a fresh block, indices to copy on write). The step's first query sits at the
        table's token count, so nothing before its window start is read by it or any later step."""
        start = 0 if state is None else state.num_tokens
        needed = _cdiv(num_tokens, self.block_size)
        lo = self._window_start(start)
        win = [] if state is None else state.win
        leave = [i for i in range(min(lo, len(win))) if win[i] is not None]
        fresh = [i for i in range(lo, needed) if i >= len(win) or win[i] is None]
        cow: list[int] = []
        if num_tokens > start:
            for i in range(max(lo, start // self.block_size), min(needed, len(win))):
                block = win[i]
                if block is not None and block.ref_cnt > 1:
                    cow.append(i)
        return leave, fresh, cow

    def num_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Blocks ``allocate_slots(seq_id, num_tokens)`` would take from the pool (copies included)."""
        num_new, cow = self._plan(seq_id, num_tokens)
        return num_new + len(cow)

    def num_window_blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Window-pool blocks ``allocate_slots(seq_id, num_tokens)`` would take, net of the blocks the
        sequence gives back first (0 without a window group)."""
        if self.window_pool is None:
            return 0
        leave, fresh, cow = self._plan_window(self._seqs.get(seq_id), num_tokens)
        state = self._seqs.get(seq_id)
        gained = sum(1 for i in leave if state.win[i].ref_cnt == 1)
        return len(fresh) + len(cow) - gained

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.num_blocks_needed(seq_id, num_tokens) <= self.block_pool.num_free_blocks and (
            self.num_window_blocks_needed(seq_id, num_tokens) <= self.num_free_window_blocks
        )

    def allocate_slots(self, seq_id: str, num_tokens: int) -> bool:
        """Make ``seq_id``'s table cover ``num_tokens`` tokens in total, copying a shared block the new
        tokens will be written into; with a window group, first give back the window blocks the step's
        queries can no longer see. False, with nothing changed, when a pool is short."""
        num_new, cow = self._plan(seq_id, num_tokens)
        if num_new + len(cow) > self.block_pool.num_free_blocks:
            return False
        if self.num_window_blocks_needed(seq_id, num_tokens) > self.num_free_window_blocks:
            return False
        state = self._seqs.setdefault(seq_id, _SeqState())
        if self.window_pool is not None:
            self._allocate_window(state, num_tokens)
        fresh = self.block_pool.get_new_blocks(num_new + len(cow))
        for i, dst in zip(cow, fresh, strict=False):
            src = state.blocks[i]
            self._ops.append(CopyBlock(src.block_id, dst.block_id))
            state.blocks[i] = dst
            self.block_pool.free_blocks([src])
        state.blocks.extend(fresh[len(cow) :])
        state.num_tokens = max(state.num_tokens, num_tokens)
        return True

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Give back the slots past ``num_tokens`` (speculative decoding: the rejected proposals'): whole
        blocks past the last one still needed return to the pool unhashed (none of them is full of computed
        tokens, so none was ever offered to the cache index); the next write starts at ``num_tokens``."""
        state = self._state(seq_id)
        if num_tokens >= state.num_tokens:
            return
        keep = _cdiv(num_tokens, self.block_size)
        if num_tokens < state.num_cached * self.block_size:
            raise ValueError(f"cannot truncate {seq_id!r} into its cached blocks")
        extra = state.blocks[keep:]
        if extra:
            del state.blocks[keep:]
            self.block_pool.free_blocks(reversed(extra))
            self._ops.drop_copies_into({b.block_id for b in extra if b.ref_cnt == 0})
        if state.win and len(state.win) > keep:
            win = [b for b in state.win[keep:] if b is not None]
            del state.win[keep:]
            self.window_pool.free_blocks(reversed(win))
            self._ops.drop_copies_into({b.block_id for b in win if b.ref_cnt == 0}, window=True)
        state.num_tokens = num_tokens

    def _allocate_window(self, state: _SeqState, num_tokens: int) -> None:
        """The window group's side of ``allocate_slots`` (room already checked)."""
        pool = self.window_pool
        leave, fresh, cow = self._plan_window(state, num_tokens)
        # Tail first among those leaving, like `free`: the chain's tail is evicted before its head.
        pool.free_blocks(state.win[i] for i in reversed(leave))
        self._ops.drop_copies_into({state.win[i].block_id for i in leave if state.win[i].ref_cnt == 0}, True)
        for i in leave:
            state.win[i] = None
        new = pool.get_new_blocks(len(fresh) + len(cow))
        for i, dst in zip(cow, new, strict=False):
            src = state.win[i]
            self._ops.append(CopyBlock(src.block_id, dst.block_id, window=True))
            state.win[i] = dst
            pool.free_blocks([src])
        needed = _cdiv(num_tokens, self.block_size)
        if len(state.win) < needed:
            state.win.extend([None] * (needed - len(state.win)))
        for i, block in zip(fresh, new[len(cow) :], strict=True):
            state.win[i] = block

    def drop_blocks(self, seq_id: str, first: int, count: int) -> bool:
        """Attention sinks: free table entries ``first .. first + count`` (whole blocks of computed tokens
        between the sinks and the window). The blocks after them keep their KV, keys included: rotary
        positions go on counting past the evicted tokens (``get_position_offset``), so every distance inside
        the window stays the true one. The ``first`` sink blocks must then look that many tokens further
        back than they were written: the first eviction sets the written blocks aside (still referenced and
        cached, a prefix others may share) and gives the table private copies, and every eviction writes
        into those copies the written keys rotated by the whole offset (CopyBlock, then RotateBlock), so no
        key is rotated twice. From then on nothing more of the table is cached. False, with nothing
        changed, when the pool has no room for the copies."""
        state = self._state(seq_id)
        if self.window_pool is not None:
            raise ValueError("attention sinks need the full-attention cache layout (no window group)")
        if count < 1 or first < 0 or first + count > len(state.blocks):
            raise ValueError(
                f"cannot drop blocks {first}..{first + count} of a {len(state.blocks)}-block table"
            )
        if state.num_tokens < (first + count) * self.block_size:
            raise ValueError("only whole blocks of tokens already written can be dropped")
        sinks = state.blocks[:first]
        # The first eviction copies every sink block; later ones only a copy another table shares (a fork).
        copies = [i for i, b in enumerate(sinks) if not state.sink_sources or b.ref_cnt > 1]
        dropped = state.blocks[first : first + count]
        gained = sum(1 for b in dropped if b.ref_cnt == 1)  # freeing them first may make the copies' room
        if len(copies) > self.block_pool.num_free_blocks + gained:
            return False
        del state.blocks[first : first + count]
        self.block_pool.free_blocks(reversed(dropped))
        self._ops.drop_copies_into({b.block_id for b in dropped if b.ref_cnt == 0})
        if not state.sink_sources:
            state.sink_sources = list(sinks)  # their references move from the table to here
        fresh = self.block_pool.get_new_blocks(len(copies))
        for i, dst in zip(copies, fresh, strict=True):
            src = state.blocks[i]
            self._ops.append(CopyBlock(src.block_id, dst.block_id))  # the values; the keys come next
            state.blocks[i] = dst
            if src not in state.sink_sources:
                self.block_pool.free_blocks([src])
        state.position_offset += count * self.block_size
        for src, dst in zip(state.sink_sources, state.blocks[:first], strict=True):
            self._ops.append(RotateBlock(src.block_id, dst.block_id, state.position_offset))
        state.num_tokens -= count * self.block_size
        state.cache_limit = 0
        state.num_cached = min(state.num_cached, first)
        del state.hashes[first:]
        return True

    def take_ops(self) -> list[KVOp]:
        """Device-cache writes recorded since the last call; run them in this order before the forward."""
        return self._ops.take()

    @property
    def num_pending_ops(self) -> int:
        return len(self._ops)

    def save_blocks(self, seq_id: str) -> list[SaveBlock]:
        """Record saves of ``seq_id``'s cached full blocks (swap preemption), before it frees them."""
        state = self._seqs.get(seq_id)
        if state is None or self._should_save is None:
            return []
        saves = [
            SaveBlock(b.block_id, b.block_hash)
            for b in state.blocks[: state.num_cached]
            if b.block_hash is not None and self._should_save(b.block_hash)
        ]
        for op in saves:
            self._ops.append(op)
        return saves

    def load_blocks(self, seq_id: str, hashes: list[BlockHash], data: list[torch.Tensor]) -> int:
        """Extend ``seq_id``'s prefix hit with KV from a lower tier: each block is allocated, registered under
        its hash and filled by a LoadBlock op (ordered after the saves its allocation caused). Returns the
        number of blocks loaded (fewer when the pool runs out)."""
        blocks: list[Block] = []
        for block_hash, tensor in zip(hashes, data, strict=True):
            block = self.block_pool.insert_external(block_hash)
            if block is None:
                break
            self._ops.append(LoadBlock(block.block_id, tensor))
            blocks.append(block)
        if blocks:
            self.append_loaded_blocks(seq_id, blocks, hashes[: len(blocks)])
        return len(blocks)

    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` shares all of ``parent_id``'s blocks; the first write into a shared block copies it."""
        parent = self._state(parent_id)
        existing = self._seqs.get(child_id)
        if existing is not None and existing.blocks:
            raise ValueError(f"child_id {child_id!r} already has blocks")
        self.block_pool.touch(parent.blocks)
        self.block_pool.touch(parent.sink_sources)
        if self.window_pool is not None:
            self.window_pool.touch(b for b in parent.win if b is not None)
        self._seqs[child_id] = _SeqState(
            blocks=list(parent.blocks),
            num_tokens=parent.num_tokens,
            hashes=list(parent.hashes),
            num_cached=parent.num_cached,
            cache_limit=parent.cache_limit,
            root=parent.root,
            sink_sources=list(parent.sink_sources),
            position_offset=parent.position_offset,
            win=list(parent.win),
        )

    def free(self, seq_id: str) -> None:
        """Release ``seq_id``'s blocks, tail first so the tail of a cached chain is evicted before its head.
        Unknown ids are ignored, so aborting twice is harmless."""
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self.block_pool.free_blocks(reversed(state.blocks))
            self.block_pool.free_blocks(state.sink_sources)  # a shared prefix's head: evicted last
            self._ops.drop_copies_into({b.block_id for b in state.blocks if b.ref_cnt == 0})
            if self.window_pool is not None:
                win = [b for b in state.win if b is not None]
                self.window_pool.free_blocks(reversed(win))
                self._ops.drop_copies_into({b.block_id for b in win if b.ref_cnt == 0}, window=True)

    def _state(self, seq_id: str) -> _SeqState:
        state = self._seqs.get(seq_id)
        if state is None:
            raise ValueError(f"unknown seq_id {seq_id!r}")
        return state

    # -- checks -------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError when tables, ref counts, queues and the cache index disagree."""
        self.block_pool.check_invariants()
        refs = [0] * self.num_blocks
        for seq_id, state in self._seqs.items():
            assert len(state.blocks) >= _cdiv(state.num_tokens, self.block_size), f"{seq_id}: table too short"
            assert state.num_cached <= len(state.blocks), f"{seq_id}: more cached blocks than blocks"
            assert state.num_cached <= len(state.hashes), f"{seq_id}: cached blocks without hashes"
            assert len({b.block_id for b in state.blocks}) == len(state.blocks), f"{seq_id}: repeated block"
            for block in state.sink_sources:
                refs[block.block_id] += 1
            for i, block in enumerate(state.blocks):
                refs[block.block_id] += 1
                if block.block_hash is not None and i < len(state.hashes):
                    assert block.block_hash == state.hashes[i], (
                        f"{seq_id}: block {i} cached under another hash"
                    )
        for block in self.block_pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"{block}: ref count {block.ref_cnt} but {refs[block.block_id]} tables hold it"
            )
        assert self.block_pool.num_used_blocks == sum(1 for r in refs if r > 0), "used-block count is off"
        if self.window_pool is not None:
            self._check_window_invariants()
        for block_id, _parent, tokens in self.partial_index.items():
            block = self.block_pool.blocks[block_id]
            assert block.block_hash is not None, f"{block} is in the partial index but not cached"
            assert len(tokens) == self.block_size, f"{block} is indexed with {len(tokens)} tokens"
            parent = None if not _parent else BlockHash(_parent)
            assert hash_block_tokens(parent, tokens, self._extra) == block.block_hash, (
                f"{block} is indexed under tokens or a parent that do not give its hash"
            )

    def _check_window_invariants(self) -> None:
        """The window group: aligned tables, nothing kept before a table's window, ref counts add up."""
        pool = self.window_pool
        pool.check_invariants()
        refs = [0] * self.num_window_blocks
        refs[0] = 1  # the null block
        for seq_id, state in self._seqs.items():
            assert len(state.win) == len(state.blocks), f"{seq_id}: window table not aligned"
            # The next write starts at num_tokens; a table may keep one block more than the step needs.
            lo = self._window_start(state.num_tokens)
            needed = _cdiv(state.num_tokens, self.block_size)
            for i, block in enumerate(state.win):
                if block is None:
                    assert i < lo or i >= needed, f"{seq_id}: window block {i} missing"
                    continue
                assert block.block_id != 0, f"{seq_id}: the null block is in a table"
                refs[block.block_id] += 1
                if block.block_hash is not None and i < len(state.hashes):
                    assert block.block_hash == state.hashes[i], f"{seq_id}: window block {i} misfiled"
        for block in pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"window {block}: ref count {block.ref_cnt} but {refs[block.block_id]} tables hold it"
            )


class _BothGroups:
    """Device block events of a two-group cache: a hash is stored once both groups cache it and removed
    when either drops it (a prefix hit needs both)."""

    def __init__(self, events) -> None:
        self._events = events
        self._held: dict[BlockHash, int] = {}  # bit 0: the full group holds it, bit 1: the window group

    def group(self, index: int) -> _GroupEvents:
        return _GroupEvents(self, 1 << index)

    def stored(self, bit: int, block_hash: BlockHash) -> None:
        held = self._held.get(block_hash, 0) | bit
        self._held[block_hash] = held
        if held == 3:
            self._events.stored("device", block_hash)

    def removed(self, bit: int, block_hash: BlockHash) -> None:
        held = self._held.get(block_hash, 0)
        if held == 3:
            self._events.removed("device", block_hash)
        held &= ~bit
        if held:
            self._held[block_hash] = held
        else:
            self._held.pop(block_hash, None)

    def cleared(self, bit: int) -> None:
        for block_hash in [h for h, held in self._held.items() if held & bit]:
            self.removed(bit, block_hash)


class _GroupEvents:
    """One group's view of `_BothGroups`, with the block pool's event interface."""

    def __init__(self, both: _BothGroups, bit: int) -> None:
        self._both = both
        self._bit = bit

    def stored(self, tier: str, block_hash: BlockHash) -> None:
        self._both.stored(self._bit, block_hash)

    def removed(self, tier: str, block_hash: BlockHash) -> None:
        self._both.removed(self._bit, block_hash)

    def cleared(self, tier: str) -> None:
        self._both.cleared(self._bit)
