"""`pagoda router` under replica faults, with real processes (tests/router/fake_replica.py): one replica
killed mid-stream, one answering 503 + Retry-After, one slow. Every client sees a complete stream, an error
event or a 503 with Retry-After, never a truncated answer, and the router's counters add up to what was
sent. No assertion depends on how the clients' requests interleave or on how fast anything runs: the one
timeout tested is a replica that never speaks again, and the streams it must not cut pause for a twentieth
of it."""

from __future__ import annotations

import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(120)

FAKE = str(Path(__file__).with_name("fake_replica.py"))
WORDS = 30  # fake_replica.WORDS: a complete stream is w0 .. w29
CRASH_AFTER = 3  # fake_replica.CRASH_AFTER
CLIENTS = 24
MESSAGES = [{"role": "user", "content": "Count."}]
# The read-timeout test: 20x the slow replica's pauses, two thirds of its whole stream (30 x 0.1 s).
READ_TIMEOUT_S, SLOW_GAP_S = 2.0, 0.1


def fake(kit, log_dir: Path, mode: str, *extra: str):
    port = kit.free_port()
    argv = [sys.executable, FAKE, str(port), mode, str(log_dir / f"{mode}.requests"), *extra]
    return kit.wait_healthy(kit.start(log_dir, argv, port, f"fake-{mode}"), 30)


def received(log_dir: Path, mode: str) -> int:
    path = log_dir / f"{mode}.requests"
    return len(path.read_text().splitlines()) if path.exists() else 0


def router(kit, log_dir: Path, replicas, *extra: str):
    return kit.start_router(
        log_dir,
        [r.url for r in replicas],
        "--policy",
        "roundRobin",
        "--tokenizer",
        "backend",
        *extra,
    )


