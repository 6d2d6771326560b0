"""The API as lenient as vLLM where vLLM is (issue 36 item 5), through the official openai client (raw httpx
where the client cannot say it): unknown fields ignored, truncate_prompt_tokens, prompt scoring with echo and
max_tokens 0, content parts refused in plain words, max_tokens past the context a 400, tool_choice "required"
the same whole and streamed, and no empty deltas in a stream. The strict side (--strict-api) is in
test_errors.py."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

CONTEXT = 1024  # conftest's SMALL
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]


def tokenize(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_unknown_fields_are_ignored_and_logged(server, client, model) -> None:
    out = client.completions.create(
        model=model, prompt="Hello", max_tokens=2, temperature=0,
        stream_options=None,
        extra_body={"some_future_field": {"x": 1}, "response_format": {"type": "text", "strictness": 3}},
    )  # fmt: skip
    assert out.usage.completion_tokens == 2
    chat = client.chat.completions.create(
        model=model, max_tokens=2, temperature=0, stream=True,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}]}],
        stream_options={"include_usage": True, "bogus": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"modalities": ["text"], "verbosity": "low"},
    )  # fmt: skip
    assert list(chat)[-1].usage.completion_tokens == 2
    assert "some_future_field" in server.log() and "stream_options.bogus" in server.log()


def test_fields_vllm_honours_and_pagoda_cannot_stay_400(client, model) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"bad_words": ["x"]})
    assert exc.value.body["param"] == "bad_words" and exc.value.body["code"] == "unsupported_field"


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, client, model) -> None:
    text = "one two three four five six seven eight nine ten eleven twelve"
    ids = tokenize(server, text)
    assert len(ids) > 6
    out = client.completions.create(
        model=model, prompt=text, max_tokens=0, echo=True, extra_body={"truncate_prompt_tokens": 4}
    )
    assert out.usage.prompt_tokens == 4
    kept = httpx.post(server.url + "/detokenize", json={"tokens": ids[-4:]}, timeout=60).json()["prompt"]
    assert out.choices[0].text == kept and text.endswith(kept)
    # token ids longer than the context: -1 keeps the last max_model_len - which leaves no room: a 400
    # about the context, not about the field; a smaller N fits
    long_ids = (ids * (CONTEXT // len(ids) + 2))[: CONTEXT + 40]
    out = client.completions.create(
        model=model, prompt=long_ids, max_tokens=1, extra_body={"truncate_prompt_tokens": 100}
    )
    assert out.usage.prompt_tokens == 100
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(
            model=model, prompt=long_ids, max_tokens=1, extra_body={"truncate_prompt_tokens": -1}
        )
    assert exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(
            model=model, prompt="Hi", max_tokens=1, extra_body={"truncate_prompt_tokens": CONTEXT + 1}
        )
    assert exc.value.body["param"] == "truncate_prompt_tokens"
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "the " * 2000}], max_tokens=1,
        extra_body={"truncate_prompt_tokens": 50},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 50


def test_prompt_scoring_echo_max_tokens_0(server, client, model) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt, its token logprobs, nothing generated."""
    prompt = "The capital of France is Paris"
    ids = tokenize(server, prompt)
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = out.choices[0]
    assert choice.text == prompt
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(isinstance(t, dict) and len(t) >= 1 for t in lp.top_logprobs[1:])
    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    streamed = [
        x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-3)
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as exc:  # 0 without echo would say nothing
        client.completions.create(model=model, prompt=prompt, max_tokens=0)
    assert exc.value.body["param"] == "max_tokens"


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ],
)
def test_content_parts_the_model_cannot_take_are_a_plain_400(client, model, part) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    body = exc.value.body
    assert "takes text only" in body["message"] and part["type"] in body["message"]
    assert body["param"] == "messages[0].content[1]" and body["code"] == "unsupported_content"
    assert "validation" not in body["message"].lower() and "union" not in body["message"].lower()


def test_max_tokens_past_the_context_is_a_400(client, model) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt="Hi", max_tokens=10**7)
    body = exc.value.body
    assert body["param"] == "max_tokens" and body["code"] == "context_length_exceeded"
    assert f"maximum context length is {CONTEXT} tokens" in body["message"] and str(10**7) in body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=ASK, max_completion_tokens=CONTEXT)
    assert exc.value.body["param"] == "max_completion_tokens"
    # leaving it out still means "all that fits"
    out = client.completions.create(model=model, prompt="Hi", max_tokens=CONTEXT - 10, stop=["\n"])
    assert out.choices[0].finish_reason in ("stop", "length")


def _streamed_calls(chunks) -> list[tuple[str | None, str]]:
    calls: dict[int, list] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(d.index, [None, ""])
            if d.function.name:
                call[0] = d.function.name
            call[1] += d.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("max_tokens", [12, 64])
def test_tool_choice_required_same_whole_and_streamed(client, model, max_tokens) -> None:
    """12 tokens cut the call short: the whole answer used to put the raw JSON in content with no calls,
    where the stream had sent the call."""
    kwargs = dict(model=model, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0)
    whole = client.chat.completions.create(**kwargs, max_tokens=max_tokens)
    chunks = list(client.chat.completions.create(**kwargs, max_tokens=max_tokens, stream=True))
    message = whole.choices[0].message
    assert message.tool_calls, message
    assert message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == _streamed_calls(chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    if max_tokens == 64:
        assert whole.choices[0].finish_reason == "tool_calls"


def test_streams_send_no_empty_deltas(server, model) -> None:
    """A tool-call stream used to send a `{"delta": {}}` chunk for every token the parser held back."""
    body = {
        "model": model, "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "temperature": 0,
        "max_tokens": 64, "stream": True, "logprobs": True,
    }  # fmt: skip
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    tokens = 0
    for e in events:
        for choice in e["choices"]:
            assert choice["delta"] or choice["finish_reason"], e
            tokens += len((choice.get("logprobs") or {}).get("content") or [])
    whole = httpx.post(
        server.base_url + "/chat/completions", json={**body, "stream": False}, timeout=300
    ).json()
    assert tokens == whole["usage"]["completion_tokens"]  # held deltas' logprobs ride on the next chunk
