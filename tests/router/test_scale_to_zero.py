"""Scale to zero at the router: with no replica up, requests are held (and counted in
`pagoda:router_held_requests`, which KEDA scales on) until a replica appears, then served by it; without one
they end after --hold-seconds with 503 and Retry-After. Real `pagoda router` and `pagoda serve` processes;
nothing asserts how long anything took."""

from __future__ import annotations

import json
import threading
import time

import httpx

CHAT = {
    "model": "SmolLM2-135M-Instruct",
    "messages": [{"role": "user", "content": "Say hi"}],
    "max_tokens": 4,
    "temperature": 0,
}


def wait_metric(router, name: str, value: float, timeout: float = 60, **labels: str) -> None:
    deadline = time.monotonic() + timeout
    while router.metric(name, **labels) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}: {router.log()}"
        time.sleep(0.1)


def test_requests_wait_for_a_replica_that_appears_later(kit, tmp_path) -> None:
    port = kit.free_port()
    router = kit.start_router(tmp_path, [f"http://127.0.0.1:{port}"], *kit.FAST, "--hold-seconds", "600")
    replica = None
    try:
        health = httpx.get(
            router.url + "/health"
        )  # in the Service with no replica: it takes the wake-up calls
        assert health.status_code == 200 and health.json() == {"status": "holding", "held": 0}
        answers: list[httpx.Response] = []
        threads = [
            threading.Thread(target=lambda: answers.append(httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=600))),
            threading.Thread(target=lambda: answers.append(httpx.get(router.url + "/v1/models", timeout=600))),
        ]  # fmt: skip
        for t in threads:
            t.start()
        wait_metric(router, "pagoda:router_held_requests", 2)  # both wait; nothing has answered
        assert answers == []
        replica = kit.wait_healthy(kit.start_replica(tmp_path, port=port))  # the replica appears
        for t in threads:
            t.join(600)
        models, chat = sorted(answers, key=lambda r: r.request.method)  # GET, POST
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
        assert models.status_code == 200 and models.json()["data"][0]["id"] == CHAT["model"]
        assert router.metric("pagoda:router_held_requests") == 0
        assert router.metric("pagoda:router_held_total", outcome="served") == 2
        assert replica.metric("vllm:request_success_total") == 1
    finally:
        router.stop()
        if replica is not None:
            replica.stop()


def test_without_a_replica_the_hold_ends_in_503_with_retry_after(kit, tmp_path) -> None:
    router = kit.start_router(
        tmp_path, [f"http://127.0.0.1:{kit.free_port()}"], *kit.FAST, "--hold-seconds", "1"
    )
    try:
        answer = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "30"
        assert answer.json()["error"]["code"] == "no_backend"
        assert router.metric("pagoda:router_held_total", outcome="timeout") == 1
        assert router.metric("pagoda:router_held_requests") == 0
    finally:
        router.stop()


def _start_unready_router(kit, tmp_path, *extra: str):
    """A router whose one replica never comes (its /health is 503 without a hold: wait on /livez)."""
    port = kit.free_port()
    argv = [kit.PAGODA, "router", "--host", "127.0.0.1", "--port", str(port), "--backend",
            f"http://127.0.0.1:{kit.free_port()}", *kit.FAST, *extra]  # fmt: skip
    router = kit.start(tmp_path, argv, port, "router")
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(router.url + "/livez").status_code == 200:
                return router
        except httpx.ConnectError:
            pass
        assert time.monotonic() < deadline and router.proc.poll() is None, router.log()
        time.sleep(0.1)


def test_without_hold_seconds_an_outage_is_a_503_with_retry_after_at_once(kit, tmp_path) -> None:
    """The default (a deployment that cannot scale to zero): no hold. A request that finds no routable replica
    gets 503 + Retry-After at once, /health is 503, and /livez (the router pod's probes) stays 200."""
    router = _start_unready_router(kit, tmp_path)
    try:
        health = httpx.get(router.url + "/health")
        assert health.status_code == 503
        assert httpx.get(router.url + "/livez").json() == {"status": "ok", "routable": 0}
        for answer in (
            httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=10),
            httpx.get(router.url + "/v1/models", timeout=10),
        ):
            assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"  # a health round
            assert answer.json()["error"]["code"] == "no_backend"
        assert router.metric("pagoda:router_held_total") == 0
        assert router.metric("pagoda:router_requests_total", code="503") == 1  # the completion
    finally:
        router.stop()


def test_the_hold_is_capped_by_requests_and_bytes(kit, tmp_path) -> None:
    """With --hold-seconds, at most --hold-max-requests requests and --hold-max-bytes of their bodies wait;
    a request past either cap gets 503 + Retry-After at once (hold_full), the held ones are served when a
    replica comes."""
    import sys
    from pathlib import Path

    port = kit.free_port()
    router = kit.start_router(tmp_path, [f"http://127.0.0.1:{port}"], *kit.FAST, "--hold-seconds", "600",
                              "--hold-max-requests", "2", "--hold-max-bytes", "100KiB")  # fmt: skip
    replica = None
    answers: list[httpx.Response] = []
    small = json.dumps(CHAT).encode()  # the bytes a held request costs
    post = {"content": small, "headers": {"Content-Type": "application/json"}, "timeout": 600}
    threads = [
        threading.Thread(
            target=lambda: answers.append(httpx.post(router.url + "/v1/chat/completions", **post))
        )
        for _ in range(2)
    ]  # fmt: skip
    try:
        size = len(small)
        threads[0].start()
        wait_metric(router, "pagoda:router_held_requests", 1)
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * (100 << 10)}]}
        full = httpx.post(router.url + "/v1/chat/completions", json=big, timeout=10)  # past the bytes
        assert full.status_code == 503 and full.headers["Retry-After"] == "30"
        assert full.json()["error"]["code"] == "hold_full" and "--hold-max-bytes 102400" in full.text
        threads[1].start()
        wait_metric(router, "pagoda:router_held_requests", 2)
        assert router.metric("pagoda:router_held_bytes") == 2 * size
        full = httpx.get(router.url + "/v1/models", timeout=10)  # past the requests
        assert full.status_code == 503 and full.headers["Retry-After"] == "30"
        assert full.json()["error"]["code"] == "hold_full" and "holds 2 requests" in full.text
        assert router.metric("pagoda:router_held_total", outcome="full") == 2
        assert answers == []
        fake = str(Path(__file__).with_name("fake_replica.py"))
        argv = [sys.executable, fake, str(port), "ok", str(tmp_path / "ok.requests")]
        replica = kit.wait_healthy(kit.start(tmp_path, argv, port, "fake-ok"), 30)  # the replica appears
        for t in threads:
            t.join(60)
        assert [a.status_code for a in answers] == [200, 200]
        assert len((tmp_path / "ok.requests").read_text().splitlines()) == 2  # the held two, no more
        assert router.metric("pagoda:router_held_total", outcome="served") == 2
        assert router.metric("pagoda:router_held_requests") == router.metric("pagoda:router_held_bytes") == 0
    finally:
        router.stop()
        if replica is not None:
            replica.stop()
