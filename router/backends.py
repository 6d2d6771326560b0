"""The replicas behind the router: discovery (static URLs, a headless Service's A records), health, load
(from each replica's /metrics) and the KV block index (following /v1/kv_events, re-syncing from
/v1/kv_snapshot), each refreshed by its own background loop.

Numbers a replica reports (its load, its measured rates, its block size) are checked as they arrive: a value
that is not a finite non-negative number is logged and ignored, so one broken replica can neither win every
routing decision (a negative rate is a negative cost) nor fail every request (a string in the arithmetic).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from pagoda.router.config import RouterConfig
from pagoda.router.index import BlockIndex
from pagoda.router.policies import Candidate

log = logging.getLogger("pagoda.router")
FAILURES_TO_EJECT = 2
_LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


MAX_BLOCK_SIZE = 1 << 16


def reported_number(value: object, what: str, url: str) -> float | None:
    """A number a replica reported, if it is a finite non-negative int or float; else None (logged)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    log.warning("replica %s reported %s = %r: not a finite non-negative number, ignored", url, what, value)
    return None


def checked_info(info: object, url: str) -> dict[str, Any] | None:
    """The replica's /v1/router_info with every field the router computes with checked: rates that fail
    are dropped (the defaults apply), a bad block size or extra keys make the whole answer unusable."""
    if not isinstance(info, dict):
        log.warning("replica %s: /v1/router_info is not an object, ignored", url)
        return None
    size = info.get("block_size")
    keys = info.get("extra_keys") or []
    if not (isinstance(size, int) and not isinstance(size, bool) and 0 < size <= MAX_BLOCK_SIZE):
        log.warning("replica %s reported block_size = %r, ignored", url, size)
        return None
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        log.warning("replica %s reported extra_keys = %r, ignored", url, keys)
        return None
    out = dict(info, extra_keys=keys)
    adapters = info.get("lora_adapters") or {}
    if not (
        isinstance(adapters, dict) and all(isinstance(k, str) and _is_root(v) for k, v in adapters.items())
    ):
        log.warning("replica %s reported lora_adapters = %r, ignored", url, adapters)
        adapters = {}
    out["lora_adapters"] = adapters
    prefill = info.get("prefill_tokens_per_s")
    out["prefill_tokens_per_s"] = (
        None if prefill is None else reported_number(prefill, "prefill_tokens_per_s", url)
    )
    loads = info.get("load_tokens_per_s") or {}
    if not isinstance(loads, dict):
        log.warning("replica %s reported load_tokens_per_s = %r, ignored", url, loads)
        loads = {}
    out["load_tokens_per_s"] = {
        tier: rate
        for tier, value in loads.items()
        if (rate := reported_number(value, f"load_tokens_per_s[{tier!r}]", url)) is not None
    }
    return out


