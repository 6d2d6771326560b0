"""Attention sinks through the real server and the official client: opt-in per request in the extra body,
past max-model-len; bad sizes are a 400 naming the field."""

from __future__ import annotations

import openai
import pytest

CONTEXT = 64


@pytest.fixture(scope="module")
def client(start_pagoda) -> openai.OpenAI:
    srv = start_pagoda("--max-model-len", str(CONTEXT), "--kv-sink-tokens", "16")
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
    plain = client.completions.create(
        model=out.model, prompt="Once upon a time", max_tokens=3 * CONTEXT, extra_body={"ignore_eos": True}
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
