"""What a KV-aware router reads from a replica: block events, a snapshot per tier, and the cost inputs.

- ``GET /v1/kv_events?since=SEQ&epoch=E``: event batches after SEQ (engine/kv_cache/events.py), or
  ``resync: true`` when the reader must start over from the snapshot;
- ``GET /v1/kv_snapshot``: every cached block hash per tier (device, host, disk) as of one sequence number;
- ``GET /v1/router_info``: how to compute a request's block-hash chain (block size, extra keys, hash version)
  and the replica's measured rates (prefill tokens/s, tokens/s loaded from host and disk).

The device tier is published by the block pool as it changes (on the engine thread); the host and disk
tiers are read (each under its own lock) and diffed when a reader asks, at most every ``TIER_SYNC_S``.
Everything runs off the event loop; nothing here touches the scheduler.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse
from pagoda.engine.kv_cache.events import KVEventLog
from pagoda.engine.kv_cache.hashing import HASH_VERSION

TIER_SYNC_S = 0.2
_EMA = 0.2  # weight of the newest observation in the rate averages


class RateTracker:
    """A StatLogger that keeps moving averages of the replica's prefill and tier-load rates.

    Prefill: prompt tokens of a step (64 or more) over an upper bound of the step's duration (the gap since
    the previous step when the engine ran back to back, or the TTFT of the one request whose first token
    the step made), so the rate errs low; tier loads: tokens loaded over the tier's measured load seconds.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: float | None = None
        self._last_busy = False
        self.prefill_tokens_per_s: float | None = None
        self.load_tokens_per_s: dict[str, float] = {}

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        now = time.perf_counter()
        it = iteration_stats
        busy = bool(it.num_prompt_tokens or it.num_generation_tokens)
        with self._lock:
            gap = None if self._last is None else now - self._last
            if it.num_prompt_tokens >= 64:
                # Both bound the step's duration from above: the gap since the previous step when the
                # engine ran back to back, and the TTFT of a request whose first token this step made.
                spans = [gap] if gap is not None and self._last_busy and gap < 2.0 else []
                if len(it.time_to_first_tokens) == 1:
                    spans.append(it.time_to_first_tokens[0])
                span = min(spans, default=0.0)
                if span > 0:
                    self.prefill_tokens_per_s = _avg(self.prefill_tokens_per_s, it.num_prompt_tokens / span)
            for tier, per in (it.offload or {}).items():
                seconds = sum(per.get("load_seconds", ()))
                tokens = it.cached_tokens_by_source.get(tier, 0)
                if seconds > 0 and tokens > 0:
                    self.load_tokens_per_s[tier] = _avg(self.load_tokens_per_s.get(tier), tokens / seconds)
            self._last, self._last_busy = now, busy

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "load_tokens_per_s": dict(self.load_tokens_per_s),
            }


def _avg(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


class KVPublisher:
    """The event log of one engine core, wired into its block pool, plus the tier reconciliation."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.log = KVEventLog()
        self.rates = RateTracker()
        self._sync_lock = threading.Lock()
        self._synced_at = 0.0
        scheduler = core.scheduler
        scheduler.kv.block_pool.events = self.log
        self.offload = scheduler.offload
        core.add_stat_logger(self.rates)
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

    def router_info(self) -> dict[str, Any]:
        core, kv = self.core, self.core.scheduler.kv
        offload = self.offload
        return {
            "block_size": kv.block_size,
            "extra_keys": list(kv.extra_keys),
            "hash_version": HASH_VERSION.decode(),
            "enable_prefix_caching": kv.enable_prefix_caching,
            "num_blocks": kv.num_blocks,
            "tiers": ["device"] + ([t.name for t in offload.tiers] if offload is not None else []),
            "max_model_len": int(getattr(core, "max_model_len", 0) or 0),
            "epoch": self.log.epoch,
            **self.rates.to_dict(),
        }


def install_kv_routes(app: FastAPI, engine: Any) -> KVPublisher | None:
    """Add the router-facing routes; None (and no routes) for a core without a block pool (test fakes)."""
    core = getattr(engine, "engine", None)
    if getattr(getattr(core, "scheduler", None), "kv", None) is None or not hasattr(core, "add_stat_logger"):
        return None
    pub = KVPublisher(core)
    app.state.kv_publisher = pub

    @app.get("/v1/kv_events", include_in_schema=False)
    async def kv_events(since: int = Query(0, ge=0), epoch: str | None = None) -> JSONResponse:
        await asyncio.to_thread(pub.sync_tiers)
        return JSONResponse(pub.log.since(since, epoch))

    @app.get("/v1/kv_snapshot", include_in_schema=False)
    async def kv_snapshot() -> JSONResponse:
        await asyncio.to_thread(pub.sync_tiers, True)
        return JSONResponse(await asyncio.to_thread(pub.log.snapshot))

    @app.get("/v1/router_info", include_in_schema=False)
    async def router_info() -> JSONResponse:
        return JSONResponse(pub.router_info())

    return pub
