"""KV block events: which chained block hashes a replica holds, on which tier, for routers to follow.

The engine thread publishes ``stored`` / ``removed`` (and ``cleared`` for a whole tier) as the block pool
caches and evicts blocks; the host and disk tiers are reconciled by a diff of their contents against what
the log last published (:meth:`KVEventLog.sync_tier`), so the tiers' own code needs no hooks. Events are
grouped into batches, each with a sequence number one above the previous one. A reader asks for the
batches after the last number it applied; when it fell behind the bound (the batch it needs was dropped),
comes from another process lifetime (``epoch`` differs), or sees a gap, it re-syncs from
:meth:`KVEventLog.snapshot`: every hash per tier as of one sequence number, then follows from there.

All public methods take one lock: the engine thread writes, server threads read. Nothing here touches the
scheduler, and importing it needs no torch.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

TIERS = ("device", "host", "disk")
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class KVEventBatch:
    """Events in publication order; ``seq`` is one above the previous batch's."""

    seq: int
    ts: float
    events: list[tuple[str, str, str]]  # (kind, tier, block hash hex; "" for cleared)

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "ts": self.ts, "events": [list(e) for e in self.events]}


@dataclass
class KVEventLog:
    """Bounded, batched log of block events plus the current membership per tier (for snapshots).

    ``max_batches`` bounds memory; ``max_batch_events`` seals a batch early while nobody reads.
    """

    max_batches: int = 1024
    max_batch_events: int = 512
    epoch: str = field(default_factory=lambda: secrets.token_hex(8))

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[str, str, str]] = []
        self._batches: deque[KVEventBatch] = deque(maxlen=self.max_batches)
        self._seq = 0
        self._members: dict[str, set[bytes]] = {t: set() for t in TIERS}

    # -- writer side (the engine thread) ---------------------------------------------------------------
    def stored(self, tier: str, block_hash: bytes) -> None:
        with self._lock:
            members = self._members[tier]
            if block_hash not in members:
                members.add(block_hash)
                self._append((STORED, tier, block_hash.hex()))

    def removed(self, tier: str, block_hash: bytes) -> None:
        with self._lock:
            members = self._members[tier]
            if block_hash in members:
                members.discard(block_hash)
                self._append((REMOVED, tier, block_hash.hex()))

    def cleared(self, tier: str) -> None:
        with self._lock:
            if self._members[tier]:
                self._members[tier] = set()
                self._append((CLEARED, tier, ""))

    def sync_tier(self, tier: str, hashes: Iterable[bytes]) -> int:
        """Make ``tier``'s membership equal ``hashes``, publishing the difference; returns events added."""
        now = set(hashes)
        with self._lock:
            old = self._members[tier]
            gone, new = old - now, now - old
            for h in gone:
                self._append((REMOVED, tier, h.hex()))
            for h in new:
                self._append((STORED, tier, h.hex()))
            self._members[tier] = now
            return len(gone) + len(new)

    def _append(self, event: tuple[str, str, str]) -> None:
        self._pending.append(event)
        if len(self._pending) >= self.max_batch_events:
            self._seal()

    def _seal(self) -> None:
        if self._pending:
            self._seq += 1
            self._batches.append(KVEventBatch(self._seq, time.time(), self._pending))
            self._pending = []

    # -- reader side -----------------------------------------------------------------------------------
    @property
    def seq(self) -> int:
        with self._lock:
            return self._seq

    def since(self, seq: int, epoch: str | None = None) -> dict[str, Any]:
        """Batches after ``seq``; ``resync: true`` (and no batches) when they cannot be given in full."""
        with self._lock:
            self._seal()
            oldest = self._batches[0].seq if self._batches else self._seq + 1
            lost = seq < oldest - 1 or seq > self._seq or (epoch is not None and epoch != self.epoch)
            out: dict[str, Any] = {
                "version": PROTOCOL_VERSION,
                "epoch": self.epoch,
                "seq": self._seq,
                "resync": lost,
                "batches": [],
            }
            if not lost:
                out["batches"] = [b.to_dict() for b in self._batches if b.seq > seq]
            return out

    def snapshot(self) -> dict[str, Any]:
        """Every hash per tier as of ``seq``: follow on with ``since(seq)``."""
        with self._lock:
            self._seal()
            return {
                "version": PROTOCOL_VERSION,
                "epoch": self.epoch,
                "seq": self._seq,
                "tiers": {t: sorted(h.hex() for h in m) for t, m in self._members.items()},
            }

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {t: len(m) for t, m in self._members.items()}


class NullEvents:
    """The block pool's default sink: publishes nothing (unit tests, offline engines)."""

    def stored(self, tier: str, block_hash: bytes) -> None:
        pass

    def removed(self, tier: str, block_hash: bytes) -> None:
        pass

    def cleared(self, tier: str) -> None:
        pass


NULL_EVENTS = NullEvents()
