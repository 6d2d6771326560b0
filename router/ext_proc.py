"""`pagoda router --ext-proc-port N`: the router as a Gateway API Inference Extension endpoint picker.

A gateway (Envoy and the gateways built on it) opens one Envoy ``ext_proc`` v3 stream per HTTP request and
asks which model-server pod gets it. This module only adapts that protocol: the decision is the proxy's own
(picking.Picker over the same pool, policy, block index and hold), so prefix, tier, LoRA and load rules are
the same whichever front end a request came through.

Per stream: the request headers, then the body (buffered into one message, or streamed in chunks: all are
read before picking, as the policies need the prompt); the answer sets the ``x-gateway-destination-endpoint``
header and the same ``ip:port`` under dynamic metadata ``envoy.lb``. A subset hint (filter metadata
``envoy.lb.subset_hint``, key ``x-gateway-destination-endpoint-subset``) restricts the choice to the listed
endpoints. No endpoint: an immediate 503 with Retry-After; the scale-to-zero hold full: 429 (the protocol's
"drop this request" answer); a body past ``--max-request-body-bytes``: 413, as the proxy answers. The pick counts as in flight at its replica until the stream ends (Envoy keeps
it open for the request's life when the response phases are sent; else until the request phase ends).

Body modes, read from the stream's ``protocol_config``: BUFFERED answers the headers at once and the body
with the header mutation (Envoy applies a body response's header mutation to the held request);
FULL_DUPLEX_STREAMED (what the extension's gateways configure) holds the headers answer until the body has
ended, then answers the headers with the mutation and the body with the whole body re-sent; other modes
answer each body chunk and send the headers answer before the last body answer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from pagoda.router.backends import Backend
from pagoda.router.hold import Hold
from pagoda.router.metrics import RouterMetrics
from pagoda.router.picking import Picker

log = logging.getLogger("pagoda.router.ext_proc")
DESTINATION = "x-gateway-destination-endpoint"  # header, and key under the envoy.lb metadata namespace
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# The services the extension's health checks ask for (besides "", the whole server).
HEALTH_SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
_MODES = processing_mode_pb2.ProcessingMode
_DEFAULT_PATH = "/v1/completions"


def endpoint_of(url: str) -> str:
    """A replica's base URL as the gateway names endpoints: ``ip:port`` (``[v6]:port``)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def subset_hint(request: pb.ProcessingRequest) -> set[str] | None:
    """The endpoints the gateway allows for this request, or None when it sent no hint."""
    meta = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in meta:
        return None
    value = json_format.MessageToDict(meta[SUBSET_NAMESPACE]).get(SUBSET_KEY)
    if value is None:
        return None
    items = value if isinstance(value, list) else str(value).split(",")
    return {endpoint_of("http://" + str(e).strip()) for e in items if str(e).strip()}


