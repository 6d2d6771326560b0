"""Pure-ASGI guards that run before routing: API key (outermost) and body size.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect detection pass through untouched.
The API key is decided from the headers alone, before a single body byte is read: a client without the
key cannot make the server buffer anything.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from pagoda.engine.server.errors import error_body
from starlette.exceptions import HTTPException as StarletteHTTPException

# Probes and operational read-outs need no key: kubelet probes, Prometheus scrapes and the operator's check of
# a new image's measured memory profile (through the API server's pod proxy, which cannot add the key).
OPEN_PATHS = (
    "/health",
    "/metrics",
    "/pagoda/memory",
    "/version",
    "/openapi.json",
    "/docs",
    "/redoc",
    "/ping",
)


async def _send_error(
    send: Any, status: int, message: str, code: str, headers: dict[str, str] | None = None
) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches (constant-time); health and metrics stay open."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
            elif name == b"x-api-key" and not given:
                given = value.strip()
        if not hmac.compare_digest(given, self._key):
            return await _send_error(
                send,
                401,
                "Missing or invalid API key: send it as 'Authorization: Bearer <key>'.",
                "invalid_api_key",
                {"WWW-Authenticate": "Bearer"},
            )
        return await self.app(scope, receive, send)


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` once a body passes the limit; FastAPI re-raises HTTPExceptions as they are,
    so the error handlers answer 413 (and the middleware does, if nothing else did)."""

    code = "request_too_large"

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"Request body is larger than the limit of {max_bytes} bytes.")


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`: at once by Content-Length, else by counting the bytes as they
    arrive (chunked bodies too). It buffers nothing and reads nothing itself: the body is only read when
    the app asks for it, which is after the API key was checked."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    return await self._too_large(send)
        seen = 0
        started = False

        async def counting_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._too_large(send)

    async def _too_large(self, send: Any) -> None:
        await _send_error(
            send,
            413,
            f"Request body is larger than the limit of {self.max_bytes} bytes.",
            BodyTooLarge.code,
        )