def stream_once(url: str) -> tuple[str, object]:
    """("complete", text) | ("error", (error body, text before it)) | (HTTP status, (error body,
    Retry-After)); a truncated stream raises."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    text, finish = "", None
    try:
        for ch in client.chat.completions.create(model="fake", messages=MESSAGES, stream=True):
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
    except openai.APIStatusError as exc:
        return str(exc.status_code), (exc.body, exc.response.headers.get("Retry-After"))
    except openai.APIConnectionError:
        raise  # a truncated stream: what the router must never let through
    except openai.APIError as exc:  # an `error` event in the stream
        return "error", (exc.body, text)
    assert finish == "stop", text
    return "complete", text


@pytest.fixture(scope="module")
def busy(tmp_path_factory, kit):
    log_dir = tmp_path_factory.mktemp("busy")
    p = fake(kit, log_dir, "busy")
    yield p, log_dir
    p.stop()


def test_faulty_replicas_never_cost_a_client_its_answer(busy, tmp_path_factory, kit):
    log_dir = tmp_path_factory.mktemp("faults")
    crash, slow = fake(kit, log_dir, "crash"), fake(kit, log_dir, "ok")
    b, busy_dir = busy
    before_busy = received(busy_dir, "busy")
    r = router(kit, log_dir, [crash, b, slow], "--max-retries", "2")
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            outcomes = list(pool.map(lambda _: stream_once(r.url), range(CLIENTS)))
        kinds = [k for k, _ in outcomes]
        assert set(kinds) <= {"complete", "error", "503"}, outcomes
        want = "".join(f"w{i} " for i in range(WORDS))
        assert all(text == want for k, text in outcomes if k == "complete")  # never cut short
        errors = [v[0] for k, v in outcomes if k == "error"]
        # the crashing replica's first stream had sent 3 chunks: that client cannot be served elsewhere
        assert errors and all(e["code"] == "upstream_disconnect" for e in errors), errors
        assert all(v[1] == "7" for k, v in outcomes if k == "503")  # the replicas' Retry-After
        assert crash.proc.wait(10) == -9  # it really died (SIGKILL), mid-stream

        def metric(name: str, **labels: str) -> float:
            return r.metric(f"pagoda:router_{name}_total", **labels)

        # each client counted once, by what it got
        assert metric("requests") == CLIENTS
        assert metric("requests", code="200") == kinds.count("complete") + kinds.count("error")
        assert metric("requests", code="503") == kinds.count("503")
        assert metric("stream_errors") == metric("stream_errors", backend=crash.url) == len(errors)
        # every attempt was either a client's first or a retry; the replicas' own logs agree
        assert metric("routed") == CLIENTS + metric("retries")
        busy_got = received(busy_dir, "busy") - before_busy
        assert busy_got > 0 and metric("routed", backend=b.url) == busy_got
        assert metric("retries", reason="unavailable") == busy_got  # every 503 was retried elsewhere
        assert metric("routed", backend=slow.url) == received(log_dir, "ok") == kinds.count("complete")
        assert metric("routed", backend=crash.url) >= received(log_dir, "crash") >= 1
    finally:
        r.stop()
        slow.stop()
        crash.stop()


def test_the_read_timeout_bounds_a_silence_not_a_whole_answer(tmp_path_factory, kit):
    """A stream that lasts longer than --read-timeout passes whole. A replica silent for --read-timeout
    mid-stream ends the client's stream with an error event after what it had sent; one silent before its
    first event gets the client a 504 (not retried: it may still be working on the request)."""
    log_dir = tmp_path_factory.mktemp("read-timeout")
    slow = fake(kit, log_dir, "ok", str(SLOW_GAP_S))
    hang, mute = fake(kit, log_dir, "hang"), fake(kit, log_dir, "mute")
    r = router(kit, log_dir, [slow, hang, mute], "--read-timeout", str(READ_TIMEOUT_S))
    try:
        assert WORDS * SLOW_GAP_S > READ_TIMEOUT_S  # a limit on the whole answer would cut the slow one
        with ThreadPoolExecutor(3) as pool:  # round robin, nothing retried: one each
            outcomes = dict(pool.map(lambda _: stream_once(r.url), range(3)))
        assert outcomes["complete"] == "".join(f"w{i} " for i in range(WORDS))
        body, text = outcomes["error"]
        assert body["code"] == "upstream_timeout" and body["type"] == "server_error"
        assert text == "".join(f"w{i} " for i in range(CRASH_AFTER))  # all it had sent, then the error
        assert outcomes["504"][0]["code"] == "upstream_timeout"
        assert r.metric("pagoda:router_stream_errors_total", backend=hang.url, reason="timeout") == 1
        assert r.metric("pagoda:router_stream_errors_total") == 1
        assert r.metric("pagoda:router_requests_total", code="200") == 2
        assert r.metric("pagoda:router_requests_total", code="504") == 1
        assert r.metric("pagoda:router_routed_total") == 3 and r.metric("pagoda:router_retries_total") == 0
    finally:
        r.stop()
        slow.stop()
        hang.stop(signal.SIGKILL)
        mute.stop(signal.SIGKILL)


def test_when_no_replica_can_take_it_the_client_gets_503_with_retry_after(busy, tmp_path_factory, kit):
    b, _ = busy
    r = router(kit, tmp_path_factory.mktemp("only-busy"), [b])
    try:
        kind, (body, retry_after) = stream_once(r.url)
        assert (kind, body["code"], retry_after) == ("503", "no_backend", "7")
        got = httpx.post(r.url + "/v1/chat/completions", json={"model": "fake", "messages": MESSAGES})
        assert got.status_code == 503 and got.headers["Retry-After"] == "7"
        assert got.json()["error"]["code"] == "no_backend"
        assert r.metric("pagoda:router_requests_total", code="503") == 2
    finally:
        r.stop()


def test_the_router_takes_any_body_the_engine_takes(tmp_path_factory, kit):
    """The engine's limit is 16 MiB: a 2 MiB body reaches the replica, a 17 MiB one gets the engine's 413."""
    log_dir = tmp_path_factory.mktemp("body")
    ok = fake(kit, log_dir, "ok")
    r = router(kit, log_dir, [ok])
    try:
        body = {"model": "fake", "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
        got = httpx.post(r.url + "/v1/chat/completions", json=body, timeout=30)
        assert got.status_code == 200 and got.json()["choices"][0]["finish_reason"] == "stop"
        assert received(log_dir, "ok") == 1
        body["messages"][0]["content"] = "x" * (17 << 20)
        got = httpx.post(r.url + "/v1/chat/completions", json=body, timeout=30)
        assert got.status_code == 413 and got.json()["error"]["code"] == "request_too_large"
        assert received(log_dir, "ok") == 1
        assert r.metric("pagoda:router_requests_total", code="413") == 1
    finally:
        r.stop()
        ok.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_query_of_death_ends_two_replicas_at_most_and_gets_502(tmp_path_factory, kit, stream):
    """Each replica dies (SIGKILL) of the request once it has read it, before any answer. The router sends it
    to one other replica and no third (it is not a refusal: the replica took it), and the client gets a 502
    saying so; the third replica never sees it and lives."""
    dirs = [tmp_path_factory.mktemp(f"death{i}") for i in range(3)]
    replicas = [fake(kit, d, "die") for d in dirs]
    r = router(kit, tmp_path_factory.mktemp("death-router"), replicas, "--max-retries", "2")
    try:
        got = httpx.post(
            r.url + "/v1/chat/completions",
            json={"model": "fake", "messages": MESSAGES, "stream": stream},
            timeout=60,
        )
        assert got.status_code == 502, got.text
        error = got.json()["error"]
        assert (error["code"], error["type"]) == ("upstream_failed", "server_error")
        assert error["message"].startswith("2 replicas failed while working on this request")
        # (requests read, exit status) of each replica: two read it and died of it, the third never saw it
        ends = [
            (received(d, "die"), p.proc.wait(10) if received(d, "die") else p.proc.poll())
            for p, d in zip(replicas, dirs, strict=True)
        ]
        assert sorted(ends, key=lambda e: e[0]) == [(0, None), (1, -9), (1, -9)]
        assert r.metric("pagoda:router_routed_total") == 2
        assert r.metric("pagoda:router_retries_total", reason="disconnect") == 1
        assert r.metric("pagoda:router_requests_total", code="502") == 1
    finally:
        r.stop()
        for p in replicas:
            p.stop(signal.SIGKILL)


def test_a_replica_that_died_of_a_request_is_followed_by_one_other(tmp_path_factory, kit):
    """One replica dies of the first request it reads; the request goes to the other, which answers: each
    of two clients gets its answer, the dead replica read one request and the live one answered both."""
    dying, alive = tmp_path_factory.mktemp("dying"), tmp_path_factory.mktemp("alive")
    die, ok = fake(kit, dying, "die"), fake(kit, alive, "ok")
    r = router(kit, tmp_path_factory.mktemp("follow-router"), [die, ok], "--max-retries", "2")
    try:
        for _ in range(2):
            got = httpx.post(r.url + "/v1/chat/completions", json={"model": "fake", "messages": MESSAGES},
                             timeout=60)  # fmt: skip
            assert got.status_code == 200 and got.json()["choices"][0]["finish_reason"] == "stop", got.text
        assert (received(dying, "die"), received(alive, "ok")) == (1, 2)
        assert die.proc.wait(10) == -9
        assert r.metric("pagoda:router_requests_total", code="200") == 2
        assert r.metric("pagoda:router_routed_total", backend=ok.url) == 2
    finally:
        r.stop()
        die.stop(signal.SIGKILL)
        ok.stop()
