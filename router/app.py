"""The router's HTTP side (aiohttp): OpenAI routes proxied to the chosen replica, streams passed through.

Per request: read the body (up to the engine's own limit), compute its block chain (chain.py), let the
policy pick a replica among the routable ones (policies.py), forward. A replica that refused the request
(refused the connection: marked unhealthy at once; answered 503: full or draining) is skipped and the
request goes to another one, up to ``--max-retries``; when none takes it the client gets 503 with
``Retry-After``. A replica that took the request and then dropped the connection before the client had
anything may have died of it: the request goes to one other replica at most, and when that one fails the
same way the client gets 502 (a request that ended two replicas is not tried on a third). Other answers
(4xx, 5xx) are passed through as they are. Streams are passed on in whole events; a replica that fails
after the first one ends the client's stream with an OpenAI-style ``error`` event. Waits on a replica are
bounded per read (``--read-timeout``), never as a whole; one silent that long before the client had
anything gets it a 504 (not retried). A client that goes away closes the upstream connection, which aborts
the request on the replica.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from typing import Any

import aiohttp
from aiohttp import web
from pagoda.router.backends import Backend, BackendPool, reported_number
from pagoda.router.chain import ChainHasher, load_local_tokenizer
from pagoda.router.config import RouterConfig
from pagoda.router.hold import Hold
from pagoda.router.metrics import RouterMetrics
from pagoda.router.picking import Picker
from pagoda.router.policies import Decision, Router
from pagoda.router.prefill import PREFILLER_HEADER, PrefillPool
from pagoda.router.prefill import enabled as prefill_enabled

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
_OPEN = ("/health", "/livez", "/metrics")  # answered without the API key (probes, Prometheus)
DEFAULT_RETRY_AFTER_S = 1  # the engine's own (ServerSettings.retry_after_seconds)
MAX_RETRY_AFTER_S = 3600
# Replicas a request may end: one that dropped a request it was working on is followed by one more at most.
MAX_FAILED_REPLICAS = 2
_STARTED = "pagoda_stream_status"  # request key: the status of a stream the client already has


def _error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "service_unavailable_error", "param": None, "code": code}}
    return web.json_response(body, status=status)


class RouterApp:
    def __init__(self, config: RouterConfig, tokenizer: Any = None) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.hold = Hold(
            config.hold_seconds,
            self.metrics.registry,
            config.hold_max_requests,
            config.hold_max_bytes,
            # no replica and no hold: a client may look again once a health round could have found one
            outage_retry_after=max(1, math.ceil(config.health_interval)),
        )
        self.pool = BackendPool(config, on_change=self._pool_changed)
        self.router = Router(config.policy, config.load_slack)
        self.hasher = ChainHasher(tokenizer)
        if tokenizer is not None:  # compile the chat template now, not on the first request
            self.hasher.token_ids(
                "/v1/chat/completions", {"messages": [{"role": "user", "content": "warm up"}]}
            )
        self.needs_chain = config.policy in ("prefix", "tierAware")
        self.picker = Picker(self.pool, self.router, self.hasher, self.needs_chain)
        # --prefill-backend(-dns): prefill/decode disaggregation (router/prefill.py); None: off
        self.prefill = PrefillPool(config, self.hasher, self.needs_chain) if prefill_enabled(config) else None
        self.ext_proc: Any = None  # the gRPC server of --ext-proc-port, while it runs
        self.overheads: list[float] = []  # seconds, for benchmarks (GET /router/state)
        self.overheads_cpu: list[float] = []  # the same spans in the router thread's CPU time

    # -- app ---------------------------------------------------------------------------------------------
    def build(self) -> web.Application:
        app = web.Application(
            middlewares=[self._too_large, self._auth], client_max_size=self.config.max_request_body_bytes
        )
        app.router.add_get("/health", self.health)
        app.router.add_get("/livez", self.live)
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
        if self.prefill is not None:
            await self.prefill.start()
        if self.config.ext_proc_port is not None:  # grpc only when asked for (router/ext_proc.py)
            from pagoda.router.ext_proc import ExternalProcessor, serve

            processor = ExternalProcessor(
                self.picker, self.hold, self.metrics, self.config.policy, self.config.max_request_body_bytes
            )
            self.ext_proc, port = await serve(processor, self.config.host, self.config.ext_proc_port)
            log.info("ext_proc endpoint picker on %s:%d", self.config.host, port)

    async def _stop(self, _: web.Application) -> None:
        if self.ext_proc is not None:
            await self.ext_proc.stop(grace=5)
        if self.prefill is not None:
            await self.prefill.close()
        await self.pool.close()

    @web.middleware
    async def _too_large(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """aiohttp's own 413 is plain text: answer with the engine's OpenAI-style body instead."""
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            limit = self.config.max_request_body_bytes
            body = {
                "error": {
                    "message": f"Request body is larger than the limit of {limit} bytes.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
            if request.path in _ROUTED:
                self.metrics.requests.labels("413").inc()
            return web.json_response(body, status=413)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The engine's rule (engine/server/middleware.py): ``Authorization: Bearer <key>``, else
        ``X-API-Key: <key>``, compared in constant time; /health, /livez and /metrics stay open."""
        key = self.config.api_key
        if key and request.path not in _OPEN:
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

    def _pool_changed(self, pool: BackendPool) -> None:
        self.metrics.refresh(pool)
        self.hold.notify()

    # -- own routes ---------------------------------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        """200 with a routable replica; also without one while requests are held for one (scale to zero:
        the router must stay in the Service to take the requests that wake the deployment)."""
        if self.pool.routable():
            return web.Response(status=200)
        if self.hold.seconds > 0:
            return web.json_response({"status": "holding", "held": self.hold.waiting})
        return _error(503, "no healthy replica", "no_backend")

    async def live(self, _: web.Request) -> web.Response:
        """200 while the router serves, whatever its replicas do: the router pod's probes in Kubernetes (an
        engine outage must neither restart the router nor take it out of the Service: it answers 503 with
        Retry-After meanwhile)."""
        return web.json_response({"status": "ok", "routable": len(self.pool.routable())})

    async def prom(self, _: web.Request) -> web.Response:
        self.metrics.refresh(self.pool)
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def state(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "policy": self.config.policy,
                "backends": [b.to_dict() for b in self.pool.backends.values()],
                "prefill_backends": self.prefill.to_dicts() if self.prefill is not None else [],
                "overhead_seconds": self.overheads[-10000:],
                "overhead_cpu_seconds": self.overheads_cpu[-10000:],
            }
        )

    # -- routing --------------------------------------------------------------------------------------------
    async def proxy(self, request: web.Request) -> web.StreamResponse:
        """Route one completion. Every client request is counted once in ``router_requests_total``, by the
        status the client got (499: it went away before any answer started)."""
        try:
            resp = await self._route(request)
        except asyncio.CancelledError:  # the client left: the status it got, if a stream had started
            self.metrics.requests.labels(str(request.get(_STARTED, 499))).inc()
            raise
        self.metrics.requests.labels(str(resp.status)).inc()
        return resp

    async def _route(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                body = {}
        except ValueError:
            body = {}
        _, refusal = await self.hold.until_routable(self.pool.routable, len(raw))
        if refusal is not None:
            return refusal
        t0, c0 = time.perf_counter(), time.thread_time()
        ids = await self.picker.token_ids(request.path, body)
        overhead = time.perf_counter() - t0
        tried: set[str] = set()
        retry_after: list[int] = []  # what the replicas that answered 503 asked for
        refused: _Refused | None = None  # why the previous attempt failed
        failed = 0  # replicas that dropped the request while working on it
        for attempt in range(self.config.max_retries + 1):
            t1 = time.perf_counter()
            backends = self.pool.routable(tried)
            if not backends:
                break
            b, decision, chain = self.picker.choose(backends, ids, body.get("model"))
            if refused is None:
                overhead += time.perf_counter() - t1
                self._record_overhead(overhead, time.thread_time() - c0)
            else:
                self.metrics.retries.labels(refused.reason).inc()
            self.metrics.decisions.labels(self.config.policy, decision.reason).inc()
            try:
                return await self._forward(request, raw, b, decision, chain, ids, body.get("model"))
            except _Refused as exc:
                log.debug("replica %s did not take a request (attempt %d): %s", b.url, attempt + 1, exc)
                refused = exc
                if exc.down:
                    b.mark_failed(str(exc))
                if exc.retry_after is not None:
                    retry_after.append(exc.retry_after)
                tried.add(b.url)
                if exc.failed:
                    failed += 1
                    log.warning("replica %s dropped a request it was working on: %s", b.url, exc)
                    if failed >= MAX_FAILED_REPLICAS:
                        return _failed(failed)
        if refused is not None and refused.failed:  # the last one took it and failed, none other took it
            return _failed(failed)
        return _unavailable(max(retry_after, default=DEFAULT_RETRY_AFTER_S))

    def _record_overhead(self, wall: float, cpu: float) -> None:
        self.metrics.overhead.observe(wall)
        self.overheads.append(wall)
        self.overheads_cpu.append(cpu)  # without waiting for a CPU
        if len(self.overheads) > 20000:
            del self.overheads[:10000], self.overheads_cpu[:10000]

    async def _forward(
        self,
        request: web.Request,
        raw: bytes,
        b: Backend,
        decision: Decision,
        chain: list[str],
        ids: list[int] | None = None,
        model: object = None,
    ) -> web.StreamResponse:
        """One attempt at replica ``b``. Raises _Refused while the client has had nothing yet (the caller
        tries another replica); after that, a failing replica ends the stream with an error event."""
        assert self.pool.session is not None
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _HOP and k.lower() != PREFILLER_HEADER
        }
        if self.prefill is not None:
            picked = self.prefill.choose(ids, model)
            if picked is not None:
                headers[PREFILLER_HEADER] = picked[1]
                self.metrics.prefill_routed.labels(picked[0]).inc()
        b.inflight += 1
        self.metrics.routed.labels(b.url).inc()
        try:
            try:
                upstream = await self.pool.session.post(
                    b.url + request.path, data=raw, headers=headers, timeout=self._timeout()
                )
            except aiohttp.ClientConnectorError as exc:  # nothing listens: the replica is down
                raise _Refused(exc, "connect", down=True) from exc
            except aiohttp.SocketTimeoutError:  # accepted, then silent: it may still be working on it
                return _timed_out()
            except aiohttp.ClientConnectionError as exc:  # connected, then dropped: it may have died of it
                raise _Refused(exc, "disconnect", failed=True) from exc
            async with upstream:
                if upstream.status == 503:  # full or draining: another replica may take it
                    raise _Refused(
                        f"{b.url} answered 503", "unavailable", retry_after=_retry_after(upstream.headers)
                    )
                if chain:
                    b.index.predict(chain)
                self.metrics.predicted_cached.labels(b.url).inc(decision.predicted_cached_tokens)
                ctype = upstream.headers.get("Content-Type", "application/json")
                if "text/event-stream" in ctype:
                    return await self._relay(request, upstream, b)
                try:
                    data = await upstream.read()
                except TimeoutError:  # silent, not gone (aiohttp's timeouts are ClientErrors too)
                    return _timed_out()
                except aiohttp.ClientError as exc:  # the client has nothing yet; the replica had begun
                    raise _Refused(exc, "disconnect", failed=True) from exc
                self._observe_usage(b, data)
                return web.Response(body=data, status=upstream.status, headers=_answer_headers(upstream))
        finally:
            b.inflight -= 1

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, b: Backend
    ) -> web.StreamResponse:
        """Pass a stream through event by event. Until the first whole event the client has nothing, so a
        replica that drops the stream before it failed the request (one other replica may get it) and one that
        stays silent for ``read_timeout`` gets the client a 504, as a silent non-streamed answer does; one
        that fails later ends the client's stream with an error event and ``data: [DONE]``."""
        events = SSEBuffer()
        out: web.StreamResponse | None = None
        try:
            async for chunk in upstream.content.iter_any():
                whole = events.feed(chunk)
                if not whole:
                    continue
                if out is None:
                    out = await self._start_stream(request, upstream)
                if request.transport is None or request.transport.is_closing():
                    return out  # the client left: leaving the block closes the upstream, the replica aborts
                if b'"usage"' in whole:
                    self._observe_stream_usage(b, whole)
                try:
                    await out.write(whole)
                except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                    return out
        except (aiohttp.ClientError, TimeoutError) as exc:
            reason = "timeout" if isinstance(exc, TimeoutError) else "disconnect"
            if out is None and reason == "timeout":  # it may still be working on it: not retried
                return _timed_out()
            if out is None:
                raise _Refused(exc, "disconnect", failed=True) from exc
            log.warning("replica %s failed mid-stream (%s): %s", b.url, reason, exc)
            self.metrics.stream_errors.labels(b.url, reason).inc()
            message = f"the replica serving this stream failed ({reason}); the answer is incomplete"
            return await _finish(out, _sse_error(message, f"upstream_{reason}"))
        if out is None:  # an empty (or unterminated) stream: pass on what there is
            out = await self._start_stream(request, upstream)
        return await _finish(out, events.rest)

    @staticmethod
    async def _start_stream(request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        out = web.StreamResponse(status=upstream.status, headers=_answer_headers(upstream))
        out.headers["Cache-Control"] = "no-cache"
        request[_STARTED] = upstream.status
        await out.prepare(request)
        return out

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

    def _count_usage(self, b: Backend, usage: object) -> None:
        if not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        for counter, value, what in (
            (self.metrics.observed_cached, cached, "cached_tokens"),
            (self.metrics.prompt_tokens, usage.get("prompt_tokens"), "prompt_tokens"),
        ):
            if value is not None and (n := reported_number(value, f"usage.{what}", b.url)) is not None:
                counter.labels(b.url).inc(n)

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """Anything else (/v1/models, /tokenize, ...) goes to the least loaded replica, as is."""
        raw = await request.read()
        backends, refusal = await self.hold.until_routable(self.pool.routable, len(raw))
        if refusal is not None:
            return refusal
        assert self.pool.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        failed = 0  # replicas that dropped the request after taking it (see _route)
        last_failed = False
        for b in sorted(backends, key=lambda x: x.load)[: self.config.max_retries + 1]:
            last_failed = False
            try:
                async with self.pool.session.request(
                    request.method,
                    b.url + request.path_qs,
                    data=raw or None,
                    headers=headers,
                    timeout=self._timeout(),
                ) as r:
                    data = await r.read()
                    return web.Response(body=data, status=r.status, headers=_answer_headers(r))
            except aiohttp.ClientConnectorError as exc:  # refused: the next replica
                b.mark_failed(str(exc))
            except aiohttp.SocketTimeoutError:
                return _timed_out()
            except aiohttp.ClientError as exc:  # took it, dropped it before a whole answer: once more at most
                failed, last_failed = failed + 1, True
                log.warning("replica %s dropped a request it was working on: %s", b.url, exc)
                if failed >= MAX_FAILED_REPLICAS:
                    return _failed(failed)
        return _failed(failed) if last_failed else _unavailable(DEFAULT_RETRY_AFTER_S)

    def _timeout(self) -> aiohttp.ClientTimeout:
        """No limit on a whole answer; ``read_timeout`` on each wait for the replica's next bytes."""
        return aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self.config.read_timeout)


