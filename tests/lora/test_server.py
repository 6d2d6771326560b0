"""LoRA adapters through `pagoda serve` (the engine core in its own process) with the official openai client:
a request picks an adapter by `model` and gets what transformers + peft say, /v1/models lists adapters with
their parent, adapters load and unload through the routes (enabled by --allow-runtime-lora-updating) behind
the API key, at most --max-cpu-loras of them, and the replica's router_info
root is the one its adapter blocks are cached under."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from pagoda.router.chain import chain_of
from pagoda_testkit.lora import reference_tokens
from pagoda_testkit.processes import free_port, wait_healthy

KEY = "lora-test-key"
NEW_TOKENS = 6
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    cmd = [
        str(Path(sys.executable).parent / "pagoda"), "serve", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--kv-cache-memory-bytes", "64MiB", "--max-model-len", "256",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"beta={adapters['beta']}", "--api-key", KEY,
        "--allow-runtime-lora-updating", "--max-cpu-loras", "3",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, lambda: log.read_text(errors="replace")[-5000:], 600, poll_s=1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from pagoda.engine.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


def complete(c: openai.OpenAI, model: str, prompt: list[int]) -> tuple[str, str]:
    """(the response's model, its greedy text)"""
    out = c.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    return out.model, out.choices[0].text


def test_a_request_picks_its_adapter_by_model_name(server, reference, adapters, tok):
    c = client(server)
    base = c.models.list().data[0].id
    cards = {m.id: m.model_dump() for m in c.models.list().data}
    assert cards["beta"]["parent"] == base and cards["beta"]["root"] == str(adapters["beta"])
    assert cards[base]["parent"] is None

    prompt = tok(PROMPT).input_ids
    want = {
        name: tok.decode(reference_tokens(reference, name, prompt, NEW_TOKENS)) for name in (None, "beta")
    }
    assert want["beta"] != want[None]
    assert complete(c, "beta", prompt) == ("beta", want["beta"])
    assert complete(c, base, prompt) == (base, want[None])
    with pytest.raises(openai.NotFoundError, match="alpha"):
        complete(c, "alpha", prompt)


def test_adapters_load_and_unload_through_the_routes(server, reference, adapters, tok):
    c = client(server)

    def post(route: str, **body) -> str:
        return c.post(route, body=body, cast_to=httpx.Response).text

    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").post(
            "/load_lora_adapter",
            body={"lora_name": "alpha", "lora_path": str(adapters["alpha"])},
            cast_to=str,
        )
    assert "added successfully" in post(
        "/load_lora_adapter", lora_name="alpha", lora_path=str(adapters["alpha"])
    )
    assert [m.parent for m in c.models.list().data if m.id == "alpha"] == [c.models.list().data[0].id]

    prompt = tok(PROMPT).input_ids
    assert complete(c, "alpha", prompt)[1] == tok.decode(
        reference_tokens(reference, "alpha", prompt, NEW_TOKENS)
    )

    with pytest.raises(openai.BadRequestError, match="already been loaded"):
        post("/load_lora_adapter", lora_name="alpha", lora_path=str(adapters["gamma"]))
    with pytest.raises(openai.BadRequestError, match="not a readable PEFT adapter directory"):
        post("/load_lora_adapter", lora_name="delta", lora_path=str(adapters["alpha"].parent))
    assert "added successfully" in post(
        "/load_lora_adapter", lora_name="alpha-again", lora_path=str(adapters["alpha"])
    )  # the same content under another name: one stored copy
    assert complete(c, "alpha-again", prompt)[1] == complete(c, "alpha", prompt)[1]
    with pytest.raises(openai.BadRequestError, match=r"as many as --max-cpu-loras \(3\)"):
        post("/load_lora_adapter", lora_name="gamma", lora_path=str(adapters["gamma"]))
    assert "removed successfully" in post("/unload_lora_adapter", lora_name="alpha-again")
    assert "removed successfully" in post("/unload_lora_adapter", lora_name="alpha")
    with pytest.raises(openai.NotFoundError):
        complete(c, "alpha", prompt)
    with pytest.raises(openai.NotFoundError, match="cannot be found"):
        post("/unload_lora_adapter", lora_name="alpha")
    assert "alpha" not in {m.id for m in c.models.list().data}
    assert complete(c, "beta", prompt)[0] == "beta"  # the server kept serving


def test_router_info_names_the_root_the_adapters_blocks_are_cached_under(server, tok):
    headers = {"Authorization": f"Bearer {KEY}"}
    info = httpx.get(server + "/v1/router_info", headers=headers).json()
    assert set(info["lora_adapters"]) == {"beta"}
    prompt = tok("A prompt of a few blocks for the adapter's chain. " * 4).input_ids
    client(server).completions.create(model="beta", prompt=prompt, max_tokens=1)
    root = bytes.fromhex(info["lora_adapters"]["beta"])
    chain = chain_of(prompt, info["block_size"], tuple(info["extra_keys"]), root)
    base_chain = chain_of(prompt, info["block_size"], tuple(info["extra_keys"]))
    device = set(httpx.get(server + "/v1/kv_snapshot", headers=headers).json()["tiers"]["device"])
    assert len(chain) >= 2 and set(chain) <= device
    assert not set(base_chain) & device


def _series(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample called ``name`` on the server's /metrics: (labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return [
        (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    ]


def test_the_gateway_model_server_metrics_say_what_the_protocol_means(server, tok):
    """The Gateway API Inference Extension's model-server protocol (its proposal 003) reads queue length,
    running requests, KV usage, vllm:cache_config_info (block_size, num_gpu_blocks) and
    vllm:lora_requests_info (running and waiting adapters, max_lora, value: when updated): block size and
    block count are the engine's own, and a running adapter is listed while its request runs."""
    import time

    headers = {"Authorization": f"Bearer {KEY}"}
    info = httpx.get(server + "/v1/router_info", headers=headers).json()
    [(cache, one)] = _series(server, "vllm:cache_config_info")
    assert one == 1 and int(cache["block_size"]) == info["block_size"]
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        [(_, value)] = _series(server, name)
        assert value == 0  # idle: nothing queued, running or holding KV

    before = time.time()
    prompt = tok(PROMPT).input_ids
    stream = client(server).completions.create(
        model="beta",
        prompt=prompt,
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # running now
    [(running, _)] = _series(server, "vllm:num_requests_running")
    [(lora, stamp)] = _series(server, "vllm:lora_requests_info")
    usage = _series(server, "vllm:kv_cache_usage_perc")[0][1]
    stream.close()
    assert lora["running_lora_adapters"] == "beta" and lora["waiting_lora_adapters"] == ""
    assert lora["max_lora"] == "2" and before - 1 <= stamp <= time.time() + 1
    assert 0 < usage <= 1
    [(_, blocks)] = _series(server, "pagoda:kv_blocks_total")  # the block pool's size, set by a step
    assert int(cache["num_gpu_blocks"]) == blocks > 0
    # once it is gone (aborted), the one series lists no adapter, stamped later
    deadline = time.monotonic() + 60
    while True:
        [(lora, later)] = _series(server, "vllm:lora_requests_info")
        if lora["running_lora_adapters"] == "" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert lora["running_lora_adapters"] == "" and later >= stamp
