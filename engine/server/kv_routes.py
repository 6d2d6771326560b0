"""What a KV-aware router reads from a replica: block events, a snapshot per tier, and the cost inputs.

- ``GET /v1/kv_events?since=SEQ&epoch=E``: event batches after SEQ (engine/kv_cache/events.py), or
  ``resync: true`` when the reader must start over from the snapshot;
- ``GET /v1/kv_snapshot``: every cached block hash per tier (device, host, disk) as of one sequence number;
- ``GET /v1/router_info``: how to compute a request's block-hash chain (block size, extra keys, hash version)
  and the replica's measured rates (prefill tokens/s, tokens/s loaded from host and disk).

The event log lives with the engine core (engine/kv_cache/publisher.py), which answers between two steps;
the routes reach it through the `EngineClient` and build router_info from the `EngineInfo` and the rates
measured here from every step's stats. Nothing here touches the scheduler.
"""

from __future__ import annotations

import threading
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse
from pagoda.engine.frontend.engine_client import EngineClient
from pagoda.engine.kv_cache.hashing import HASH_VERSION

_EMA = 0.2  # weight of the newest observation in the rate averages


class RateTracker:
    """A StatLogger that keeps moving averages of the replica's prefill and tier-load rates.

    Prefill: prompt tokens of a step (64 or more) over the step's duration as the core measured it (a
    mixed step also decodes, so the rate errs low); from a producer that does not measure its steps, the
    TTFT of the one request whose first token the step made. Tier loads: tokens loaded over the tier's
    measured load seconds.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prefill_tokens_per_s: float | None = None
        self.load_tokens_per_s: dict[str, float] = {}

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        it = iteration_stats
        with self._lock:
            if it.num_prompt_tokens >= 64:
                span = it.step_seconds
                if span <= 0 and len(it.time_to_first_tokens) == 1:
                    span = it.time_to_first_tokens[0]
                if span > 0:
                    self.prefill_tokens_per_s = _avg(self.prefill_tokens_per_s, it.num_prompt_tokens / span)
            for tier, per in (it.offload or {}).items():
                seconds = sum(per.get("load_seconds", ()))
                tokens = it.cached_tokens_by_source.get(tier, 0)
                if seconds > 0 and tokens > 0:
                    self.load_tokens_per_s[tier] = _avg(self.load_tokens_per_s.get(tier), tokens / seconds)

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "load_tokens_per_s": dict(self.load_tokens_per_s),
            }


def _avg(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


def router_info(engine: EngineClient, rates: RateTracker) -> dict[str, Any]:
    info = engine.info
    return {
        "block_size": info.block_size,
        "extra_keys": list(info.kv_extra_keys),
        "hash_version": HASH_VERSION.decode(),
        "enable_prefix_caching": info.enable_prefix_caching,
        "num_blocks": info.num_blocks,
        "tiers": list(info.tiers),
        "max_model_len": info.max_model_len,
        "epoch": info.kv_events_epoch,
        # each served LoRA adapter's chain root: a router hashes its requests' prompts from it
        "lora_adapters": {name: a.cache_root for name, a in engine.lora_adapters.items()},
        **rates.to_dict(),
    }


def install_kv_routes(app: FastAPI, engine: EngineClient) -> RateTracker | None:
    """Add the router-facing routes and the rate tracker; None (and no routes) for an engine that
    publishes no block events (offline engines, test fakes)."""
    if engine.info.kv_events_epoch is None:
        return None
    rates = RateTracker()
    engine.add_stat_logger(rates)
    app.state.kv_rates = rates

    @app.get("/v1/kv_events", include_in_schema=False)
    async def kv_events(since: int = Query(0, ge=0), epoch: str | None = None) -> JSONResponse:
        return JSONResponse(await engine.kv_events(since, epoch))

    @app.get("/v1/kv_snapshot", include_in_schema=False)
    async def kv_snapshot() -> JSONResponse:
        return JSONResponse(await engine.kv_snapshot())

    @app.get("/v1/router_info", include_in_schema=False)
    async def get_router_info() -> JSONResponse:
        return JSONResponse(router_info(engine, rates))

    return rates
