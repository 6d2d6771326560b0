"""SIGTERM drain: /health answers 503 "draining" while in-flight requests finish, then uvicorn shuts down.

Without it uvicorn closes the listening socket at once, so a router (or a readiness probe) cannot tell a
replica that is finishing its work from one that died. With it, a router stops sending new requests as soon
as its health check sees "draining", the requests already running end normally, and the server exits (0)
when no request task is left or ``grace_s`` has passed, whichever comes first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

log = logging.getLogger("pagoda.engine.server")
POLL_S = 0.1


async def drain_then_exit(server: Any, app: Any, grace_s: float) -> None:
    """Mark ``app`` draining, wait until ``server`` has no request task twice in a row, then exit it."""
    app.state.draining = True
    log.info("SIGTERM: draining (health answers 503) for at most %.0f s", grace_s)
    deadline = time.monotonic() + max(0.0, grace_s)
    idle = 0
    while time.monotonic() < deadline and not server.should_exit:
        idle = idle + 1 if not server.server_state.tasks else 0
        if idle >= 2:
            break
        await asyncio.sleep(POLL_S)
    server.should_exit = True
