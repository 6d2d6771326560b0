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
