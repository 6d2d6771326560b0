"""Attention sinks through the real server and the official client: opt-in per request in the extra body,
past max-model-len; bad sizes, a max_tokens past --kv-eviction-max-tokens and an opt-in the server forbids
(--no-kv-eviction-per-request) are a 400 naming the field."""

from __future__ import annotations

import openai
import pytest

CONTEXT = 64


@pytest.fixture(scope="module")
def client(start_pagoda) -> openai.OpenAI:
    srv = start_pagoda(
        "--max-model-len", str(CONTEXT), "--kv-sink-tokens", "16", "--kv-eviction-max-tokens", "200"
    )
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", timeout=300, max_retries=0)


def test_streaming_request_generates_past_max_model_len(client):
    out = client.completions.create(
        model=client.models.list().data[0].id,
        prompt="Once upon a time",
        max_tokens=3 * CONTEXT,
        temperature=0.8,
        seed=3,
        extra_body={"kv_eviction": "streaming", "ignore_eos": True},
    )
    assert out.usage.completion_tokens == 3 * CONTEXT
    assert out.choices[0].finish_reason == "length"
    plain = client.completions.create(  # without the opt-in: all that fits (more is a 400, as in vLLM)
        model=out.model, prompt="Once upon a time", max_tokens=None, extra_body={"ignore_eos": True}
    )
    assert plain.usage.prompt_tokens + plain.usage.completion_tokens == CONTEXT


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"kv_eviction": "streaming", "kv_window_tokens": 8}, "kv_window_tokens"),
        ({"kv_eviction": "streaming", "kv_window_tokens": 60}, "kv_window_tokens"),
        ({"kv_eviction": "sliding"}, "kv_eviction"),
        ({"kv_eviction": "streaming", "kv_sink_tokens": -1}, "kv_sink_tokens"),
    ],
)
def test_bad_sink_sizes_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(
            model=client.models.list().data[0].id, prompt="hi", max_tokens=4, extra_body=extra
        )
    assert exc.value.status_code == 400
    assert param in str(exc.value)


def test_max_tokens_past_the_servers_cap_is_400(client):
    model = client.models.list().data[0].id
    streaming = {"kv_eviction": "streaming"}
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt="hi", max_tokens=201, extra_body=streaming)
    assert exc.value.body["param"] == "max_tokens" and "at most 200" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:  # the chat API's name for it
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2**62,
            extra_body=streaming,
        )  # fmt: skip
    assert exc.value.body["param"] == "max_completion_tokens"
    # without streaming, max_tokens past the context is a 400 (as in vLLM); left out, it is all that fits
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt="hi", max_tokens=2**62)
    assert exc.value.body["param"] == "max_tokens" and exc.value.body["code"] == "context_length_exceeded"
    plain = client.completions.create(
        model=model, prompt="hi", max_tokens=None, extra_body={"ignore_eos": True}
    )
    assert plain.usage.prompt_tokens + plain.usage.completion_tokens == CONTEXT


def test_a_server_can_forbid_the_per_request_opt_in(start_pagoda):
    srv = start_pagoda("--max-model-len", str(CONTEXT), "--no-kv-eviction-per-request")
    c = openai.OpenAI(base_url=srv.base_url, api_key="unused", timeout=300, max_retries=0)
    model = c.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=model, prompt="hi", max_tokens=4, extra_body={"kv_eviction": "streaming"})
    assert (
        exc.value.body["param"] == "kv_eviction"
        and "--no-kv-eviction-per-request" in exc.value.body["message"]
    )
    out = c.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"kv_eviction": "none"})
    assert out.usage.completion_tokens == 2  # opting out stays allowed, and the server keeps serving
