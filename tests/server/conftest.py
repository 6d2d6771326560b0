"""Real `pagoda serve` processes for the server tests, and helpers to read their /metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

PAGODA = str(Path(sys.executable).parent / "pagoda")
START_TIMEOUT_S = float(os.environ.get("PAGODA_TEST_SERVER_START_TIMEOUT", "600"))
# Small KV cache and context: the tests run on 2 shared CPU cores.
SMALL = ["--kv-cache-memory-bytes", "64MiB", "--max-model-len", "1024", "--uvicorn-log-level", "warning"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """(sample name, sorted labels) -> value."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels`."""
        total, found = 0.0, False
        for (sample, lbls), value in self.metrics().items():
            if sample == name and set(labels.items()) <= set(lbls):
                total += value
                found = True
        assert found, f"no sample {name}{labels} in /metrics"
        return total

    def wait_idle(self, timeout: float = 120) -> dict:
        """Poll /metrics until nothing runs or waits; return the last snapshot of the block gauges."""
        deadline = time.monotonic() + timeout
        last = {}
        while time.monotonic() < deadline:
            last = {
                "running": self.metric("vllm:num_requests_running"),
                "waiting": self.metric("vllm:num_requests_waiting"),
                "total": self.metric("pagoda:kv_blocks_total"),
                "free": self.metric("pagoda:kv_blocks_free"),
                "cached": self.metric("pagoda:kv_blocks_cached"),
            }
            if (
                last["running"] == 0
                and last["waiting"] == 0
                and last["free"] + last["cached"] == last["total"]
            ):
                return last
            time.sleep(0.5)
        return last

    free_port = staticmethod(free_port)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait(10)
        return self.proc.returncode


def start_server(log_dir: Path, *args: str, api_key: str | None = None) -> Server:
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
    env.pop("PAGODA_API_KEY", None)
    cmd = [PAGODA, "serve", "--host", "127.0.0.1", "--port", str(port), *SMALL, *args]
    if api_key:
        cmd += ["--api-key", api_key]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(proc, port, log_path, api_key)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagoda serve exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.stop()
    raise RuntimeError(f"pagoda serve did not become healthy in {START_TIMEOUT_S}s:\n{server.log()}")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The default server (prefix caching on), shared by the API, load and schema tests."""
    srv = start_server(tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def start_pagoda(tmp_path_factory: pytest.TempPathFactory):
    """A function that starts an extra `pagoda serve` with given flags; all are stopped at the end."""
    started: list[Server] = []

    def start(*args: str, api_key: str | None = None) -> Server:
        srv = start_server(tmp_path_factory.mktemp("server"), *args, api_key=api_key)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()
