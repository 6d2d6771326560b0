"""A small stand-in for `pagoda serve` in the router's fault tests, run as its own process:

    python fake_replica.py PORT MODE REQUEST_LOG [GAP_S]

MODE is one of
- ``ok``: streams ``WORDS`` chat chunks, ``GAP_S`` seconds apart (default 0.05), then a finishing chunk
  and ``[DONE]``; a non-streamed request gets one chat completion (any body size up to 64 MiB);
- ``busy``: every completion is a 503 ``queue_full`` with ``Retry-After: 7``, as a full engine answers;
- ``crash``: streams like ``ok``, and once its first stream has sent ``CRASH_AFTER`` chunks the process
  kills itself (SIGKILL): every stream it is serving is cut where it stands;
- ``die``: a query of death: once it has read a completion request (logged it), the process kills itself
  (SIGKILL), before any answer (for a stream: right after sending its headers);
- ``hang``: streams ``CRASH_AFTER`` chunks, then stays silent with the connection open; ``mute``: the same
  before its first chunk (headers sent). Stop either with SIGKILL: a graceful stop would wait for them.

For the ext_proc picker's tests (test_ext_proc.py) it can also play a replica's routing state, from its
environment: ``FAKE_ROUTER_INFO`` (JSON) is its /v1/router_info (block size, LoRA adapters), ``FAKE_KV``
(JSON: tier -> block hashes) its /v1/kv_snapshot (its events then stay empty), ``FAKE_LOAD`` its
``vllm:num_requests_running``. Without them it has no /v1/router_info and no KV routes, as before.

Every completion request is appended to REQUEST_LOG (one line each) before it is answered, so a test can
compare what the replica received with what the router counted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

from aiohttp import web

WORDS = 30
GAP_S = 0.05
CRASH_AFTER = 3
RETRY_AFTER = "7"


def chunk(i: int | None) -> bytes:
    """The i-th content chunk, or the finishing one (None)."""
    delta = {} if i is None else {"content": f"w{i} "}
    choice = {"index": 0, "delta": delta, "finish_reason": "stop" if i is None else None}
    body = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "fake", "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def main() -> None:
    port, mode, request_log = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    gap_s = float(sys.argv[4]) if len(sys.argv) > 4 else GAP_S
    streams = 0

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal streams
        body = await request.json()
        with open(request_log, "a") as f:
            f.write(f"{len(json.dumps(body))}\n")
        if mode == "die":
            if body.get("stream"):
                await web.StreamResponse(headers={"Content-Type": "text/event-stream"}).prepare(request)
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "busy":
            err = {
                "error": {"message": "queue full", "type": "service_unavailable_error", "code": "queue_full"}
            }
            return web.json_response(err, status=503, headers={"Retry-After": RETRY_AFTER})
        if not body.get("stream"):
            msg = {"role": "assistant", "content": "".join(f"w{i} " for i in range(WORDS))}
            choice = {"index": 0, "message": msg, "finish_reason": "stop"}
            out = {
                "id": "c1",
                "object": "chat.completion",
                "created": 0,
                "model": "fake",
                "choices": [choice],
            }
            return web.json_response(out)
        streams += 1
        crashes = mode == "crash" and streams == 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if mode == "mute":
            await asyncio.Event().wait()  # never set
        for i in range(WORDS):
            await resp.write(chunk(i))
            if i + 1 == CRASH_AFTER and crashes:
                os.kill(os.getpid(), signal.SIGKILL)
            if i + 1 == CRASH_AFTER and mode == "hang":
                await asyncio.Event().wait()  # never set
            await asyncio.sleep(gap_s)
        await resp.write(chunk(None) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=f"vllm:num_requests_running {os.environ.get('FAKE_LOAD', '0')}\n")

    async def router_info(_: web.Request) -> web.Response:
        return web.json_response(json.loads(os.environ["FAKE_ROUTER_INFO"]))

    async def kv_snapshot(_: web.Request) -> web.Response:
        tiers = {"device": [], "host": [], "disk": [], **json.loads(os.environ["FAKE_KV"])}
        return web.json_response({"seq": 0, "epoch": "fake", "tiers": tiers})

    async def kv_events(_: web.Request) -> web.Response:
        return web.json_response({"resync": False, "epoch": "fake", "batches": []})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", completions)
    if "FAKE_ROUTER_INFO" in os.environ:
        app.router.add_get("/v1/router_info", router_info)
    if "FAKE_KV" in os.environ:
        app.router.add_get("/v1/kv_snapshot", kv_snapshot)
        app.router.add_get("/v1/kv_events", kv_events)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


if __name__ == "__main__":
    main()
