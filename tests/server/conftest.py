"""Real `pagoda serve` processes for the server tests, helpers to read their /metrics, and a fake engine
core (same threading and output contract as LLMEngine, no model) for the AsyncEngine and serving tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from pagoda_testkit.processes import free_port, wait_healthy
from prometheus_client.parser import text_string_to_metric_families

PAGODA = str(Path(sys.executable).parent / "pagoda")
START_TIMEOUT_S = float(os.environ.get("PAGODA_TEST_SERVER_START_TIMEOUT", "600"))
# Small KV cache and context: the tests run on 2 shared CPU cores.
SMALL = ["--kv-cache-memory-bytes", "64MiB", "--max-model-len", "1024", "--uvicorn-log-level", "warning"]


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
    try:
        wait_healthy(proc, server.url, server.log, START_TIMEOUT_S, poll_s=1)
    except RuntimeError:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The default server (prefix caching on), shared by the API, load and schema tests."""
    srv = start_server(tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    """The official openai client on the default server."""
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="session")
def model(client) -> str:
    return client.models.list().data[0].id


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


# ---------------------------------------------------------------- a fake engine core


class FakeTokenizer:
    """Words -> ids by a stable sum, id i -> " wi"; records the thread of every encode / chat render."""

    def __init__(self, vocab_size: int = 1000) -> None:
        self.vocab_size = vocab_size
        self.threads: list[str] = []
        self.encode_calls = 0

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return {f"w{i}": i for i in range(self.vocab_size)}  # at most 4 characters a token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        self.encode_calls += 1
        return [1 + sum(w.encode()) % (self.vocab_size - 1) for w in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: object) -> str:
        return "".join(f" w{i}" for i in ids)

    def apply_chat_template(self, messages: list[dict], **kwargs: object) -> str:
        self.threads.append(threading.current_thread().name)
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


@dataclass
class _FakeRequest:
    params: object
    max_tokens: int
    produced: int = 0


@dataclass
class FakeCore:
    """EngineCore's contract without a model: every sequence gets token k in its k-th step.

    `log` records ("add" | "abort" | "finish" | "step", request id or None) in the core thread's order;
    `fail_steps` makes the steps with those numbers raise; `block_add` makes add_request wait on it.
    """

    step_s: float = 0.0
    vocab_size: int = 1000
    max_model_len: int = 1024
    model_name: str = "fake"
    fail_steps: set[int] = field(default_factory=set)
    block_add: threading.Event | None = None
    log: list[tuple[str, str | None]] = field(default_factory=list)
    arrivals: dict[str, float] = field(default_factory=dict)
    requests: dict[str, _FakeRequest] = field(default_factory=dict)
    steps: int = 0
    entered_add: threading.Event = field(default_factory=threading.Event)
    serving_front_end: bool = False
    dead_reason: str | None = None
    _aborted: list = field(default_factory=list)

    def __post_init__(self) -> None:
        from pagoda.engine.core.info import EngineInfo

        self.info = EngineInfo(
            model_name=self.model_name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            block_size=16,
            num_blocks=64,
        )

    def add_request(self, req) -> None:
        self.log.append(("add", req.request_id))
        if self.block_add is not None:
            self.entered_add.set()
            self.block_add.wait(30)
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.arrivals[req.request_id] = req.arrival_time
        self.requests[req.request_id] = _FakeRequest(req.params, req.max_tokens)

    def abort_requests(self, request_ids) -> None:
        from pagoda.engine.core.messages import CoreOutput, SeqDelta

        for rid in list(request_ids):
            self.log.append(("abort", rid))
            req = self.requests.pop(rid, None)
            if req is not None:
                seqs = [SeqDelta(i, [], finish_reason="abort") for i in range(req.params.n)]
                self._aborted.append(CoreOutput(rid, seqs, finished=True))

    def finish_seqs(self, seqs) -> None:
        for rid, _index, _stop in seqs:
            self.log.append(("finish", rid))
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def reset_prefix_cache(self) -> bool:
        return True

    def get_scheduler_stats(self):
        from pagoda.engine.core.stats import SchedulerStats

        return SchedulerStats(num_running=len(self.requests))

    def take_finished_stats(self) -> list:
        return []

    def step(self, stats: bool = True):
        from pagoda.engine.core.messages import CoreOutput, EngineCoreOutputs, SeqDelta
        from pagoda.engine.core.stats import IterationStats

        self.steps += 1
        self.log.append(("step", None))
        if self.step_s:
            time.sleep(self.step_s)
        if self.steps in self.fail_steps:
            raise RuntimeError(f"injected failure in step {self.steps}")
        outputs, self._aborted = self._aborted, []
        for rid, req in list(self.requests.items()):
            req.produced += 1
            done = req.produced >= req.max_tokens
            reason = "length" if done else None
            seqs = [SeqDelta(i, [req.produced], finish_reason=reason) for i in range(req.params.n)]
            outputs.append(CoreOutput(rid, seqs, finished=done))
            if done:
                del self.requests[rid]
        return EngineCoreOutputs(outputs, self.get_scheduler_stats(), IterationStats())

    def close(self) -> None:
        pass


def start_fake(**kwargs):
    """An AsyncEngine over a FakeCore on a thread, started on the running loop: (engine, core)."""
    from pagoda.engine.frontend.async_engine import AsyncEngine, CoreThread

    core = FakeCore(**kwargs)
    engine = AsyncEngine(CoreThread(core), FakeTokenizer(core.vocab_size))
    engine.start()
    return engine, core


@pytest.fixture(scope="session")
def fakes() -> SimpleNamespace:
    """The fake core and tokenizer (test modules cannot import conftest under importlib mode)."""
    return SimpleNamespace(FakeCore=FakeCore, FakeTokenizer=FakeTokenizer, start=start_fake)
