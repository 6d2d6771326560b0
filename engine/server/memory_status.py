"""GET /pagoda/memory: the memory profile the engine started with (weights, activation peak, KV allocated).

The operator plans from estimates; the engine measures. Exposing the measurement lets a supervisor compare
the two and re-plan from facts (the same profile goes to the pod's termination message when start-up runs
out of memory, see pagoda.engine.exit_codes). The profile is taken once by the engine core, before
serving starts, and reaches the server in its `EngineInfo`; the route never calls the engine.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

ROUTE = "/pagoda/memory"


def install_memory_status(app: FastAPI, profile: dict[str, Any]) -> None:
    """Serve `profile` at GET /pagoda/memory, open like /metrics (the middleware's OPEN_PATHS): the operator
    reads it through the API server's pod proxy, which cannot add the engine's key."""

    @app.get(ROUTE)
    async def memory_status() -> dict[str, Any]:
        return profile
