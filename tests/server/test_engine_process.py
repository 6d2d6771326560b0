"""The engine core in its own process (`pagoda serve`'s default): if it dies, every in-flight request ends
with a clear 5xx, /health turns 503 and the server exits non-zero; nothing hangs. And the front end's side
of a dead core, deterministically, over a fake core."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from pagoda.engine import SamplingParams
from pagoda.engine.exit_codes import EXIT_ENGINE_DIED
from pagoda_testkit.processes import spawned_children, wait_unhealthy


def stream_until_first_token(srv, body: dict) -> tuple[httpx.Client, Iterator[str], list[str]]:
    """A streamed completion read up to its first chunk. The line iterator must stay referenced: dropping
    it closes the connection, which aborts the request."""
    client = httpx.Client(timeout=300)
    response = client.send(
        client.build_request("POST", srv.base_url + "/completions", json=body), stream=True
    )
    assert response.status_code == 200
    lines = response.iter_lines()
    seen = [next(line for line in lines if line)]  # the request runs in the core now
    return client, lines, seen


def test_a_core_that_dies_ends_every_request_with_a_5xx_and_stops_the_server(start_pagoda):
    srv = start_pagoda()
    (core,) = spawned_children(srv.proc.pid)
    tid = httpx.post(srv.url + "/tokenize", json={"prompt": " the", "add_special_tokens": False}).json()[
        "tokens"
    ][0]
    body = {"prompt": [tid] * 8, "max_tokens": 900, "ignore_eos": True}
    streams = [stream_until_first_token(srv, {**body, "stream": True}) for _ in range(2)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        plain = pool.submit(httpx.post, srv.base_url + "/completions", json=body, timeout=300)
        deadline = time.monotonic() + 120
        while srv.metric("vllm:num_requests_running") < 3:  # the non-streamed one runs too
            assert time.monotonic() < deadline, "the third request never ran"
            time.sleep(0.1)
        os.kill(core, signal.SIGKILL)

        for client, lines, seen in streams:
            rest = [line for line in lines if line]
            client.close()
            assert rest[-1] == "data: [DONE]"
            error = json.loads(rest[-2][len("data: ") :])["error"]
            assert error["code"] == "engine_error" and error["type"] == "internal_server_error"
            assert "engine core process killed by signal 9" in error["message"]
            assert len(seen + rest) < 900  # it ended early, with the error, not after its 900 tokens
        answer = plain.result()
    assert answer.status_code == 500, answer.text
    assert "engine core process killed by signal 9" in answer.json()["error"]["message"]
    health = wait_unhealthy(srv)
    assert health is None or (health.status_code == 503 and health.json()["error"]["code"] == "engine_dead")
    assert srv.proc.wait(120) == EXIT_ENGINE_DIED, srv.log()
    assert "the engine core process (pid" in srv.log() and "killed by signal 9" in srv.log()


@pytest.mark.asyncio
async def test_a_dead_core_makes_health_503_and_refuses_new_requests(fakes):
    from pagoda.engine.server.app import build_app
    from pagoda.engine.server.settings import ServerSettings

    engine, core = fakes.start(step_s=0.001)
    died: list[str] = []
    engine.add_dead_listener(died.append)
    app = build_app(engine, ServerSettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pagoda") as client:
        assert (await client.get("/health")).status_code == 200
        stream = await engine.add_request("r", [1], SamplingParams(max_tokens=500))
        core.dead_reason = "tensor-parallel rank 1 exited (code -9)"
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            async for _ in stream:
                pass
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json()["error"] == {
            "message": "engine not running: tensor-parallel rank 1 exited (code -9)",
            "type": "service_unavailable_error",
            "param": None,
            "code": "engine_dead",
        }
        r = await client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert died == ["tensor-parallel rank 1 exited (code -9)"]
    engine.shutdown()
