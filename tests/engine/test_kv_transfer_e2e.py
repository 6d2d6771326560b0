"""Prefill/decode disaggregation with two `pagoda serve` processes on loopback (a tiny random-weight float32
Llama): a decode engine told ``x-prefiller-host-port`` gets the prompt's blocks from the prefill engine and
answers the tokens it answers alone; a dead prefill engine, a fetch that fails and a corrupt block each fall
back to a local prefill with the same tokens, counted in ``pagoda:kv_transfer_failures_total``; and the
same through `pagoda router --prefill-backend`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from pagoda.engine.kv_transfer.wire import FETCH_MAGIC, encode_answer, fetch_blocks
from pagoda_testkit.processes import free_port, wait_healthy
from pagoda_testkit.tiny_llama import tiny_llama
from prometheus_client.parser import text_string_to_metric_families

PAGODA = str(Path(sys.executable).parent / "pagoda")
SMALL = ["--kv-cache-memory-bytes", "8MiB", "--max-model-len", "256", "--uvicorn-log-level", "warning"]
PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(56)]  # 3 usable blocks of 16 (the 4th holds the last token)


class Engine:
    def __init__(self, model: Path, log_dir: Path, name: str, kv: dict) -> None:
        self.port = free_port()
        self.log_path = log_dir / f"{name}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        env.pop("PAGODA_API_KEY", None)
        argv = [PAGODA, "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port), *SMALL]
        argv += ["--kv-transfer-config", json.dumps(kv)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=30).text):
            for s in fam.samples:
                if s.name == name and set(labels.items()) <= set(s.labels.items()):
                    total += s.value
        return total

    def complete(self, prompt: list[int], headers: dict | None = None, **body) -> dict:
        r = httpx.post(
            self.url + "/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 10,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
                **body,
            },
            headers=headers or {},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        return r.json()

    def local(self, prompt: list[int]) -> list[str]:
        """The tokens this engine answers alone, from a cold cache."""
        assert httpx.post(self.url + "/reset_prefix_cache", timeout=60).status_code == 200
        answer = self.complete(prompt)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        return tokens(answer)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def tokens(answer: dict) -> list[str]:
    return answer["choices"][0]["logprobs"]["tokens"]


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("pd")
    model = tiny_llama(root / "llama", default_model_dir, vocab_size=49152)  # chat prompts too
    kv_port = free_port()
    producer = Engine(
        model, root, "producer", {"kv_role": "kv_producer", "kv_port": kv_port, "kv_ip": "127.0.0.1"}
    )
    consumer = Engine(model, root, "consumer", {"kv_role": "kv_consumer"})
    try:
        for e in (producer, consumer):
            wait_healthy(e.proc, e.url, e.log, 600, poll_s=0.5)
        yield producer, consumer, kv_port
    finally:
        producer.stop()
        consumer.stop()


def prompt(seed: int) -> list[int]:
    return [(t + seed * 101) % 500 + 3 for t in PROMPT]


def test_split_and_unsplit_give_the_same_tokens(engines) -> None:
    producer, consumer, _ = engines
    header = {"x-prefiller-host-port": f"127.0.0.1:{producer.port}"}
    p = prompt(1)
    split = consumer.complete(p, header)
    assert cached(split) == 48  # the three usable blocks came from the prefill engine
    assert consumer.metric("pagoda:kv_transfer_received_blocks_total") == 3
    assert consumer.metric("pagoda:kv_transfer_received_bytes_total") > 3 * 16 * 256  # KV + record headers
    assert producer.metric("pagoda:kv_transfer_requests_total", role="producer") == 1
    assert tokens(split) == consumer.local(p)
    assert tokens(split) == tokens(producer.complete(p))  # and the prefill engine's own answer


def test_a_chat_request_is_split_too(engines) -> None:
    producer, consumer, _ = engines
    header = {"x-prefiller-host-port": f"127.0.0.1:{producer.port}"}
    body = {
        "messages": [{"role": "user", "content": "one two three " * 12}],
        "max_tokens": 8,
        "temperature": 0,
    }
    url = consumer.url + "/v1/chat/completions"
    split = httpx.post(url, json=body, headers=header, timeout=300).json()
    assert cached(split) >= 32
    assert httpx.post(consumer.url + "/reset_prefix_cache", timeout=60).status_code == 200
    alone = httpx.post(url, json=body, timeout=300).json()
    assert cached(alone) == 0
    assert split["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_a_fetch_that_fails_is_a_local_prefill(engines) -> None:
    _, consumer, _ = engines
    p = prompt(2)
    dead = free_port()  # nothing listens there
    params = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": dead,
        "remote_request_id": "r",
    }
    before = consumer.metric("pagoda:kv_transfer_failures_total", reason="fetch")
    answer = consumer.complete(p, kv_transfer_params=params)
    assert consumer.metric("pagoda:kv_transfer_failures_total", reason="fetch") == before + 1
    assert cached(answer) == 0
    assert tokens(answer) == consumer.local(p)


def test_a_corrupt_block_is_computed_not_used(engines) -> None:
    """The prefill engine's real blocks, one byte of the first flipped on the way (a fake peer serves them):
    the checksum catches it, and every block after it in the chain is computed too."""
    producer, consumer, kv_port = engines
    p = prompt(3)
    prefill = producer.complete(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = prefill["kv_transfer_params"]
    assert params["remote_port"] == kv_port and params["do_remote_prefill"] is True
    records = fetch_blocks("127.0.0.1", kv_port, params["remote_request_id"], timeout=30)
    assert len(records) == 3
    bad = bytearray(records[0])
    bad[-5] ^= 0x04
    records[0] = bytes(bad)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(len(FETCH_MAGIC) + 4 + 4096)
                conn.sendall(encode_answer(records))

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        fake = {**params, "remote_host": "127.0.0.1", "remote_port": server.getsockname()[1]}
        before = consumer.metric("pagoda:kv_transfer_failures_total", reason="verify")
        answer = consumer.complete(p, kv_transfer_params=fake)
        t.join(30)
    assert consumer.metric("pagoda:kv_transfer_failures_total", reason="verify") == before + 1
    assert cached(answer) == 0
    assert tokens(answer) == consumer.local(p)


def test_through_the_router(engines, tmp_path) -> None:
    """`pagoda router --backend D --prefill-backend P`: the client sends a plain request, the router names P."""
    producer, consumer, _ = engines
    port = free_port()
    argv = [PAGODA, "router", "--host", "127.0.0.1", "--port", str(port), "--policy", "leastLoaded"]
    argv += ["--backend", consumer.url, "--prefill-backend", producer.url, "--log-level", "warning"]
    log_path = tmp_path / "router.log"
    env = dict(os.environ)
    env.pop("PAGODA_API_KEY", None)  # the router would require it from clients
    with open(log_path, "wb") as log:
        router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(router, url, lambda: log_path.read_text(errors="replace")[-3000:], 120, poll_s=0.5)
        p = prompt(5)
        before = consumer.metric("pagoda:kv_transfer_received_blocks_total")
        body = {"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=300).json()
        assert cached(answer) == 48
        assert consumer.metric("pagoda:kv_transfer_received_blocks_total") == before + 3
        assert tokens(answer) == consumer.local(p)
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(30)
        except subprocess.TimeoutExpired:
            router.kill()


def test_a_dead_prefill_engine_is_a_local_prefill(engines) -> None:
    producer, consumer, _ = engines
    producer.stop(signal.SIGKILL)
    p = prompt(4)
    before = consumer.metric("pagoda:kv_transfer_failures_total", reason="prefiller")
    answer = consumer.complete(p, {"x-prefiller-host-port": f"127.0.0.1:{producer.port}"})
    assert consumer.metric("pagoda:kv_transfer_failures_total", reason="prefiller") == before + 1
    assert cached(answer) == 0
    assert tokens(answer) == consumer.local(p)
