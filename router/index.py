"""One replica's cached blocks per tier, as learned from its KV events (engine/kv_cache/events.py).

``apply`` takes one ``/v1/kv_events`` answer and returns False when the reader must re-sync (the replica
said so, its epoch changed, or a batch number is missing); ``load_snapshot`` replaces everything. Blocks the
router just sent a request for are remembered as *predicted* on the device for a short time, so requests
that arrive before the replica's events do (the same tenant's next conversation) still find them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

TIERS = ("device", "host", "disk")
PREDICTED_TTL_S = 30.0


class BlockIndex:
    def __init__(self) -> None:
        self.tiers: dict[str, set[str]] = {t: set() for t in TIERS}
        self.predicted: dict[str, float] = {}  # hash hex -> expiry (monotonic)
        self.seq = 0
        self.epoch: str | None = None
        self.synced = False  # a snapshot was loaded: seq/epoch are meaningful
        self.resyncs = 0

    # -- following the replica ---------------------------------------------------------------------------
    def load_snapshot(self, snap: dict[str, Any]) -> None:
        tiers = snap.get("tiers", {})
        self.tiers = {t: set(tiers.get(t, ())) for t in TIERS}
        self.seq = int(snap["seq"])
        self.epoch = snap.get("epoch")
        self.synced = True
        self.resyncs += 1

    def apply(self, answer: dict[str, Any]) -> bool:
        """Apply the batches of one poll in order; False = re-sync needed (nothing more is applied)."""
        if not self.synced or answer.get("resync") or answer.get("epoch") != self.epoch:
            return False
        for batch in answer.get("batches", ()):
            if int(batch["seq"]) != self.seq + 1:
                return False  # a gap (or a replay): state would be wrong from here on
            for kind, tier, block_hash in batch["events"]:
                members = self.tiers.get(tier)
                if members is None:
                    continue
                if kind == "stored":
                    members.add(block_hash)
                elif kind == "removed":
                    members.discard(block_hash)
                    if tier == "device":
                        self.predicted.pop(block_hash, None)
                elif kind == "cleared":
                    members.clear()
                    if tier == "device":
                        self.predicted.clear()
            self.seq = int(batch["seq"])
        return True

    def reset(self) -> None:
        """The replica is gone (or restarted): forget it until the next snapshot."""
        self.__init__()

    # -- predictions --------------------------------------------------------------------------------------
    def predict(self, chain: Sequence[str], now: float | None = None) -> None:
        expiry = (time.monotonic() if now is None else now) + PREDICTED_TTL_S
        for h in chain:
            self.predicted[h] = expiry
        if len(self.predicted) > 65536:
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        self.predicted = {h: t for h, t in self.predicted.items() if t > now}

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
