"""`pagoda serve --tensor-parallel-size 2` on CPU: it answers the openai client, and a rank that dies stops the
engine (so the pod is restarted) instead of hanging requests."""

from __future__ import annotations

import os
import signal

import httpx
from openai import OpenAI
from pagoda_testkit.processes import spawned_children, wait_unhealthy


def test_tp2_server_answers_and_a_dead_rank_stops_the_server(start_pagoda):
    server = start_pagoda(
        "--kv-cache-memory-bytes", "64MiB", "--max-model-len", "512", "--tensor-parallel-size", "2"
    )  # fmt: skip
    try:
        client = OpenAI(base_url=server.base_url, api_key="unused")
        reply = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=8, temperature=0
        )
        assert reply.choices[0].text.strip().startswith("Paris")
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200

        (core,) = spawned_children(server.proc.pid)  # the engine core process is rank 0
        (rank1,) = spawned_children(core)
        os.kill(rank1, signal.SIGKILL)
        health = wait_unhealthy(server)  # 503 naming the rank until the server is gone, then no answer
        assert health is None or (health.status_code == 503 and "rank 1" in health.text), health.text
        assert server.proc.wait(120) == 4, server.log()
        assert "tensor-parallel rank 1 exited" in server.log()
        assert not os.path.exists(f"/proc/{core}"), "the engine core process outlived the server"
    finally:
        server.stop()
