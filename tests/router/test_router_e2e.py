"""Two real `pagoda serve` replicas behind a real `pagoda router`: conversations stay where their prefix is,
the router's block chain is the engine's, streams pass through and a disconnect aborts on the replica,
a draining or dead replica gets no new requests and clients see no 5xx."""

from __future__ import annotations

import signal
import sys
import time

import httpx
import pytest
from openai import OpenAI
from pagoda.router.chain import ChainHasher, chain_of, load_local_tokenizer

pytestmark = pytest.mark.timeout(300)

MODEL = "SmolLM2-135M-Instruct"  # the default model's served name
SYSTEMS = [
    "You are a terse assistant for a shipping company. " * 12,
    "You are a helpful botanist who answers in one short sentence. " * 10,
]


def routed(router, url: str) -> float:
    return router.metric("pagoda:router_routed_total", backend=url)


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory, kit):
    r = kit.start_router(tmp_path_factory.mktemp("router"), [p.url for p in replicas], *kit.FAST)
    kit.wait_synced(r)  # both replicas healthy and followed
    yield r
    r.stop()


def wait_for(what: str, check, timeout: float = 120):
    """Poll ``check`` until it returns something true; fail naming ``what`` after ``timeout`` seconds (a
    bound for a stuck test, not an expectation of speed)."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.1)
    return result


def followed(router, url: str) -> None:
    """Wait until the router has applied every KV event replica ``url`` had published when called."""
    seq = httpx.get(url + "/v1/kv_snapshot").json()["seq"]

    def state() -> dict:
        return next(b for b in httpx.get(router.url + "/router/state").json()["backends"] if b["url"] == url)

    wait_for(f"the router follows {url} to seq {seq}", lambda: state()["seq"] >= seq)


def client(router) -> OpenAI:
    return OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_models_pass_through(router, replicas):
    ids = [m.id for m in client(router).models.list().data]
    direct = httpx.get(replicas[0].url + "/v1/models").json()
    assert ids == [m["id"] for m in direct["data"]] and ids


def test_router_chain_is_the_engines_chain(router, replicas):
    messages = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "Where is my parcel?"}]
    before = {p.url: routed(router, p.url) for p in replicas}
    out = client(router).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    served = [p for p in replicas if routed(router, p.url) > before[p.url]]
    assert len(served) == 1
    info = httpx.get(served[0].url + "/v1/router_info").json()
    ids = ChainHasher(load_local_tokenizer(None)).token_ids("/v1/chat/completions", {"messages": messages})
    assert len(ids) == out.usage.prompt_tokens
    chain = chain_of(ids, info["block_size"], tuple(info["extra_keys"]))
    assert len(chain) == out.usage.prompt_tokens // info["block_size"] >= 8
    device = set(httpx.get(served[0].url + "/v1/kv_snapshot").json()["tiers"]["device"])
    assert set(chain) <= device  # every full prompt block, under exactly the hash the router computed
    other = next(p for p in replicas if p is not served[0])
    assert not set(chain) & set(httpx.get(other.url + "/v1/kv_snapshot").json()["tiers"]["device"])


def test_second_turn_lands_on_the_replica_of_the_first(router, replicas):
    c = client(router)
    homes = []
    for i, system in enumerate(SYSTEMS):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]
        before = {p.url: routed(router, p.url) for p in replicas}
        first = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
        home = next(p.url for p in replicas if routed(router, p.url) > before[p.url])
        followed(router, home)  # the first turn's blocks are in the router's index
        msgs += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And then?"},
        ]
        before = {p.url: routed(router, p.url) for p in replicas}
        second = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
        again = next(p.url for p in replicas if routed(router, p.url) > before[p.url])
        assert again == home
        bs = 16
        assert second.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens // bs) * bs - bs
        homes.append(home)
    decisions = router.metric("pagoda:router_decisions_total", policy="tierAware", reason="device_hit")
    assert decisions >= 2
    observed = router.metric("pagoda:router_observed_cached_tokens_total")
    predicted = router.metric("pagoda:router_predicted_cached_tokens_total")
    assert observed > 0 and predicted > 0


def test_stream_passes_through_and_disconnect_aborts_on_the_replica(router, replicas):
    c = client(router)
    chunks = list(
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=6, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) >= 1
    aborts = sum(p.metric("vllm:request_success_total", finished_reason="abort") for p in replicas)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: {")
            if got >= 3:
                break  # leave with ~397 tokens still to generate

    def aborted() -> float:
        now = sum(p.metric("vllm:request_success_total", finished_reason="abort") for p in replicas)
        running = sum(p.metric("vllm:num_requests_running") for p in replicas)
        return now if now > aborts and running == 0 else 0

    assert wait_for("the replica aborts the request", aborted) == aborts + 1


FAKE_REPLICA = """
import sys
from aiohttp import web
app = web.Application()
app.router.add_get("/health", lambda r: web.Response())
app.router.add_get("/metrics", lambda r: web.Response(text=""))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def test_connection_refused_is_retried_on_another_replica(replicas, tmp_path_factory, kit):
    """A replica that dies between two health checks: its requests go to another one, clients see 200."""
    log_dir = tmp_path_factory.mktemp("fake")
    port = kit.free_port()
    fake = kit.wait_healthy(
        kit.start(log_dir, [sys.executable, "-c", FAKE_REPLICA, str(port)], port, "fake"), 30
    )
    r = kit.start_router(
        log_dir,
        [replicas[0].url, fake.url],
        "--policy",
        "roundRobin",
        "--health-interval",
        "3600",  # no health round during the test: the request finds the replica dead
        "--tokenizer",
        "backend",
    )
    try:
        state = httpx.get(r.url + "/router/state").json()
        assert all(b["healthy"] for b in state["backends"])
        fake.stop(signal.SIGKILL)
        c = client(r)
        for _ in range(4):  # round robin: the second goes to the dead one, then it is out
            out = c.completions.create(model=MODEL, prompt="Hello", max_tokens=1)
            assert out.usage.completion_tokens == 1
        assert r.metric("pagoda:router_retries_total", reason="connect") == 1  # then it is unhealthy
        state = {b["url"]: b["healthy"] for b in httpx.get(r.url + "/router/state").json()["backends"]}
        assert state == {replicas[0].url: True, fake.url: False}
        assert r.metric("pagoda:router_requests_total", code="200") == 4
    finally:
        r.stop()


