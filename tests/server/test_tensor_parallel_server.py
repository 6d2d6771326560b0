"""`pagoda serve --tensor-parallel-size 2` on CPU: it answers the openai client, and a rank that dies makes
/health fail (so the pod's liveness probe restarts it) instead of hanging requests."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
from openai import OpenAI


def rank_processes(parent: int) -> list[int]:
    """PIDs of the tensor-parallel ranks a server started (multiprocessing spawn children)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and "spawn_main" in cmdline:
            pids.append(int(proc.name))
    return pids


def test_tp2_server_answers_and_a_dead_rank_fails_health(start_pagoda):
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

        (rank1,) = rank_processes(server.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if httpx.get(server.url + "/health", timeout=10).status_code == 503:
                break
            time.sleep(0.5)
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "rank 1" in health.text
    finally:
        server.stop()
