"""The draft model's own KV cache bookkeeping: per sequence, a block table over a small pool of its own and
the tokens whose KV it holds. Nothing here touches the target's cache or its prefix cache.

The draft keeps no prefix cache and is never told about steps: before each proposal it compares the tokens
it holds with the sequence's tokens and keeps the longest common prefix. That one rule covers rejected
proposals (their KV is dropped), a target whose prefix-cache hit skipped tokens the draft never saw (it
catches up), and preemption (a sequence's tokens do not change while it waits, so its draft KV stays valid
unless the pool needed the blocks, and then it is recomputed). Sequences that did not propose recently are
evicted first when the pool runs short.
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

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

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
        assert len(used) == len(set(used)), "a draft block is in two tables"
        assert sorted(used + list(self._free)) == list(range(self.num_blocks)), "a draft block leaked"