def test_backend_dns_finds_the_replica_by_name(replicas, tmp_path_factory, kit):
    """--backend-dns as the operator renders it, on loopback: the name's A records are the replicas."""
    port = replicas[0].port
    r = kit.start_router(
        tmp_path_factory.mktemp("dns"),
        [],
        "--backend-dns",
        f"localhost:{port}",
        "--dns-interval",
        "0.5",
        *kit.FAST,
    )
    try:
        backends = {b["url"]: b for b in kit.wait_synced(r)}
        # every address localhost resolves to is a replica; only 127.0.0.1 listens
        assert f"http://127.0.0.1:{port}" in backends
        assert backends[f"http://127.0.0.1:{port}"]["synced"]
        out = client(r).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
        )
        assert out.usage.completion_tokens == 1
        assert routed(r, f"http://127.0.0.1:{port}") == 1
    finally:
        r.stop()


def test_a_draining_replica_finishes_its_work_and_gets_no_new_requests(router, replicas):
    """SIGTERM: /health says 503 draining, the stream in flight ends normally, new requests go elsewhere."""
    leaving, staying = replicas[1], replicas[0]
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 150,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", leaving.url + "/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        leaving.proc.send_signal(signal.SIGTERM)

        def health() -> httpx.Response | None:
            got = httpx.get(leaving.url + "/health", timeout=30)
            return got if got.status_code == 503 else None

        assert wait_for("the replica drains", health).json()["error"]["code"] == "draining"

        def backends() -> dict | None:  # once the router's next health round has seen it
            b = {x["url"]: x for x in httpx.get(router.url + "/router/state").json()["backends"]}
            return b if b[leaving.url]["draining"] else None

        assert not wait_for("the router sees the drain", backends)[staying.url]["draining"]
        before = routed(router, staying.url)
        c = client(router)
        for i in range(3):
            out = c.completions.create(model=MODEL, prompt=f"New request {i}", max_tokens=1)
            assert out.choices[0].text is not None
        assert routed(router, staying.url) == before + 3
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert any('"finish_reason":"length"' in line for line in rest)  # all 150 tokens: not cut short
    assert leaving.proc.wait(120) == 0
