"""Every error case: status code and OpenAI error body; then SIGTERM drains in-flight requests and exits 0.

One server for the module, configured so each limit is easy to hit: an API key, a served-model name, a
128-token context, one running sequence with at most 2 waiting, and a 64 KiB body limit.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import time

import httpx
import pytest
from pagoda_testkit.processes import spawned_children

KEY = "test-secret-key"
MODEL = "pagoda-test"
CONTEXT = 128
VOCAB = 49152  # the default model's vocabulary


@pytest.fixture(scope="module")
def srv(start_pagoda):
    server = start_pagoda(
        "--served-model-name", MODEL,
        "--max-model-len", str(CONTEXT),
        "--max-num-seqs", "1",
        "--max-num-queued-reqs", "2",
        "--max-request-body-bytes", "64KiB",
        "--strict-api",  # unknown fields are a 400 (the default logs and ignores them, test_vllm_leniency.py)
        api_key=KEY,
    )  # fmt: skip
    yield server
    server.stop()


def post(srv, path: str, body, *, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (bytes, str)):
        return httpx.post(
            srv.url + path,
            content=body,
            headers={**headers, "content-type": "application/json"},
            timeout=300,
            **kw,
        )
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=300, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = "any", *, contains: str = "") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param != "any":
        assert err["param"] == param, err
    assert contains in err["message"], err
    return err


def the_id(srv) -> int:
    r = post(srv, "/tokenize", {"prompt": " the", "add_special_tokens": False})
    return r.json()["tokens"][0]


# ---------------------------------------------------------------- 401


def test_401_without_or_with_a_wrong_key_and_open_health_metrics(srv) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    err = assert_error(post(srv, "/v1/completions", body, key=None), 401)
    assert err["code"] == "invalid_api_key"
    assert_error(post(srv, "/v1/completions", body, key="wrong-key"), 401)
    assert_error(post(srv, "/v1/chat/completions", body, key=KEY[:-1]), 401)
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/metrics").status_code == 200
    memory = httpx.get(srv.url + "/pagoda/memory")  # the operator reads it through the pod proxy, keyless
    assert memory.status_code == 200 and memory.json()["weights_bytes"] > 0
    ok = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL


def test_openai_client_sees_authentication_error(srv) -> None:
    import openai

    client = openai.OpenAI(base_url=srv.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


# ---------------------------------------------------------------- 404


def test_404_unknown_model(srv) -> None:
    err = assert_error(post(srv, "/v1/completions", {"model": "gpt-4", "prompt": "Hi"}), 404, "model")
    assert err["code"] == "model_not_found" and MODEL in err["message"]
    assert_error(
        post(srv, "/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "Hi"}]}),
        404,
        "model",
    )


# ---------------------------------------------------------------- 400


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0), ("presence_penalty", 3),
     ("logprobs", 99), ("min_p", 2), ("stop_token_ids", [-1]), ("seed", 2**70), ("top_k", -5)],
)  # fmt: skip
def test_400_invalid_field_is_named(srv, field, value) -> None:
    err = assert_error(post(srv, "/v1/completions", {"model": MODEL, "prompt": "Hi", field: value}), 400)
    assert err["param"] is not None and err["param"].split("[")[0] == field
    assert field in err["message"]


def test_400_semantic_errors_name_the_field(srv) -> None:
    assert_error(
        post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "min_tokens": 5}), 400, "min_tokens"
    )
    assert_error(post(srv, "/v1/completions", {"prompt": "Hi", "stop": [""]}), 400, "stop")
    assert_error(post(srv, "/v1/completions", {"prompt": [10**8]}), 400, "prompt")
    assert_error(post(srv, "/v1/completions", {"prompt": ""}), 400, "prompt")
    assert_error(post(srv, "/v1/completions", {"prompt": "Hi", "n": 2, "best_of": 1}), 400, "best_of")
    assert_error(post(srv, "/v1/completions", {"prompt": "Hi", "logit_bias": {"x": 1}}), 400, "logit_bias")
    assert_error(
        post(srv, "/v1/completions", {"prompt": "Hi", "logit_bias": {"10000000": 1}}), 400, "logit_bias"
    )
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    assert_error(post(srv, "/v1/chat/completions", {**chat, "top_logprobs": 2}), 400, "top_logprobs")
    assert_error(post(srv, "/v1/chat/completions", {"messages": []}), 400, "messages")
    assert_error(post(srv, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert_error(
        post(srv, "/v1/chat/completions", {**chat, "tools": [{"type": "function"}]}), 400, "tools[0].function"
    )
    assert_error(post(srv, "/v1/chat/completions", {**chat, "tool_choice": "required"}), 400, "tool_choice")


def test_400_unknown_field_missing_field_and_bad_json(srv) -> None:
    err = assert_error(post(srv, "/v1/completions", {"prompt": "Hi", "temprature": 0.5}), 400, "temprature")
    assert err["code"] == "unknown_field"
    assert_error(post(srv, "/v1/completions", {"max_tokens": 3}), 400, "prompt")
    assert_error(post(srv, "/v1/completions", b'{"prompt": "Hi",'), 400)
    assert_error(post(srv, "/v1/completions", b"[1, 2]"), 400)


def test_400_prompt_over_the_context(srv) -> None:
    tid = the_id(srv)
    err = assert_error(
        post(srv, "/v1/completions", {"prompt": [tid] * 200}),
        400,
        "prompt",
        contains=f"maximum context length is {CONTEXT} tokens; the prompt has 200",
    )
    assert err["code"] == "context_length_exceeded"
    long_chat = {"messages": [{"role": "user", "content": "the " * 300}]}
    assert_error(
        post(srv, "/v1/chat/completions", long_chat),
        400,
        "messages",
        contains=f"maximum context length is {CONTEXT} tokens",
    )


def test_max_tokens_beyond_the_context_is_400(srv) -> None:
    """As in vLLM (it used to be cut to the room left); left out, max_tokens is all that fits."""
    tid = the_id(srv)
    body = {"prompt": [tid] * (CONTEXT - 3), "ignore_eos": True}
    err = assert_error(
        post(srv, "/v1/completions", {**body, "max_tokens": 10_000}),
        400,
        "max_tokens",
        contains=f"maximum context length is {CONTEXT} tokens and the prompt takes {CONTEXT - 3}",
    )
    assert err["code"] == "context_length_exceeded"
    r = post(srv, "/v1/completions", {**body, "max_tokens": None})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "field", "bad"),
    [
        ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [VOCAB], "min_tokens": 1}, "stop_token_ids", VOCAB),
        ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [5, 2**31 - 1], "min_tokens": 2}, "stop_token_ids", 2**31 - 1),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stop_token_ids": [VOCAB + 7], "min_tokens": 1}, "stop_token_ids", VOCAB + 7),
        ("/v1/completions", {"prompt": [1, 2, VOCAB]}, "prompt", VOCAB),
        ("/v1/completions", {"prompt": [[1, 2], [3, 2**31 - 1]]}, "prompt", 2**31 - 1),
    ],
)  # fmt: skip
def test_token_ids_outside_the_vocabulary_are_400_naming_the_field(srv, path, body, field, bad) -> None:
    """One such request used to index past the logits inside the step and fail every request in flight."""
    err = assert_error(post(srv, path, {"max_tokens": 2, **body}), 400, field)
    assert str(bad) in err["message"] and "vocabulary" in err["message"]
    assert httpx.get(srv.url + "/health").status_code == 200
    assert srv.metric("pagoda:engine_step_failures_total") == 0


def raw_exchange(srv, head: str, chunks: list[bytes] = (), timeout: float = 10.0) -> bytes:
    """Send a request head (and body chunks) on a bare socket; return the whole answer (head and body).
    Raises TimeoutError if no complete answer comes within `timeout`."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode())
        for chunk in chunks:
            sock.sendall(chunk)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < _length(answer):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
        return answer


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


