"""The official openai client against a real `pagoda serve` process."""

from __future__ import annotations

import httpx
import pytest

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def tokens(server, **body) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_models_health_version(server, client, model) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_chat_capital_of_france_at_temperature_0(server, client, model) -> None:
    r = client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=12)
    text = r.choices[0].message.content
    assert "Paris" in text, text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(tokens(server, messages=FRANCE))
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream_and_reports_usage(client, model) -> None:
    kwargs = dict(model=model, messages=FRANCE, temperature=0, max_tokens=8)
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_sse_ends_with_done(server, model) -> None:
    body = {"model": model, "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_completion_usage_and_logprobs(server, client, model) -> None:
    prompt = "The capital of Germany is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    choice = r.choices[0]
    assert r.usage.prompt_tokens == len(tokens(server, prompt=prompt))
    assert r.usage.completion_tokens == len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
    assert "".join(choice.logprobs.tokens) == choice.text
    for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True):
        assert lp <= 0
        assert 1 <= len(top) <= 2
        # at temperature 0 the chosen token is the most likely one
        assert lp == pytest.approx(max(top.values()), abs=1e-4)
    assert choice.logprobs.text_offset[0] == 0


def test_chat_logprobs(client, model) -> None:
    r = client.chat.completions.create(
        model=model, messages=FRANCE, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert bytes(t.bytes).decode() == t.token


def test_n2_gives_two_choices_non_stream_and_stream(client, model) -> None:
    r = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=4, n=2, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model=model, messages=FRANCE, max_tokens=4, n=2, temperature=1.0, seed=7, stream=True
    )
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    assert all(texts.values())


def test_stop_string_cuts_the_output(client, model) -> None:
    base = client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=12)
    text = base.choices[0].message.content
    assert "Paris" in text
    r = client.chat.completions.create(
        model=model, messages=FRANCE, temperature=0, max_tokens=12, stop=["Paris"]
    )
    assert r.choices[0].message.content == text[: text.index("Paris")]
    assert r.choices[0].finish_reason == "stop"


def test_seed_reproducibility(client, model) -> None:
    kwargs = dict(model=model, prompt="My favourite animal is", max_tokens=6, temperature=1.0, top_p=0.95)
    a = client.completions.create(**kwargs, seed=1234).choices[0].text
    b = client.completions.create(**kwargs, seed=1234).choices[0].text
    assert a == b


def test_prompt_forms_token_ids_lists_and_echo(server, client, model) -> None:
    ids = tokens(server, prompt="The sky is")
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0)
    by_text = client.completions.create(model=model, prompt="The sky is", max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    two = client.completions.create(
        model=model, prompt=["The sky is", "Water is"], max_tokens=2, temperature=0
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.choices[0].text == by_text.choices[0].text[: len(two.choices[0].text)]
    echo = client.completions.create(model=model, prompt="The sky is", max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text == "The sky is" + by_text.choices[0].text


def test_tokenize_detokenize_and_reset_prefix_cache(server) -> None:
    ids = tokens(server, prompt="Hello world")
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"] == "Hello world"
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=60).status_code == 200
