"""The draft model's own KV cache bookkeeping: per sequence, a block table over a small pool of its own and
the tokens whose KV it holds. Nothing here touches the target's cache or its prefix cache.

The draft keeps no prefix cache and is never told about steps: before each proposal it compares the tokens
it holds with the sequence's tokens and keeps the longest common prefix. That one rule covers rejected
proposals (their KV is dropped), a target whose prefix-cache hit skipped tokens the draft never saw (it
catches up), and preemption (a sequence's tokens do not change while it waits, so its draft KV stays valid
unless the pool needed the blocks, and then it is recomputed). Sequences that did not propose recently are
evicted first when the pool runs short.

A finished sequence's blocks are retired, not freed: a new sequence that starts with the same tokens (the
next turn of a conversation, a repeated prompt, a shared system prompt after the first request ended)
adopts the longest matching retired prefix instead of recomputing it, as the target's prefix cache lets the
target skip it. Retired blocks are the first the pool takes back when it runs short.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence


class DraftCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"draft cache needs blocks, got {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        # seq id -> its block table, least recently used first
        self._tables: OrderedDict[str, list[int]] = OrderedDict()
        self._tokens: dict[str, list[int]] = {}  # the tokens whose KV the blocks hold, in order
        # how many of those were the sequence's real tokens when written (the rest are proposals)
        self._real: dict[str, int] = {}
        # finished sequences' real tokens and blocks, oldest first (adopted by a new sequence, or freed)
        self._retired: OrderedDict[int, tuple[list[int], list[int]]] = OrderedDict()
        self._next_retired = 0
        self.adopted_tokens = 0  # tokens new sequences did not recompute (tests, logs)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_live(self) -> int:
        """Sequences holding blocks (retired ones not counted)."""
        return len(self._tables)

    def retire(self, seq_id: str) -> None:
        """``seq_id`` finished: keep its real tokens' blocks for a later sequence with the same start."""
        if seq_id not in self._tables:
            return
        self.truncate(seq_id, self._real[seq_id])
        table, tokens = self._tables.pop(seq_id), self._tokens.pop(seq_id)
        del self._real[seq_id]
        if tokens:
            self._retired[self._next_retired] = (tokens, table)
            self._next_retired += 1
        else:
            self._free.extend(table)

    def adopt(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """A sequence the draft holds nothing of takes the retired blocks whose tokens match the longest
        prefix of ``token_ids``; returns the tokens it now holds (0: none matched)."""
        if seq_id in self._tables or not self._retired:
            return 0
        best, best_len = None, 0
        for key, (tokens, _) in self._retired.items():
            n, end = 0, min(len(tokens), len(token_ids))
            while n < end and tokens[n] == token_ids[n]:
                n += 1
            if n > best_len:
                best, best_len = key, n
        if best is None:
            return 0
        tokens, table = self._retired.pop(best)
        keep = -(-best_len // self.block_size)
        self._free.extend(table[keep:])
        self._tables[seq_id] = table[:keep]
        self._tokens[seq_id] = tokens[:best_len]
        self._real[seq_id] = best_len
        self.adopted_tokens += best_len
        return best_len

    def sync(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Keep the longest prefix of the held tokens that ``token_ids`` (the sequence's tokens, which only
        grow) starts with; return its length, the tokens the draft need not compute again."""
        held = self._tokens.get(seq_id)
        if held is None:
            return 0
        valid = self._real[seq_id]
        end = min(len(held), len(token_ids))
        while valid < end and held[valid] == token_ids[valid]:
            valid += 1
        self.truncate(seq_id, valid)
        self._real[seq_id] = valid
        return valid

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Forget the KV past ``num_tokens`` tokens and give back the blocks it no longer needs."""
        table = self._tables.get(seq_id)
        if table is None:
            return
        del self._tokens[seq_id][num_tokens:]
        self._real[seq_id] = min(self._real[seq_id], num_tokens)
        keep = -(-num_tokens // self.block_size)
        self._free.extend(table[keep:])
        del table[keep:]

    def reserve(self, seq_id: str, num_tokens: int, protect: Iterable[str] = ()) -> bool:
        """Blocks for ``num_tokens`` tokens of ``seq_id``, evicting the least recently used other sequences
        (not those in ``protect``) when the pool is short; False, holding nothing new, when that is not
        enough."""
        table = self._tables.setdefault(seq_id, [])
        self._tokens.setdefault(seq_id, [])
        self._real.setdefault(seq_id, 0)
        self._tables.move_to_end(seq_id)
        need = -(-num_tokens // self.block_size) - len(table)
        while need > len(self._free) and self._retired:
            self._free.extend(self._retired.popitem(last=False)[1][1])
        if need > len(self._free):
            keep = set(protect) | {seq_id}
            for victim in [s for s in self._tables if s not in keep]:
                self.free(victim)
                if need <= len(self._free):
                    break
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            table.append(self._free.popleft())
        return True

    def table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def num_tokens(self, seq_id: str) -> int:
        return len(self._tokens.get(seq_id, ()))

    def append(self, seq_id: str, tokens: Sequence[int], real: bool) -> None:
        """The forward just wrote ``tokens``' KV after the held ones; ``real``: they are the sequence's own
        tokens (not proposals), so the next sync need not compare them."""
        held = self._tokens[seq_id]
        if len(held) + len(tokens) > len(self._tables[seq_id]) * self.block_size:
            raise ValueError(f"draft cache: {seq_id} writes past its reserved blocks")
        held.extend(tokens)
        if real:
            self._real[seq_id] = len(held)

    def free(self, seq_id: str) -> None:
        """Give back every block of ``seq_id`` (finished, or evicted)."""
        table = self._tables.pop(seq_id, None)
        if table is not None:
            self._free.extend(table)
            del self._tokens[seq_id], self._real[seq_id]

    def check(self) -> None:
        """Every block is free or in exactly one table (tests)."""
        used = [b for t in self._tables.values() for b in t]
        used += [b for _, t in self._retired.values() for b in t]
        assert len(used) == len(set(used)), "a draft block is in two tables"
        assert sorted(used + list(self._free)) == list(range(self.num_blocks)), "a draft block leaked"