@dataclass
class _Stream:
    """What one ext_proc stream (one HTTP request) has seen so far."""

    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    subset: set[str] | None = None
    body_mode: int = _MODES.NONE
    wait_for_headers_answer: bool = True  # Envoy sends the body only once the headers were answered
    picked: Backend | None = None


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """The ext_proc servicer over the router's picker (and its pool), hold and metrics."""

    def __init__(
        self, picker: Picker, hold: Hold, metrics: RouterMetrics, policy: str, max_body_bytes: int
    ) -> None:
        self.picker = picker
        self.hold = hold
        self.metrics = metrics
        self.policy = policy
        self.max_body_bytes = max_body_bytes  # the proxy's (and the engine's) limit: 413 beyond it

    async def Process(  # noqa: N802 - the gRPC method's name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        s = _Stream()
        try:
            async for req in request_iterator:
                for resp in await self._on_message(s, req):
                    yield resp
                    if resp.HasField("immediate_response"):
                        return
        finally:
            if s.picked is not None:
                s.picked.inflight -= 1

    async def _on_message(self, s: _Stream, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            if req.HasField("protocol_config"):
                s.body_mode = req.protocol_config.request_body_mode
                s.wait_for_headers_answer = (
                    not req.protocol_config.send_body_without_waiting_for_header_response
                )
            s.subset = subset_hint(req)
            for h in req.request_headers.headers.headers:
                s.headers[h.key.lower()] = h.raw_value.decode(errors="replace") if h.raw_value else h.value
            if req.request_headers.end_of_stream:  # no body: pick now
                return [await self._picked(s, "request_headers")]
            if s.body_mode in (_MODES.BUFFERED, _MODES.BUFFERED_PARTIAL) and s.wait_for_headers_answer:
                return [_continue("request_headers")]
            return []  # answered with the pick once the body has ended
        if kind == "request_body":
            s.body += req.request_body.body
            if len(s.body) > self.max_body_bytes:  # a replica would refuse it: no need to hold it all
                limit = self.max_body_bytes
                err = {
                    "message": f"Request body is larger than the limit of {limit} bytes.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
                return [_immediate(413, json.dumps({"error": err}).encode(), None)]
            if not req.request_body.end_of_stream:
                if s.body_mode == _MODES.FULL_DUPLEX_STREAMED:
                    return []  # the whole body goes back with the last answer
                return [_continue("request_body")]
            if s.subset is None:  # the hint may come with the body's message instead
                s.subset = subset_hint(req)
            if s.body_mode in (_MODES.BUFFERED, _MODES.BUFFERED_PARTIAL) and s.wait_for_headers_answer:
                return [await self._picked(s, "request_body")]
            answer = await self._picked(s, "request_headers")
            if answer.HasField("immediate_response"):
                return [answer]
            body = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse()))
            if s.body_mode == _MODES.FULL_DUPLEX_STREAMED:
                streamed = pb.StreamedBodyResponse(body=bytes(s.body), end_of_stream=True)
                body.request_body.response.body_mutation.streamed_response.CopyFrom(streamed)
            return [answer, body]
        if kind == "response_body" and s.body_mode == _MODES.FULL_DUPLEX_STREAMED:
            resp = pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse()))
            streamed = pb.StreamedBodyResponse(
                body=req.response_body.body, end_of_stream=req.response_body.end_of_stream
            )
            resp.response_body.response.body_mutation.streamed_response.CopyFrom(streamed)
            return [resp]
        if kind in ("response_headers", "response_body", "request_trailers", "response_trailers"):
            return [_continue(kind)]
        return []

    async def _picked(self, s: _Stream, phase: str) -> pb.ProcessingResponse:
        """The answer carrying the pick (as the ``phase`` response), or an immediate 503/429."""
        raw = bytes(s.body)
        try:
            body = json.loads(raw) if raw else {}
            if not isinstance(body, dict):
                body = {}
        except ValueError:
            body = {}
        backends, refusal = await self.hold.until_routable(self.picker.pool.routable, len(raw))
        if refusal is not None:
            code = json.loads(refusal.body)["error"]["code"]
            status = 429 if code == "hold_full" else 503
            return _immediate(status, refusal.body, refusal.headers.get("Retry-After"))
        if s.subset is not None:
            backends = [b for b in backends if endpoint_of(b.url) in s.subset]
            if not backends:
                body_out = _error_body("no endpoint of the gateway's subset hint can take the request")
                return _immediate(503, body_out, None)
        path = s.headers.get(":path", _DEFAULT_PATH).split("?", 1)[0]
        ids = await self.picker.token_ids(path, body)
        b, decision, chain = self.picker.choose(backends, ids, body.get("model"))
        if chain:
            b.index.predict(chain)
        b.inflight += 1
        s.picked = b
        self.metrics.decisions.labels(self.policy, decision.reason).inc()
        self.metrics.routed.labels(b.url).inc()
        self.metrics.predicted_cached.labels(b.url).inc(decision.predicted_cached_tokens)
        endpoint = endpoint_of(b.url)
        common = pb.CommonResponse(clear_route_cache=True)
        common.header_mutation.set_headers.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=DESTINATION, raw_value=endpoint.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        )
        resp = pb.ProcessingResponse()
        if phase == "request_headers":
            resp.request_headers.response.CopyFrom(common)
        else:
            resp.request_body.response.CopyFrom(common)
        resp.dynamic_metadata.update({LB_NAMESPACE: {DESTINATION: endpoint}})
        return resp


def _continue(phase: str) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse()
    target = getattr(resp, phase)
    if phase.endswith("trailers"):
        target.SetInParent()
    else:
        target.response.status = pb.CommonResponse.CONTINUE
    return resp


def _error_body(message: str) -> bytes:
    err = {"message": message, "type": "service_unavailable_error", "param": None, "code": "no_backend"}
    return json.dumps({"error": err}).encode()


def _immediate(status: int, body: bytes, retry_after: str | None) -> pb.ProcessingResponse:
    imm = pb.ImmediateResponse(status=http_status_pb2.HttpStatus(code=status), body=body)
    headers = [("content-type", "application/json")]
    if retry_after:
        headers.append(("retry-after", retry_after))
    for key, value in headers:
        imm.headers.set_headers.append(
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()))
        )
    return pb.ProcessingResponse(immediate_response=imm)


async def serve(processor: ExternalProcessor, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the ext_proc and health services on ``host:port`` (0: a free port); the server and its port.
    Health is SERVING for as long as the picker runs: with no replica it still answers (503s), as /livez."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} for ext_proc")
    await server.start()
    for name in HEALTH_SERVICES:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


def struct_of(value: dict[str, Any]) -> struct_pb2.Struct:
    """A protobuf Struct from a dict (for a gateway's metadata in tests and tools)."""
    out = struct_pb2.Struct()
    out.update(value)
    return out
