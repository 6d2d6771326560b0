"""Real server processes in tests and benchmarks: a free port, and waiting until one answers /health."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(
    proc: subprocess.Popen, url: str, log_tail: Callable[[], str], timeout: float, poll_s: float = 0.25
) -> None:
    """Return once `url`/health answers 200; a RuntimeError with the log's tail if the process exits first or
    `timeout` seconds pass (the caller stops the process)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log_tail()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{url} not healthy after {timeout} s:\n{log_tail()}")


def spawned_children(parent: int) -> list[int]:
    """PIDs of the processes `parent` started with multiprocessing's spawn (the engine core process of a
    `pagoda serve`, the tensor-parallel ranks of an engine core)."""
    from pathlib import Path

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


def wait_unhealthy(server, timeout: float = 120) -> httpx.Response | None:
    """Poll `server`'s /health until it stops answering 200: that answer, or None once nothing answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            health = httpx.get(server.url + "/health", timeout=10)
        except httpx.TransportError:
            return None
        if health.status_code != 200:
            return health
        time.sleep(0.2)
    raise AssertionError(f"{server.url}/health still answers 200 after {timeout} s")