# ---------------------------------------------------------------- 413 and the order of the guards


def test_401_is_decided_before_any_body_byte_is_read(srv) -> None:
    """A client without the key announces a body and sends none: the 401 must not wait for it."""
    head = "POST /v1/completions HTTP/1.1\nHost: pagoda\nContent-Type: application/json\nContent-Length: 1000\n\n"
    answer = raw_exchange(srv, head)  # times out if the server waits for the 1000 bytes
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b"invalid_api_key" in answer


def test_413_counts_a_chunked_body_as_it_arrives(srv) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\nHost: pagoda\nContent-Type: application/json\n"
        f"Authorization: Bearer {KEY}\nTransfer-Encoding: chunked\n\n"
    )
    piece = b"x" * (16 * 1024)
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * 4 + [b"400\r\n" + b"x" * 1024 + b"\r\n"]
    answer = raw_exchange(srv, head, chunks)  # 65 KiB sent, no final chunk: the limit is passed mid-body
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer


def test_413_body_over_the_limit(srv) -> None:
    big = {"model": MODEL, "prompt": "word " * 20_000}
    err = assert_error(post(srv, "/v1/completions", big), 413)
    assert err["code"] == "request_too_large"
    # Without the key the answer is 401, whatever the body: the key is checked first.
    assert_error(post(srv, "/v1/completions", big, key=None), 401)


# ---------------------------------------------------------------- 503


def test_503_with_retry_after_when_the_queue_is_full(srv) -> None:
    tid = the_id(srv)
    body = {"prompt": [tid] * 8, "max_tokens": 6, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(lambda _: post(srv, "/v1/completions", body), range(10)))
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 503 in codes, codes
    assert set(codes) <= {200, 503}
    rejected = [r for r in responses if r.status_code == 503]
    for r in rejected:
        err = assert_error(r, 503)
        assert err["code"] == "queue_full"
        assert int(r.headers["Retry-After"]) >= 1
    assert srv.metric("pagoda:admission_rejections_total", reason="queue_full") >= len(rejected)
    srv.wait_idle()


# ---------------------------------------------------------------- SIGTERM (last: it stops the server)


def test_sigterm_drains_in_flight_requests_then_exits_0(srv) -> None:
    """SIGTERM to the whole process group (a terminal's Ctrl-C, a supervisor's kill): the engine core process
    ignores it and keeps running the in-flight request until the server has drained, then both exit."""
    (core,) = spawned_children(srv.proc.pid)
    tid = the_id(srv)
    body = {"prompt": [tid] * 4, "max_tokens": 8, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    with httpx.stream(
        "POST", srv.base_url + "/completions", json=body, headers=srv.headers(), timeout=300
    ) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        for line in it:
            if line:
                lines.append(line)
                break  # the request is running: now ask the server to stop
        os.killpg(srv.proc.pid, signal.SIGTERM)  # started in a session of its own: the group is its pid
        time.sleep(1.0)
        try:  # draining (docs/router.md): /health says 503 "draining" until no request runs, then it closes
            health = httpx.get(srv.url + "/health", timeout=5)
            assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
        except httpx.ConnectError:
            pass  # the request had already finished: drained and closed
        lines += [line for line in it if line]
    assert lines[-1] == "data: [DONE]"
    assert any('"finish_reason":"length"' in line for line in lines), lines[-3:]
    assert srv.proc.wait(120) == 0, srv.log()
    assert not os.path.exists(f"/proc/{core}"), "the engine core process outlived the server"
