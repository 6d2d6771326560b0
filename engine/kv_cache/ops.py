"""Writes to the device KV cache that are not a forward: copy-on-write copies, saves down a tier, loads.

The scheduler records them while it plans a step, in the order the bookkeeping happened (a block evicted
for reuse is saved before whatever is then copied or loaded into it); the model runner executes the list in
that order before the step's forward, also when the step schedules no tokens. One ordered list is what
keeps a stale copy from landing on top of a block that was since freed and reloaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from pagoda.engine.kv_cache.hashing import BlockHash


@dataclass(frozen=True)
class CopyBlock:
    """Copy-on-write: block ``dst`` gets the KV of block ``src`` (K and V of every layer of its group: the
    sliding layers' pool when ``window``, else the other layers')."""

    src: int
    dst: int
    window: bool = False


@dataclass(frozen=True)
class SaveBlock:
    """Read block ``block_id`` (about to be reused, or swapped out) to the host, to store under its hash."""

    block_id: int
    block_hash: BlockHash


@dataclass(frozen=True, eq=False)
class LoadBlock:
    """Write host KV ``data`` ([layers, 2, block_size, kv_heads, head_dim]) into block ``block_id``."""

    block_id: int
    data: torch.Tensor


@dataclass(frozen=True)
class RotateBlock:
    """Attention sinks: block ``dst``'s keys become block ``src``'s keys (the sinks as written) rotated by
    ``delta`` positions; its values are left as they are. Always from the written keys, so a sink key is
    rotated once however many evictions moved the window on."""

    src: int
    dst: int
    delta: int


KVOp = CopyBlock | SaveBlock | LoadBlock | RotateBlock


@dataclass
class KVOpLog:
    """The ops recorded since the last ``take``, in order."""

    ops: list[KVOp] = field(default_factory=list)

    def append(self, op: KVOp) -> None:
        self.ops.append(op)

    def drop_copies_into(self, block_ids: set[int], window: bool = False) -> None:
        """A freed block's pending copy-on-write (or sink rotation) is moot: nothing will read its result.
        ``window``: the ids are the window group's blocks (only its copies are dropped)."""
        if block_ids and self.ops:
            self.ops = [
                op
                for op in self.ops
                if not (
                    (isinstance(op, CopyBlock) and op.window == window and op.dst in block_ids)
                    or (not window and isinstance(op, RotateBlock) and op.dst in block_ids)
                )
            ]

    def take(self) -> list[KVOp]:
        ops, self.ops = self.ops, []
        return ops

    def __len__(self) -> int:
        return len(self.ops)
