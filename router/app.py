"""The router's HTTP side (aiohttp): OpenAI routes proxied to the chosen replica, streams passed through.

Per request: read the body, compute its block chain (chain.py), let the policy pick a replica among the
routable ones (policies.py), forward. A replica that refuses the connection (or drops it before answering)
is marked unhealthy and the request goes to another one, as long as nothing was sent to the client yet; a
replica's own answer (4xx, 5xx) is passed through as is. A client that goes away closes the upstream
connection, which aborts the request on the replica.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from pagoda.router.backends import Backend, BackendPool
from pagoda.router.chain import ChainHasher, chain_of, load_local_tokenizer
from pagoda.router.config import RouterConfig
from pagoda.router.metrics import RouterMetrics
from pagoda.router.policies import Decision, Router

log = logging.getLogger("pagoda.router")
# Not forwarded: hop-by-hop headers, and the client's credentials (the replicas get the router's own key).
_HOP = {
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "authorization",
    "x-api-key",
}
_ROUTED = ("/v1/completions", "/v1/chat/completions")


def _error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "service_unavailable_error", "param": None, "code": code}}
    return web.json_response(body, status=status)


class RouterApp:
    def __init__(self, config: RouterConfig, tokenizer: Any = None) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.pool = BackendPool(config, on_change=self.metrics.refresh)
        self.router = Router(config.policy, config.load_slack)
        self.hasher = ChainHasher(tokenizer)
        if tokenizer is not None:  # compile the chat template now, not on the first request
            self.hasher.token_ids(
                "/v1/chat/completions", {"messages": [{"role": "user", "content": "warm up"}]}
            )
        self.needs_chain = config.policy in ("prefix", "tierAware")
        self.overheads: list[float] = []  # seconds, for benchmarks (GET /router/state)
        self.overheads_cpu: list[float] = []  # the same spans in the router thread's CPU time

    # -- app ---------------------------------------------------------------------------------------------
    def build(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prom)
        app.router.add_get("/router/state", self.state)
        for path in _ROUTED:
            app.router.add_post(path, self.proxy)
        app.router.add_route("*", "/{tail:.*}", self.passthrough)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        await self.pool.start()

    async def _stop(self, _: web.Application) -> None:
        await self.pool.close()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The engine's rule (engine/server/middleware.py): ``Authorization: Bearer <key>``, else
        ``X-API-Key: <key>``, compared in constant time; /health and /metrics stay open."""
        key = self.config.api_key
        if key and request.path not in ("/health", "/metrics"):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            given = token.strip() if scheme.lower() == "bearer" else ""
            given = given or request.headers.get("X-API-Key", "").strip()
            if not hmac.compare_digest(given.encode(), key.encode()):
                body = {
                    "error": {
                        "message": "Missing or invalid API key.",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "invalid_api_key",
                    }
                }
                return web.json_response(body, status=401)
        return await handler(request)

    # -- own routes ---------------------------------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        if self.pool.routable():
            return web.Response(status=200)
        return _error(503, "no healthy replica", "no_backend")

    async def prom(self, _: web.Request) -> web.Response:
        self.metrics.refresh(self.pool)
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def state(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "policy": self.config.policy,
                "backends": [b.to_dict() for b in self.pool.backends.values()],
                "overhead_seconds": self.overheads[-10000:],
                "overhead_cpu_seconds": self.overheads_cpu[-10000:],
            }
        )

    # -- routing --------------------------------------------------------------------------------------------
    async def _token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        ids = self.hasher.token_ids(path, body)
        if ids is not None or self.hasher.tokenizer is not None:
            return ids
        return await self._remote_token_ids(path, body)

    async def _remote_token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """No local tokenizer: a replica's /tokenize gives the same ids (one more round trip)."""
        backends = self.pool.routable()
        if not backends or self.pool.session is None:
            return None
        if path.endswith("/chat/completions"):
            req = {
                "messages": body.get("messages"),
                "add_generation_prompt": body.get("add_generation_prompt", True),
            }
        elif isinstance(body.get("prompt"), str):
            req = {"prompt": body["prompt"]}
        else:
            return None
        b = min(backends, key=lambda x: x.load)
        try:
            async with self.pool.session.post(b.url + "/tokenize", json=req) as r:
                if r.status == 200:
                    return (await r.json())["tokens"]
        except (aiohttp.ClientError, OSError, KeyError, ValueError):
            pass
        return None

    def _choose(self, backends: list[Backend], ids: list[int] | None) -> tuple[Backend, Decision, list[str]]:
        cands = [b.candidate() for b in backends]
        chain: list[str] = []
        info = next((b.info for b in backends if b.info), None)
        if ids is not None and info:  # the replicas of one deployment share block size and extra keys
            chain = chain_of(ids, int(info["block_size"]), tuple(info.get("extra_keys") or ()))
        decision = self.router.choose(cands, chain, len(ids) if ids is not None else 0)
        chosen = next(b for b in backends if b.url == decision.name)
        return chosen, decision, chain

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                body = {}
        except ValueError:
            body = {}
        t0, c0 = time.perf_counter(), time.thread_time()
        ids = await self._token_ids(request.path, body) if self.needs_chain else None
        overhead = time.perf_counter() - t0
        tried: set[str] = set()
        for attempt in range(self.config.max_retries + 1):
            t1 = time.perf_counter()
            backends = self.pool.routable(tried)
            if not backends:
                break
            b, decision, chain = self._choose(backends, ids)
            if attempt == 0:
                overhead += time.perf_counter() - t1
                self.metrics.overhead.observe(overhead)
                self.overheads.append(overhead)
                self.overheads_cpu.append(time.thread_time() - c0)  # without waiting for a CPU
                if len(self.overheads) > 20000:
                    del self.overheads[:10000], self.overheads_cpu[:10000]
            self.metrics.decisions.labels(self.config.policy, decision.reason).inc()
            try:
                resp = await self._forward(request, raw, b, decision, chain, body)
            except _Refused as exc:
                if exc.down:
                    b.mark_failed(str(exc))
                tried.add(b.url)
                self.metrics.retries.labels("connect" if exc.down else "disconnect").inc()
                continue
            self.metrics.requests.labels(str(resp.status)).inc()
            return resp
        self.metrics.requests.labels("503").inc()
        return _error(503, "no healthy replica could take the request", "no_backend")

    async def _forward(
        self,
        request: web.Request,
        raw: bytes,
        b: Backend,
        decision: Decision,
        chain: list[str],
        body: dict[str, Any],
    ) -> web.StreamResponse:
        assert self.pool.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        b.inflight += 1
        self.metrics.routed.labels(b.url).inc()
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout, sock_connect=5)
        try:
            try:
                upstream = await self.pool.session.post(
                    b.url + request.path, data=raw, headers=headers, timeout=timeout
                )
            except aiohttp.ClientConnectorError as exc:  # nothing listens: the replica is down
                raise _Refused(f"{type(exc).__name__}: {exc}", down=True) from exc
            except aiohttp.ServerDisconnectedError as exc:  # e.g. a stale pooled connection: try elsewhere
                raise _Refused(f"{type(exc).__name__}: {exc}", down=False) from exc
            if chain:
                b.index.predict(chain)
            self.metrics.predicted_cached.labels(b.url).inc(decision.predicted_cached_tokens)
            async with upstream:
                ctype = upstream.headers.get("Content-Type", "application/json")
                if "text/event-stream" not in ctype:
                    data = await upstream.read()
                    self._observe_usage(b, data)
                    return web.Response(body=data, status=upstream.status, headers={"Content-Type": ctype})
                out = web.StreamResponse(
                    status=upstream.status, headers={"Content-Type": ctype, "Cache-Control": "no-cache"}
                )
                await out.prepare(request)
                async for chunk in upstream.content.iter_any():
                    if request.transport is None or request.transport.is_closing():
                        break  # the client left: leaving the block closes the upstream, the replica aborts
                    if b'"usage"' in chunk:
                        self._observe_stream_usage(b, chunk)
                    try:
                        await out.write(chunk)
                    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                        break
                else:
                    await out.write_eof()
                return out
        finally:
            b.inflight -= 1

    def _observe_usage(self, b: Backend, data: bytes) -> None:
        try:
            usage = json.loads(data).get("usage") or {}
        except (ValueError, AttributeError):
            return
        self._count_usage(b, usage)

    def _observe_stream_usage(self, b: Backend, chunk: bytes) -> None:
        for line in chunk.split(b"\n"):
            if line.startswith(b"data: {") and b'"usage"' in line:
                try:
                    usage = json.loads(line[6:]).get("usage")
                except ValueError:
                    continue
                if usage:
                    self._count_usage(b, usage)

    def _count_usage(self, b: Backend, usage: dict[str, Any]) -> None:
        details = usage.get("prompt_tokens_details") or {}
        self.metrics.observed_cached.labels(b.url).inc(int(details.get("cached_tokens") or 0))
        self.metrics.prompt_tokens.labels(b.url).inc(int(usage.get("prompt_tokens") or 0))

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """Anything else (/v1/models, /tokenize, ...) goes to the least loaded replica, as is."""
        backends = self.pool.routable()
        assert self.pool.session is not None
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        for b in sorted(backends, key=lambda x: x.load)[: self.config.max_retries + 1]:
            try:
                async with self.pool.session.request(
                    request.method, b.url + request.path_qs, data=raw or None, headers=headers
                ) as r:
                    data = await r.read()
                    ctype = r.headers.get("Content-Type", "application/json")
                    return web.Response(body=data, status=r.status, headers={"Content-Type": ctype})
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
                b.mark_failed(str(exc))
        return _error(503, "no healthy replica", "no_backend")


class _Refused(Exception):
    """The replica could not be reached before anything was sent to the client."""

    def __init__(self, message: str, down: bool) -> None:
        super().__init__(message)
        self.down = down


def run(config: RouterConfig) -> None:
    tokenizer = load_local_tokenizer(config.tokenizer)
    log.info(
        "router on %s:%d, policy %s, tokenizer %s",
        config.host,
        config.port,
        config.policy,
        "local" if tokenizer is not None else "via the replicas' /tokenize",
    )
    app = RouterApp(config, tokenizer).build()
    web.run_app(
        app, host=config.host, port=config.port, handler_cancellation=True, print=None, access_log=None
    )
