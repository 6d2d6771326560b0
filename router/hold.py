"""Scale to zero: requests that arrive while no replica is routable wait here, up to `--hold-seconds`,
instead of failing at once. The deployment's autoscaler (KEDA) sees them as `pagoda:router_held_requests`
and starts an engine; the first health round that finds it routable releases every held request to it.
A request still waiting at the bound gets 503 with Retry-After."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

RETRY_AFTER_SECONDS = 30


class Hold:
    def __init__(self, seconds: float, registry: CollectorRegistry) -> None:
        self.seconds = seconds
        self.waiting = 0  # requests held now (the gauge's value)
        self._changed = asyncio.Event()
        self.held = Gauge(
            "pagoda:router_held_requests",
            "Requests waiting for a routable replica (the deployment has none ready: scaled to zero, starting).",
            registry=registry,
        )
        self.released = Counter(
            "pagoda:router_held",
            "Requests that waited for a routable replica, by how the wait ended (served, timeout).",
            ("outcome",),
            registry=registry,
        )

    def notify(self) -> None:
        """The pool changed (a health round ended): held requests look again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def until_routable(self, routable: Callable[[], list[Any]]) -> list[Any]:
        """The routable replicas, waiting for one for up to `seconds`; [] when none came in time."""
        found = routable()
        if found or self.seconds <= 0:
            return found
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        self.held.inc()
        self.waiting += 1
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
            self.waiting -= 1
        self.released.labels("served" if found else "timeout").inc()
        return found

    def too_long(self) -> web.Response:
        body = {
            "error": {
                "message": f"no replica became ready within {self.seconds:g} s (the deployment may be scaled to "
                "zero and still starting one); retry later",
                "type": "service_unavailable_error",
                "param": None,
                "code": "no_backend",
            }
        }
        return web.json_response(body, status=503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
