"""Scale to zero at the router: with no replica up, requests are held (and counted in
`pagoda:router_held_requests`, which KEDA scales on) until a replica appears, then served by it; without one
they end after --hold-seconds with 503 and Retry-After. Real `pagoda router` and `pagoda serve` processes;
nothing asserts how long anything took."""

from __future__ import annotations

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


def test_hold_seconds_zero_keeps_the_old_answer(kit, tmp_path) -> None:
    """--hold-seconds 0: no wait, and /health is 503 while no replica is routable."""
    port = kit.free_port()
    argv = [kit.PAGODA, "router", "--host", "127.0.0.1", "--port", str(port), "--backend",
            f"http://127.0.0.1:{kit.free_port()}", "--hold-seconds", "0", *kit.FAST]  # fmt: skip
    router = kit.start(tmp_path, argv, port, "router")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(router.url + "/health")
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, router.log()
                time.sleep(0.1)
        assert health.status_code == 503
        answer = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_backend"
    finally:
        router.stop()
