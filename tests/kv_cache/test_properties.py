"""Property-based tests: random lives of many sequences against a model of the KV memory itself.

Every slot of the simulated cache holds the prefix that produced it (the KV at position p depends on
tokens 0..p), so a wrong prefix hit, a missed copy-on-write, or a block reused while still referenced shows
up as a sequence reading back KV that is not its own.

Blocks also leave and re-enter the device through a simulated lower tier (an external writer): evicted
cached blocks are saved, later sequences load their prefix from it. Device writes other than the forward
(copies, saves, loads) are applied only when a step runs, in the order the manager recorded them, as the
model runner does; the read-back check looks at the memory as it will be once the pending writes ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pagoda.engine.kv_cache.hashing import hash_full_blocks
from pagoda.engine.kv_cache.manager import KVCacheManager
from pagoda.engine.kv_cache.ops import CopyBlock, LoadBlock, SaveBlock

TOKENS = st.integers(min_value=0, max_value=2)  # a tiny vocabulary: prefixes collide often


@dataclass
class Seq:
    tokens: list[int]
    computed: int
    family: int  # sequences forked from one another share a family
    forks: set[str] = field(default_factory=set)


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(min_value=2, max_value=24),
        block_size=st.sampled_from([1, 2, 4]),
        prefix_caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.evicted: list[int] = []
        self.m = KVCacheManager(
            num_blocks,
            block_size,
            enable_prefix_caching=prefix_caching,
            extra_keys=("test-model", "auto"),
            on_evict=lambda bid, bh: self.evicted.append(bid),
            should_save=lambda bh: True,
        )
        self.tier: dict[bytes, list[tuple[int, ...] | None]] = {}
        self.bs = block_size
        self.mem: list[list[tuple[int, ...] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.seqs: dict[str, Seq] = {}
        self.next_id = 0
        self.next_family = 0
        self.queries = 0
        self.hits = 0

    # -- helpers ------------------------------------------------------------------------------------------
    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def _start(self, seq_id: str, tokens: list[int], family: int) -> None:
        evicted_before = len(self.evicted)
        computed = self.m.get_computed_tokens(seq_id, tokens)
        assert len(self.evicted) == evicted_before, "a lookup must not evict"
        assert computed % self.bs == 0
        assert computed <= max(0, (len(tokens) - 1) // self.bs * self.bs)
        if self.m.enable_prefix_caching:
            self.queries += len(tokens)
            self.hits += computed
        else:
            assert computed == 0
        assert len(self.m.get_block_table(seq_id)) == computed // self.bs
        self.seqs[seq_id] = Seq(list(tokens), computed, family)

    def _simulate(self, ops, mem, tier) -> None:
        for op in ops:
            if isinstance(op, CopyBlock):
                mem[op.dst] = list(mem[op.src])
            elif isinstance(op, SaveBlock):
                tier[op.block_hash] = list(mem[op.block_id])
            elif isinstance(op, LoadBlock):
                mem[op.block_id] = list(op.data)

    def _apply_ops(self) -> None:
        """What the model runner does before a forward: the recorded writes, in order."""
        self._simulate(self.m.take_ops(), self.mem, self.tier)

    def _state(self):
        return (
            {s: self.m.get_block_table(s) for s in self.seqs},
            [b.ref_cnt for b in self.m.block_pool.blocks],
            dict(self.m.block_pool.cached),
            self.m.num_free_blocks,
            self.m.num_cached_blocks,
            list(self.evicted),
            self.m.num_pending_ops,
        )

    # -- rules --------------------------------------------------------------------------------------------
    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=20))
    def start(self, prompt: list[int]) -> None:
        self.next_family += 1
        self._start(self._new_id(), prompt, self.next_family)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(min_value=1, max_value=9), token=TOKENS)
    def step(self, data: st.DataObject, chunk: int, token: int) -> None:
        """One engine step for one sequence: a prefill chunk, or a decode of a freshly sampled token."""
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[seq_id]
        if seq.computed == len(seq.tokens):
            seq.tokens.append(token)
        target = min(len(seq.tokens), seq.computed + chunk)
        before = self._state()
        can = self.m.can_allocate(seq_id, target)
        assert self._state() == before
        ok = self.m.allocate_slots(seq_id, target)
        assert ok == can
        if not ok:
            assert self._state() == before, "a failed allocation changed something"
            return
        self._apply_ops()
        table = self.m.get_block_table(seq_id)
        assert len(table) == -(-target // self.bs)
        for pos in range(seq.computed, target):
            block = self.m.block_pool.blocks[table[pos // self.bs]]
            assert block.ref_cnt == 1, "writing into a shared block"
            assert block.block_hash is None, "writing into a cached block"
            self.mem[block.block_id][pos % self.bs] = tuple(seq.tokens[: pos + 1])
        seq.computed = target
        self.m.cache_blocks(seq_id, seq.tokens, seq.computed)

    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=20))
    def start_loading_from_tier(self, prompt: list[int]) -> None:
        """A new sequence extends its device prefix hit with blocks from the lower tier (the offload path)."""
        self.next_family += 1
        seq_id = self._new_id()
        self._start(seq_id, prompt, self.next_family)
        seq = self.seqs[seq_id]
        max_blocks = (len(prompt) - 1) // self.bs
        hashes = hash_full_blocks(prompt, self.bs, self.m.extra_key_bytes)[:max_blocks]
        first = seq.computed // self.bs
        todo_hashes, todo_data = [], []
        for block_hash in hashes[first:]:
            if block_hash not in self.tier or self.m.block_pool.get_cached_block(block_hash) is not None:
                break
            todo_hashes.append(block_hash)
            todo_data.append(list(self.tier[block_hash]))
        if not todo_hashes or not self.m.enable_prefix_caching:
            return
        loaded = self.m.load_blocks(seq_id, todo_hashes, todo_data)
        seq.computed += loaded * self.bs
        assert len(self.m.get_block_table(seq_id)) == seq.computed // self.bs

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        ready = sorted(s for s, q in self.seqs.items() if q.computed == len(q.tokens))
        if not ready:
            return
        parent_id = data.draw(st.sampled_from(ready))
        parent = self.seqs[parent_id]
        child_id = self._new_id()
        used = self.m.num_used_blocks
        self.m.fork(parent_id, child_id)
        assert self.m.num_used_blocks == used, "a fork must not take blocks"
        assert self.m.get_block_table(child_id) == self.m.get_block_table(parent_id)
        self.seqs[child_id] = Seq(list(parent.tokens), parent.computed, parent.family)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish_or_abort(self, data: st.DataObject) -> None:
        """Finished and aborted requests (mid-prefill or not) both release everything at once."""
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        table = self.m.get_block_table(seq_id)
        free_before = self.m.num_free_blocks
        self.m.free(seq_id)
        del self.seqs[seq_id]
        still_held = {b for s in self.seqs for b in self.m.get_block_table(s)}
        assert self.m.num_free_blocks == free_before + len(set(table) - still_held)
        assert not self.m.has_seq(seq_id)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def preempt_and_resume(self, data: st.DataObject) -> None:
        """Recompute preemption: free, then restart with everything generated so far as the prompt."""
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs.pop(seq_id)
        self.m.free(seq_id)
        self._start(seq_id, seq.tokens, seq.family)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), chunk=st.integers(min_value=1, max_value=9), token=TOKENS)
    def allocate_then_preempt(self, data: st.DataObject, chunk: int, token: int) -> None:
        """Slots handed out (maybe with a copy recorded), then the sequence is preempted in the same
        schedule: the forward never writes them and the stale copy still runs before the next forward."""
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs.pop(seq_id)
        if seq.computed == len(seq.tokens):
            seq.tokens.append(token)
        self.m.allocate_slots(seq_id, min(len(seq.tokens), seq.computed + chunk))
        self.m.free(seq_id)
        self._start(seq_id, seq.tokens, seq.family)

    @rule()
    def reset_prefix_cache(self) -> None:
        used = self.m.num_used_blocks
        assert self.m.reset_prefix_cache() == (used == 0)
        if used == 0:
            assert self.m.num_cached_blocks == 0 and self.m.block_pool.cached == {}

    # -- invariants ---------------------------------------------------------------------------------------
    @invariant()
    def structures_agree(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        pool = self.m.block_pool
        queued = {b.block_id for b in pool.free_queue} | {b.block_id for b in pool.evictable_queue}
        tables = {s: self.m.get_block_table(s) for s in self.seqs}
        referenced = {b for t in tables.values() for b in t}
        assert queued.isdisjoint(referenced), "a block is both free and referenced"
        assert queued | referenced == set(range(self.m.num_blocks)), "a block is neither free nor referenced"
        assert all(b.ref_cnt >= 0 for b in pool.blocks)
        evictable = {b.block_id for b in pool.evictable_queue}
        unreferenced_cached = {b.block_id for b in pool.cached.values() if b.ref_cnt == 0}
        assert evictable == unreferenced_cached, "the free queue and the cache index disagree"
        assert self.m.num_free_blocks == len(queued)
        assert self.m.num_used_blocks == len(referenced)
        assert self.m.usage == len(referenced) / self.m.num_blocks
        assert self.m.prefix_cache_queries == self.queries and self.m.prefix_cache_hits == self.hits

    @invariant()
    def blocks_shared_only_by_forks_or_cached_prefixes(self) -> None:
        if not hasattr(self, "m"):
            return
        owner: dict[int, str] = {}
        for seq_id in self.seqs:
            for block_id in self.m.get_block_table(seq_id):
                other = owner.setdefault(block_id, seq_id)
                if other == seq_id:
                    continue
                if self.seqs[other].family != self.seqs[seq_id].family:
                    block = self.m.block_pool.blocks[block_id]
                    assert self.m.enable_prefix_caching and block.block_hash is not None, (
                        f"{seq_id} and {other} share block {block_id} without a fork or a cached prefix"
                    )

    @invariant()
    def every_sequence_reads_back_its_own_kv(self) -> None:
        if not hasattr(self, "m"):
            return
        mem = [list(b) for b in self.mem]
        self._simulate(list(self.m._ops.ops), mem, dict(self.tier))
        for seq_id, seq in self.seqs.items():
            table = self.m.get_block_table(seq_id)
            for pos in range(seq.computed):
                got = mem[table[pos // self.bs]][pos % self.bs]
                assert got == tuple(seq.tokens[: pos + 1]), f"{seq_id} reads wrong KV at position {pos}"

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for seq_id in list(self.seqs):
            self.m.free(seq_id)
        self.m.check_invariants()
        assert self.m.num_used_blocks == 0
        assert self.m.num_free_blocks == self.m.num_blocks, "blocks leaked after every sequence ended"
        assert self.m.usage == 0.0
        if not self.m.enable_prefix_caching:
            assert self.m.num_cached_blocks == 0


KVCacheMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase
