"""The block-event log of one engine core, wired into its block pool, plus the tier reconciliation.

The device tier is published by the block pool as it changes (during the step); the host and disk tiers
are read (each under its own lock) and diffed against the log when a reader asks, at most every
``TIER_SYNC_S``. It lives beside the core, in the core's process; a server reaches it through its engine
client (engine/server/kv_routes.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pagoda.engine.kv_cache.events import KVEventLog

TIER_SYNC_S = 0.2


class KVEventPublisher:
    def __init__(self, scheduler: Any) -> None:
        self.log = KVEventLog()
        self._sync_lock = threading.Lock()
        self._synced_at = 0.0
        scheduler.kv.set_event_log(self.log)
        self.offload = scheduler.offload
        self.sync_tiers(force=True)  # a warm restart's disk tier is published from the start

    def sync_tiers(self, force: bool = False) -> None:
        with self._sync_lock:
            if not force and time.monotonic() - self._synced_at < TIER_SYNC_S:
                return
            self._synced_at = time.monotonic()
            if self.offload is None:
                return
            host, disk = self.offload.host, self.offload.disk
            if host is not None:
                self.log.sync_tier("host", [h for h, _ in host.items()])
            if disk is not None:
                self.log.sync_tier("disk", disk.hashes())

    def events_since(self, since: int, epoch: str | None) -> dict[str, Any]:
        self.sync_tiers()
        return self.log.since(since, epoch)

    def snapshot(self) -> dict[str, Any]:
        self.sync_tiers(force=True)
        return self.log.snapshot()