class _Refused(Exception):
    """The replica did not answer the request and the client has had nothing yet: another one may.
    ``reason`` labels router_retries_total (connect, disconnect, unavailable); ``down``: refused the
    connection (marked unhealthy at once); ``retry_after``: seconds its 503 asked for; ``failed``: it had
    taken the request (connected, sent) and dropped it, so it may have died of the request itself: only
    one other replica is tried (MAX_FAILED_REPLICAS)."""

    def __init__(
        self,
        cause: object,
        reason: str,
        down: bool = False,
        retry_after: int | None = None,
        failed: bool = False,
    ) -> None:
        super().__init__(cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}")
        self.reason = reason
        self.down = down
        self.retry_after = retry_after
        self.failed = failed


class SSEBuffer:
    """Splits a byte stream into whole server-sent events (each ends with a blank line), so that what the
    client gets never ends inside an event and an error event can always follow."""

    def __init__(self) -> None:
        self.rest = b""

    def feed(self, chunk: bytes) -> bytes:
        """The whole events completed by ``chunk`` (possibly b"")."""
        data = self.rest + chunk
        end = max(data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n"))
        if end < 0:
            self.rest = data
            return b""
        end += 4 if data.startswith(b"\r\n\r\n", end) else 2
        self.rest = data[end:]
        return data[:end]


async def _finish(out: web.StreamResponse, last: bytes) -> web.StreamResponse:
    """Write the stream's last bytes and its end (a client that left meanwhile is no error)."""
    try:
        if last:
            await out.write(last)
        await out.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        pass
    return out


def _retry_after(headers: Any) -> int | None:
    """A replica's Retry-After in whole seconds (delta-seconds form only), capped; None when absent or bad."""
    value = headers.get("Retry-After", "").strip()
    return min(int(value), MAX_RETRY_AFTER_S) if value.isdigit() else None


def _answer_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    """What the client gets of a replica's headers: the content type, and Retry-After if it sent one."""
    headers = {"Content-Type": upstream.headers.get("Content-Type", "application/json")}
    if "Retry-After" in upstream.headers:
        headers["Retry-After"] = upstream.headers["Retry-After"]
    return headers


def _unavailable(retry_after: int) -> web.Response:
    resp = _error(503, "no replica could take the request now; retry later", "no_backend")
    resp.headers["Retry-After"] = str(retry_after)
    return resp


def _failed(replicas: int) -> web.Response:
    """502: the replica (or two) that took the request dropped it before any answer; a request that ended
    two replicas is not sent to a third (it may be what makes them fail)."""
    if replicas >= MAX_FAILED_REPLICAS:
        message = (
            f"{replicas} replicas failed while working on this request (each dropped the connection before "
            "answering); it is not sent to another one, as the request itself may be what makes them fail"
        )
    else:
        message = (
            "the replica failed while working on this request (it dropped the connection before answering) "
            "and no other replica could take it"
        )
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "upstream_failed"}}
    return web.json_response(body, status=502)


def _timed_out() -> web.Response:
    """A replica silent for ``read_timeout`` before the client had anything (not retried: a replica that is
    slow, not gone, may still be working on the request)."""
    return _error(504, "the replica did not answer in time", "upstream_timeout")


def _sse_error(message: str, code: str) -> bytes:
    """An OpenAI-style error as a server-sent ``error`` event, then the end of the stream."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


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
