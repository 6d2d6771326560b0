"""Scale to zero: requests that arrive while no replica is routable wait here, up to `--hold-seconds`,
instead of failing at once. The deployment's autoscaler (KEDA) sees them as `pagoda:router_held_requests`
and starts an engine; the first health round that finds it routable releases every held request to it.
A request still waiting at the bound gets 503 with Retry-After.

The hold is off by default (`--hold-seconds 0`): the operator turns it on only for a deployment that can
scale to zero (autoscaling.minReplicas 0). Off, a request that finds no routable replica (an outage) gets
503 with Retry-After at once. On, it is bounded: at most `--hold-max-requests` requests and
`--hold-max-bytes` of their bodies wait at a time; one past either cap gets 503 with Retry-After at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web
from pagoda.router.config import DEFAULT_HOLD_MAX_BYTES, DEFAULT_HOLD_MAX_REQUESTS
from prometheus_client import CollectorRegistry, Counter, Gauge

RETRY_AFTER_SECONDS = 30  # a held request that timed out or found the hold full: an engine is starting


def _unavailable(message: str, code: str, retry_after: int) -> web.Response:
    body = {"error": {"message": message, "type": "service_unavailable_error", "param": None, "code": code}}
    return web.json_response(body, status=503, headers={"Retry-After": str(retry_after)})


class Hold:
    def __init__(
        self,
        seconds: float,
        registry: CollectorRegistry,
        max_requests: int = DEFAULT_HOLD_MAX_REQUESTS,
        max_bytes: int = DEFAULT_HOLD_MAX_BYTES,
        outage_retry_after: int = 1,
    ) -> None:
        self.seconds = seconds
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.outage_retry_after = outage_retry_after  # Retry-After with the hold off and no replica
        self.waiting = 0  # requests held now (the gauge's value)
        self.waiting_bytes = 0  # ... and the bytes of their bodies
        self._changed = asyncio.Event()
        self.held = Gauge(
            "pagoda:router_held_requests",
            "Requests waiting for a routable replica (the deployment has none ready: scaled to zero, starting).",
            registry=registry,
        )
        self.held_bytes = Gauge(
            "pagoda:router_held_bytes",
            "Bytes of the bodies of the requests waiting for a routable replica.",
            registry=registry,
        )
        self.released = Counter(
            "pagoda:router_held",
            "Requests that found no routable replica with the hold on, by how it ended: served (one became "
            "routable in time), timeout (none did within --hold-seconds), full (refused at once: the hold "
            "was at --hold-max-requests or --hold-max-bytes).",
            ("outcome",),
            registry=registry,
        )

    def notify(self) -> None:
        """The pool changed (a health round ended): held requests look again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def until_routable(
        self, routable: Callable[[], list[Any]], size: int = 0
    ) -> tuple[list[Any], web.Response | None]:
        """(the routable replicas, None), waiting for one for up to `seconds` when there is none now; or
        ([], the 503 to answer) when none came in time, the hold is full or off. `size`: the request's body
        bytes (what holding it costs)."""
        found = routable()
        if found:
            return found, None
        if self.seconds <= 0:
            return [], _unavailable(
                "no replica is ready to take the request; retry later", "no_backend", self.outage_retry_after
            )
        if self.waiting + 1 > self.max_requests or self.waiting_bytes + size > self.max_bytes:
            self.released.labels("full").inc()
            return [], _unavailable(
                f"no replica is ready yet (the deployment may be scaled to zero and starting one) and the "
                f"router already holds {self.waiting} requests ({self.waiting_bytes} bytes) for one, its limit "
                f"(--hold-max-requests {self.max_requests}, --hold-max-bytes {self.max_bytes}); retry later",
                "hold_full",
                RETRY_AFTER_SECONDS,
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        self.held.inc()
        self.held_bytes.inc(size)
        self.waiting += 1
        self.waiting_bytes += size
        try:
            while not found:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    pass
                found = routable()
        finally:
            self.held.dec()
            self.held_bytes.dec(size)
            self.waiting -= 1
            self.waiting_bytes -= size
        self.released.labels("served" if found else "timeout").inc()
        if found:
            return found, None
        return [], _unavailable(
            f"no replica became ready within {self.seconds:g} s (the deployment may be scaled to zero and still "
            "starting one); retry later",
            "no_backend",
            RETRY_AFTER_SECONDS,
        )