def _is_root(value: object) -> bool:
    """A block-hash chain root as the engine publishes it: 64 hex digits."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def adapter_holders(backends: list[Backend], model: object) -> tuple[list[Backend], bytes | None]:
    """When ``model`` (a request's `model`) names a LoRA adapter that some replicas have loaded: those
    replicas and the adapter's chain root (content-addressed, so alike on every replica); else every replica
    and no root (the base model's chain)."""
    if not isinstance(model, str):
        return backends, None
    holders = [b for b in backends if model in ((b.info or {}).get("lora_adapters") or {})]
    if not holders:
        return backends, None
    return holders, bytes.fromhex(holders[0].info["lora_adapters"][model])


def parse_load(text: str, url: str = "") -> int:
    """running + waiting from a replica's Prometheus text (summed over label sets; values that are not
    finite and non-negative are logged and skipped)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(_LOAD_METRICS) and line.partition("{")[0].partition(" ")[0] in _LOAD_METRICS:
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            checked = reported_number(value, line.partition(" ")[0].partition("{")[0], url)
            total += checked or 0.0
    return int(total)


@dataclass
class Backend:
    url: str
    healthy: bool = False
    draining: bool = False
    scraped_load: int = 0  # running + waiting at the last /metrics scrape
    inflight: int = 0  # requests this router has open there now
    inflight_at_scrape: int = 0  # ... and when that scrape was answered (they are in scraped_load too)
    info: dict[str, Any] | None = None  # the replica's /v1/router_info, checked (checked_info)
    index: BlockIndex = field(default_factory=BlockIndex)
    last_error: str | None = None
    checked_at: float = 0.0
    failures: int = 0  # health checks failed in a row

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    @property
    def load(self) -> int:
        """Requests at the replica: those of other clients (scraped, minus this router's own at the time of
        the scrape) plus this router's open ones now. The scrape alone lags by up to a health interval, and
        adding the open ones to it would count each of them twice while it runs."""
        return max(0, self.scraped_load - self.inflight_at_scrape) + self.inflight

    def candidate(self) -> Candidate:
        info = self.info or {}
        return Candidate(
            name=self.url,
            load=self.load,
            index=self.index,
            block_size=int(info.get("block_size") or 16),
            prefill_tps=info.get("prefill_tokens_per_s"),
            load_tps=dict(info.get("load_tokens_per_s") or {}),
        )

    def mark_failed(self, why: str) -> None:
        if self.healthy:
            log.warning("replica %s unhealthy: %s", self.url, why)
        self.healthy = False
        self.last_error = why

    def check_failed(self, why: str, refused: bool = False) -> None:
        """A refused connection counts at once; a slow or failed answer only twice in a row (a busy
        replica may miss one health check without being taken out of rotation)."""
        self.failures += 1
        if refused or self.failures >= FAILURES_TO_EJECT:
            self.mark_failed(why)

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "draining": self.draining,
            "load": self.load,
            "inflight": self.inflight,
            "blocks": self.index.counts(),
            "blocks_forgotten": self.index.forgotten,
            "malformed_events": self.index.malformed,
            "synced": self.index.synced,
            "seq": self.index.seq,
            "resyncs": self.index.resyncs,
            "info": self.info,
            "last_error": self.last_error,
        }


class BackendPool:
    def __init__(self, config: RouterConfig, on_change: Any = None) -> None:
        self.config = config
        self.backends: dict[str, Backend] = {u: self._backend(u) for u in config.backends}
        self._dns: dict[str, set[str]] = {t: set() for t in config.backend_dns}
        self._tasks: list[asyncio.Task] = []
        self.session: aiohttp.ClientSession | None = None
        self.on_change = on_change  # called after every health round (metrics refresh)
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}

    def _backend(self, url: str) -> Backend:
        return Backend(url, index=BlockIndex(self.config.max_index_blocks))

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None), headers=self.headers
        )
        if self._dns:
            await self.resolve_dns()
        await self.check_all()
        self._tasks = [
            asyncio.create_task(self._every(self.config.health_interval, self.check_all)),
            asyncio.create_task(self._every(self.config.events_interval, self.follow_all)),
        ]
        if self._dns:
            self._tasks.append(asyncio.create_task(self._every(self.config.dns_interval, self.resolve_dns)))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def _every(self, seconds: float, fn: Any) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a loop must survive anything one round throws
                log.exception("router background round failed")

    def routable(self, exclude: set[str] = frozenset()) -> list[Backend]:
        return [b for b in self.backends.values() if b.routable and b.url not in exclude]

    # -- discovery -------------------------------------------------------------------------------------------
    async def resolve_dns(self) -> None:
        loop = asyncio.get_running_loop()
        for target in list(self._dns):
            host, _, port = target.rpartition(":")
            try:
                infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("cannot resolve %s: %s", target, exc)
                continue  # keep the last known replicas
            urls = set()
            for family, *_, addr in infos:
                ip = addr[0]
                urls.add(f"http://[{ip}]:{port}" if family == socket.AF_INET6 else f"http://{ip}:{port}")
            for url in urls - self._dns[target]:
                self.backends.setdefault(url, self._backend(url))
                log.info("replica %s found via %s", url, target)
            for url in self._dns[target] - urls:
                if url not in self.config.backends:
                    self.backends.pop(url, None)
                    log.info("replica %s left %s", url, target)
            self._dns[target] = urls

    # -- health and load --------------------------------------------------------------------------------------
    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in list(self.backends.values())))
        if self.on_change is not None:
            self.on_change(self)

    async def check(self, b: Backend) -> None:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=max(2.0, 2 * self.config.health_interval))
        try:
            async with self.session.get(b.url + "/health", timeout=timeout) as r:
                body = await r.text()
                if r.status == 200:
                    was = b.healthy
                    b.healthy, b.draining, b.last_error, b.failures = True, False, None, 0
                    if not was:
                        log.info("replica %s healthy", b.url)
                elif r.status == 503 and "draining" in body:
                    b.healthy, b.draining, b.failures = True, True, 0
                else:
                    b.check_failed(f"/health answered {r.status}")
            if b.healthy:
                async with self.session.get(b.url + "/metrics", timeout=timeout) as r:
                    if r.status == 200:
                        text = await r.text()
                        b.scraped_load, b.inflight_at_scrape = parse_load(text, b.url), b.inflight
                if b.info is None or time.monotonic() - b.checked_at > 10 * self.config.health_interval:
                    await self._fetch_info(b, timeout)
                    b.checked_at = time.monotonic()
        except aiohttp.ClientConnectorError as exc:
            b.check_failed(f"{type(exc).__name__}: {exc}", refused=True)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            b.check_failed(f"{type(exc).__name__}: {exc}")

    async def _fetch_info(self, b: Backend, timeout: aiohttp.ClientTimeout) -> None:
        assert self.session is not None
        async with self.session.get(b.url + "/v1/router_info", timeout=timeout) as r:
            if r.status == 200:
                info = checked_info(await r.json(), b.url)
                if b.info is not None and (info or {}).get("epoch") != b.info.get("epoch"):
                    b.index.reset()  # restarted: its blocks are what its new snapshot says
                b.info = info

    # -- KV events ------------------------------------------------------------------------------------------
    async def follow_all(self) -> None:
        await asyncio.gather(*(self.follow(b) for b in list(self.backends.values()) if b.healthy and b.info))

    async def follow(self, b: Backend) -> None:
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=5)
        malformed = b.index.malformed
        try:
            if b.index.synced:
                params = {"since": str(b.index.seq), "epoch": b.index.epoch or ""}
                async with self.session.get(b.url + "/v1/kv_events", params=params, timeout=timeout) as r:
                    if r.status != 200:
                        return
                    if b.index.apply(await r.json()):
                        return
            async with self.session.get(b.url + "/v1/kv_snapshot", timeout=timeout) as r:
                if r.status == 200:
                    b.index.load_snapshot(await r.json())
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("kv events from %s: %s", b.url, exc)
        if b.index.malformed > malformed:
            log.warning("replica %s: %d malformed KV events skipped", b.url, b.index.malformed - malformed)
