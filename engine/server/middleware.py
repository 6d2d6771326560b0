"""Pure-ASGI guards that run before routing: API key and body size.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect detection pass through untouched.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from pagoda.engine.server.errors import error_body

OPEN_PATHS = ("/health", "/metrics", "/version", "/openapi.json", "/docs", "/redoc", "/ping")


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


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`, judged by Content-Length and by counting what actually arrives."""

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
        # Buffer the body (it is small: bounded by the limit), then replay it to the app.
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                return await self._too_large(send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Any) -> None:
        await _send_error(
            send,
            413,
            f"Request body is larger than the limit of {self.max_bytes} bytes.",
            "request_too_large",
        )
