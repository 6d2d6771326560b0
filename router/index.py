"""One replica's cached blocks per tier, as learned from its KV events (engine/kv_cache/events.py).

``apply`` takes one ``/v1/kv_events`` answer and returns False when the reader must re-sync (the replica
said so, its epoch changed, or a batch number is missing); ``load_snapshot`` replaces everything. Blocks the
router just sent a request for are remembered as *predicted* on the device for a short time, so requests
that arrive before the replica's events do (the same tenant's next conversation) still find them.

Memory is bounded: at most ``max_blocks`` hashes per replica, all tiers together (and as many predictions).
Past the bound a block of a higher tier takes the place of one of the lowest tier held (disk, then host),
and a block that finds nothing below it is not recorded: the router then sees a shorter hit than the
replica has, never one the replica lacks. Malformed events are skipped (and counted), never applied.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

log = logging.getLogger("pagoda.router")
TIERS = ("device", "host", "disk")  # best first
PREDICTED_TTL_S = 30.0
DEFAULT_MAX_BLOCKS = 262_144
_MAX_HASH_LEN = 128  # a hex SHA-256 is 64 characters


def _is_hash(h: object) -> bool:
    return isinstance(h, str) and 0 < len(h) <= _MAX_HASH_LEN


class BlockIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.tiers: dict[str, set[str]] = {t: set() for t in TIERS}
        self.predicted: dict[str, float] = {}  # hash hex -> expiry (monotonic)
        self.seq = 0
        self.epoch: str | None = None
        self.synced = False  # a snapshot was loaded: seq/epoch are meaningful
        self.resyncs = 0
        self.forgotten = 0  # blocks not recorded (or dropped) to stay within max_blocks
        self.malformed = 0  # events skipped

    # -- following the replica ---------------------------------------------------------------------------
    def load_snapshot(self, snap: dict[str, Any]) -> None:
        """Replace everything with a ``/v1/kv_snapshot`` answer (ValueError when it is not one)."""
        tiers = snap.get("tiers") if isinstance(snap, dict) else None
        if not isinstance(tiers, dict) or not all(isinstance(tiers.get(t, ()), list) for t in TIERS):
            raise ValueError("a KV snapshot needs tiers: {device|host|disk: [hash, ...]}")
        seq = int(snap["seq"])
        self.tiers = {t: set() for t in TIERS}
        for t in TIERS:
            self._add_all(t, tiers.get(t, ()))
        self.seq = seq
        self.epoch = snap.get("epoch")
        self.synced = True
        self.resyncs += 1

    @property
    def num_blocks(self) -> int:
        return sum(len(m) for m in self.tiers.values())

    def _add_all(self, tier: str, hashes: Iterable[object]) -> None:
        for h in hashes:
            if _is_hash(h):
                self._add(tier, h)
            else:
                self.malformed += 1

    def _add(self, tier: str, block_hash: str) -> None:
        members = self.tiers[tier]
        if block_hash in members:
            return
        if self.num_blocks >= self.max_blocks and not self._make_room(tier):
            self.forgotten += 1
            return
        members.add(block_hash)

    def _make_room(self, tier: str) -> bool:
        """Forget one block of the lowest tier below ``tier`` that holds any; False when none does."""
        for lower in reversed(TIERS[TIERS.index(tier) + 1 :]):
            if self.tiers[lower]:
                self.tiers[lower].pop()
                self.forgotten += 1
                return True
        return False

    def apply(self, answer: dict[str, Any]) -> bool:
        """Apply the batches of one poll in order; False = re-sync needed (nothing more is applied)."""
        if not self.synced or answer.get("resync") or answer.get("epoch") != self.epoch:
            return False
        for batch in answer.get("batches", ()):
            if int(batch["seq"]) != self.seq + 1:
                return False  # a gap (or a replay): state would be wrong from here on
            for event in batch["events"]:
                if not (isinstance(event, list | tuple) and len(event) == 3 and event[1] in TIERS):
                    self.malformed += 1
                    continue
                kind, tier, block_hash = event
                members = self.tiers[tier]
                if kind == "cleared":
                    members.clear()
                    if tier == "device":
                        self.predicted.clear()
                elif not _is_hash(block_hash):
                    self.malformed += 1
                elif kind == "stored":
                    self._add(tier, block_hash)
                elif kind == "removed":
                    members.discard(block_hash)
                    if tier == "device":
                        self.predicted.pop(block_hash, None)
                else:
                    self.malformed += 1
            self.seq = int(batch["seq"])
        return True

    def reset(self) -> None:
        """The replica is gone (or restarted): forget it until the next snapshot."""
        self.__init__(self.max_blocks)

    # -- predictions --------------------------------------------------------------------------------------
    def predict(self, chain: Sequence[str], now: float | None = None) -> None:
        expiry = (time.monotonic() if now is None else now) + PREDICTED_TTL_S
        for h in chain:
            self.predicted.pop(h, None)  # re-inserted: the dict stays ordered oldest first
            self.predicted[h] = expiry
        if len(self.predicted) > self.max_blocks:
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        """Drop expired predictions, then the oldest ones down to 3/4 of max_blocks (so a full dict is
        not rebuilt on every request)."""
        live = [(h, t) for h, t in self.predicted.items() if t > now]
        keep = self.max_blocks * 3 // 4 if len(live) > self.max_blocks else len(live)
        self.predicted = dict(live[len(live) - keep :])

    # -- queries ------------------------------------------------------------------------------------------
    def tier_of(self, block_hash: str, now: float) -> str | None:
        """The cheapest tier holding the block (a fresh prediction counts as the device), or None."""
        if block_hash in self.tiers["device"]:
            return "device"
        t = self.predicted.get(block_hash)
        if t is not None:
            if t > now:
                return "device"
            del self.predicted[block_hash]
        if block_hash in self.tiers["host"]:
            return "host"
        if block_hash in self.tiers["disk"]:
            return "disk"
        return None

    def prefix_tiers(self, chain: Sequence[str], device_only: bool = False) -> list[str]:
        """Tiers of the chain's leading blocks, up to the first one the replica does not hold (the engine
        extends a hit only contiguously)."""
        now = time.monotonic()
        out: list[str] = []
        for h in chain:
            tier = self.tier_of(h, now)
            if tier is None or (device_only and tier != "device"):
                break
            out.append(tier)
        return out

    def counts(self) -> dict[str, int]:
        return {t: len(m) for t, m in self.tiers.items()}
