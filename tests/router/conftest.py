"""Real `pagoda serve` replicas and `pagoda router` processes for the router's end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from pagoda_testkit import processes
from pagoda_testkit.processes import free_port

PAGODA = str(Path(sys.executable).parent / "pagoda")
# Small KV pools and context: two replicas share 2 CPU cores with the test.
SMALL = ["--kv-cache-memory-bytes", "64MiB", "--max-model-len", "1024", "--max-num-seqs", "8"]
# A router that notices health and KV events within a fraction of a second, for tests that wait on both.
FAST = ("--health-interval", "0.5", "--events-interval", "0.1")
START_TIMEOUT_S = float(os.environ.get("PAGODA_TEST_SERVER_START_TIMEOUT", "300"))


@dataclass
class Proc:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0 when none)."""
        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=30).text):
            for s in fam.samples:
                if s.name == name and set(labels.items()) <= set(s.labels.items()):
                    total += s.value
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait(10)
        return self.proc.returncode


def start(log_dir: Path, argv: list[str], port: int, name: str, env: dict[str, str] | None = None) -> Proc:
    """``env``: more environment variables (PAGODA_API_KEY of the caller's is never passed on)."""
    log_path = log_dir / f"{name}-{port}.log"
    base = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    base.pop("PAGODA_API_KEY", None)
    env = {**base, **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Proc(proc, port, log_path)


def wait_healthy(p: Proc, timeout: float = START_TIMEOUT_S) -> Proc:
    try:
        processes.wait_healthy(p.proc, p.url, p.log, timeout)
    except RuntimeError:
        p.stop(signal.SIGKILL)
        raise
    return p


def start_replica(log_dir: Path, *extra: str, port: int | None = None) -> Proc:
    """``port``: a given one (a restart at the address the router knows), else a free one."""
    port = port or free_port()
    argv = [
        PAGODA,
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SMALL,
        "--uvicorn-log-level",
        "warning",
    ]
    return start(log_dir, [*argv, *extra], port, "replica")


def start_router(log_dir: Path, backends: list[str], *extra: str, env: dict[str, str] | None = None) -> Proc:
    port = free_port()
    argv = [PAGODA, "router", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    for b in backends:
        argv += ["--backend", b]
    return wait_healthy(start(log_dir, [*argv, *extra], port, "router", env), timeout=60)


def wait_synced(router: Proc, timeout: float = 120, api_key: str | None = None) -> list[dict]:
    """The router's replicas once all are healthy and followed (KV snapshot loaded), or as they are at the
    deadline."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while True:
        backends = httpx.get(router.url + "/router/state", headers=headers).json()["backends"]
        if (backends and all(b["healthy"] and b["synced"] for b in backends)) or time.monotonic() > deadline:
            return backends
        time.sleep(0.2)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("replicas")
    # A drain waits for the stream in flight however slow a loaded machine makes it (the default 30 s cut
    # one short); nothing else is in flight when a replica stops.
    grace = ("--shutdown-grace-seconds", "600")
    procs = [start_replica(log_dir, *grace), start_replica(log_dir, *grace)]  # both load at once
    try:
        yield [wait_healthy(p) for p in procs]
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="session")
def kit():
    """The helpers above, for test modules (conftest itself is not importable under importlib mode)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        PAGODA=PAGODA,
        FAST=FAST,
        free_port=free_port,
        start=start,
        start_replica=start_replica,
        start_router=start_router,
        wait_healthy=wait_healthy,
        wait_synced=wait_synced,
    )
