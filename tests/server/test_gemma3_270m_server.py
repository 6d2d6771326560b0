"""`pagoda serve --model FILE.gguf` on the real Gemma 3 270M, through the official openai client: the chat
answer at temperature 0 is transformers' greedy answer on the same file, and a turn ends at Gemma's
<end_of_turn> (id 106, not the file's <eos>) with finish_reason "stop".

The packaged Gemma 3 270M is the pretrained model, not the instruction-tuned one: it answers a chat turn but
does not close it on its own, so the stop is reached by biasing <end_of_turn> (logit_bias) once min_tokens
lets stop ids through; were it not a stop id, the biased token would repeat until max_tokens ("length")."""

from __future__ import annotations

import pytest
from pagoda.engine.loader import load_tokenizer, resolve_model
from pagoda.engine.loader.resolve import gemma3_270m_gguf
from pagoda_testkit.gemma3_reference import FRANCE, PROMPTS, gemma3_reference

END_OF_TURN = 106


@pytest.fixture(scope="module")
def gguf():
    return gemma3_270m_gguf()


@pytest.fixture(scope="module")
def gemma(start_pagoda, gguf):
    import openai

    server = start_pagoda("--model", str(gguf))
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=300, max_retries=0)
    return client, client.models.list().data[0].id


@pytest.fixture(scope="module")
def france_reference(gguf) -> dict:
    """transformers' prompt ids and greedy tokens of the rendered FRANCE chat prompt."""
    return gemma3_reference(gguf)[len(PROMPTS) - 1]


def test_chat_answer_is_transformers_greedy_answer(gemma, gguf, france_reference):
    client, model = gemma
    r = client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=12)
    choice = r.choices[0]
    tok = load_tokenizer(resolve_model(gguf))
    assert choice.message.content and choice.message.content == tok.decode(france_reference["tokens"][:12])
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(france_reference["prompt_ids"])


@pytest.mark.parametrize("streamed", [False, True])
def test_turn_ends_at_end_of_turn(gemma, gguf, france_reference, streamed):
    client, model = gemma
    kwargs = dict(
        model=model,
        messages=FRANCE,
        temperature=0,
        max_tokens=16,
        logit_bias={str(END_OF_TURN): 100},
        extra_body={"min_tokens": 5},
    )
    tok = load_tokenizer(resolve_model(gguf))
    expected = tok.decode(
        france_reference["tokens"][:5]
    )  # min_tokens held the stop ids back: the greedy answer
    if streamed:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert text == expected and finish == ["stop"]
        return
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].message.content == expected and "<end_of_turn>" not in expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 6  # five answer tokens and <end_of_turn>, as vLLM counts a stop id
    # The same request ignoring stop ids runs to max_tokens: the stop above was the stop-id rule's.
    kwargs["extra_body"] = {"min_tokens": 5, "ignore_eos": True}
    again = client.chat.completions.create(**kwargs)
    assert again.choices[0].finish_reason == "length" and again.usage.completion_tokens == 16
