"""What applications ask of an OpenAI server, through the official `openai` client against `pagoda serve`
(default model): structured outputs, tool calling, prompt logprobs, logit_bias, hints, /v1/models/{id}."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=150)


def test_parse_with_a_pydantic_model(client, model) -> None:
    r = client.chat.completions.parse(
        model=model, messages=ASK, response_format=Person, max_tokens=40, temperature=0
    )
    assert r.choices[0].finish_reason == "stop"
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


def test_json_object_streamed_with_n2(client, model) -> None:
    stream = client.chat.completions.create(
        model=model, messages=ASK, response_format={"type": "json_object"}, max_tokens=48, n=2,
        temperature=1.0, seed=5, stream=True,
    )  # fmt: skip
    texts, finish = {0: "", 1: ""}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(finish) == {0, 1}
    for i, text in texts.items():
        if finish[i] == "stop":
            assert isinstance(json.loads(text), dict)


def test_vllm_fields_choice_regex_grammar_and_completions(client, model) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=8,
        temperature=1,
        seed=1,
        n=3,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert {c.message.content for c in r.choices} <= {"yes", "no"}
    r = client.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=12,
        temperature=0,
        extra_body={"guided_regex": "[A-Z][a-z]{2,5}"},
    )
    assert r.choices[0].message.content[0].isupper()
    r = client.completions.create(
        model=model, prompt="Numbers:", max_tokens=12, temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= [1-9] ("," [1-9])*'}},
    )  # fmt: skip
    text = r.choices[0].text
    assert text and all(part in "123456789" for part in text.split(","))
    r = client.completions.create(
        model=model,
        prompt="A person:",
        max_tokens=40,
        temperature=0,
        extra_body={"guided_json": Person.model_json_schema()},
    )
    Person.model_validate_json(r.choices[0].text)


def test_bad_schema_and_two_formats_are_400s(client, model) -> None:
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}},
    }
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ASK, response_format=bad, max_tokens=4)
    assert err.value.body["param"] == "response_format" and "strin" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model, messages=ASK, max_tokens=4, response_format={"type": "json_object"},
            extra_body={"guided_regex": "a+"},
        )  # fmt: skip
    assert err.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model, messages=ASK, max_tokens=4, extra_body={"guided_regex": "([a-z"}
        )


def test_logit_bias_bans_and_forces(client, model, server) -> None:
    prompt = "The capital of France is"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    (banned,) = httpx.post(
        server.url + "/tokenize", json={"prompt": first, "add_special_tokens": False}
    ).json()["tokens"]
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=3, temperature=0, logit_bias={str(banned): -100}, logprobs=0
    )
    assert r.choices[0].logprobs.tokens[0] != first
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=2, temperature=0, logit_bias={"42": 100}
    )
    forced = httpx.post(server.url + "/detokenize", json={"tokens": [42, 42]}).json()["prompt"]
    assert r.choices[0].text == forced


def test_echo_with_logprobs_and_prompt_logprobs(client, model, server) -> None:
    prompt = "The capital of France is"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert lp.text_offset[len(ids)] == len(prompt)
    for _ in range(2):  # the second time the prompt is in the prefix cache: same logprobs
        again = client.completions.create(
            model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
        )
        entries = again.choices[0].model_extra["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(ids)
        assert [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:], strict=True)] == pytest.approx(
            lp.token_logprobs[1 : len(ids)], abs=1e-4
        )
    chat = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    assert chat.model_extra["prompt_logprobs"][0] is None


def test_best_of_returns_the_most_likely_of_its_samples(client, model) -> None:
    """The same seed draws the same samples for n=3 and best_of=3: best_of keeps the one whose cumulative
    logprob is highest."""
    ask = {"model": model, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 1.0, "seed": 7}
    every = client.completions.create(n=3, logprobs=0, **ask).choices
    best = client.completions.create(n=1, best_of=3, **ask).choices
    assert len({c.text for c in every}) > 1
    assert [c.text for c in best] == [max(every, key=lambda c: sum(c.logprobs.token_logprobs)).text]


def test_hints_accepted_and_output_changing_unknowns_refused(client, model) -> None:
    r = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=2, temperature=0, reasoning_effort="low", prompt_cache_key="k",
        user="u", metadata={"a": "b"}, store=False, parallel_tool_calls=True, safety_identifier="s",
    )  # fmt: skip
    assert r.choices[0].message.content is not None
    # fields vLLM does not know either are ignored as it ignores them (logged); one it honours and Pagoda
    # cannot is refused
    for extra in ({"modalities": ["audio"]}, {"verbosity": "low"}):
        r = client.chat.completions.create(model=model, messages=ASK, max_tokens=2, extra_body=extra)
        assert r.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model, messages=ASK, max_tokens=2, extra_body={"chat_template": "{{ 1 }}"}
        )
    assert err.value.body["param"] == "chat_template" and err.value.body["code"] == "unsupported_field"


def test_model_by_id_and_continuous_usage(client, model) -> None:
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    stream = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    counts = [c.usage.completion_tokens for c in stream if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 4 and len(counts) >= 4


# A template that knows tools, with a variable of its own; no default system prompt (the model's has one).
TEMPLATE = """{%- if persona %}<|im_start|>system
You are {{ persona }}.<|im_end|>
{% endif -%}
{%- if tools %}<|im_start|>system
Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>
{% endif -%}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}{% for c in m.tool_calls or [] %}<call {{ c.function.name }}>{% endfor %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""


def test_chat_template_flag_and_template_kwargs(start_pagoda, tmp_path) -> None:
    """--chat-template replaces the model's template (tools go to it as it knows them), and
    chat_template_kwargs reach it; the prompt generated from is the one /tokenize renders."""
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    srv = start_pagoda("--chat-template", str(path), "--max-model-len", "256")
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused", timeout=300, max_retries=0)
    model = client.models.list().data[0].id

    def rendered(**body) -> tuple[int, str]:
        ids = httpx.post(srv.url + "/tokenize", json={"messages": ASK, **body}).json()["tokens"]
        return len(ids), httpx.post(srv.url + "/detokenize", json={"tokens": ids}).json()["prompt"]

    assert rendered()[1] == f"<|im_start|>user\n{ASK[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    kwargs = {"persona": "a pirate"}
    count, text = rendered(tools=[WEATHER, TIME], chat_template_kwargs=kwargs)
    assert text.startswith("<|im_start|>system\nYou are a pirate.<|im_end|>\n")
    assert "Tools: get_weather get_time" in text
    r = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=1,
        extra_body={"chat_template_kwargs": kwargs},
    )
    assert r.usage.prompt_tokens == count
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model, messages=ASK, max_tokens=1, extra_body={"chat_template_kwargs": {"tools": []}}
        )
    assert err.value.body["param"] == "chat_template_kwargs"


def test_tool_call_round_trip(client, model, server) -> None:
    """call (required: the arguments always validate) -> tool result -> final answer; the history's call and
    result are in the rendered prompt."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model=model, messages=ask, tools=[WEATHER, TIME], tool_choice="required", max_tokens=64, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    history = [
        *ask,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 22 C"},
    ]
    final = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER, TIME], max_tokens=24, temperature=0
    )
    assert final.choices[0].message.content
    ids = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": [WEATHER, TIME]}).json()[
        "tokens"
    ]
    rendered = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert (
        f'"name": "{call.function.name}", "arguments": {json.dumps(json.loads(call.function.arguments))}'
        in rendered
    )
    assert "Sunny, 22 C" in rendered and call.function.name in rendered and '"get_time"' in rendered


def test_named_tool_choice_streams_partial_arguments(client, model) -> None:
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0, stream=True,
    )  # fmt: skip
    pieces, names, finish = [], [], None
    for chunk in stream:
        for c in chunk.choices:
            for t in c.delta.tool_calls or []:
                assert t.index == 0
                if t.function.name:
                    names.append(t.function.name)
                pieces.append(t.function.arguments or "")
            finish = c.finish_reason or finish
    assert names == ["get_weather"] and finish == "stop"
    assert len([p for p in pieces if p]) > 1  # streamed in pieces, not at the end
    jsonschema.validate(json.loads("".join(pieces)), WEATHER["function"]["parameters"])


# ---------------------------------------------------------------- schema fuzz

LEAF = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 8)),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 99),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda xs: {"enum": xs},
        st.lists(st.sampled_from(["a", "b", 1, 2.5, None, True]), min_size=1, max_size=3, unique=True),
    ),
    st.builds(
        lambda p: {"type": "string", "pattern": p},
        st.sampled_from(["^[a-z]{1,4}$", "^[0-9]{2}$", "^(x|yz)$"]),
    ),
)
NAMES = st.sampled_from(["a", "b", "id", "name", "x_1", "k"])


def _object(props: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": props, "required": [k for k in required if k in props]}


SCHEMA = st.recursive(
    LEAF,
    lambda inner: st.one_of(
        st.builds(lambda it, n: {"type": "array", "items": it, "maxItems": n}, inner, st.integers(0, 3)),
        st.builds(
            _object,
            st.dictionaries(NAMES, inner, min_size=1, max_size=3),
            st.lists(NAMES, max_size=3, unique=True),
        ),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=2, max_size=2)),
    ),
    max_leaves=5,
)


def test_schema_fuzz_every_stopped_output_validates(client, model) -> None:
    """Many generated schemas, sent at once (one batch on the server), few tokens each: whatever stopped
    parses and validates; only max_tokens may cut one short."""
    schemas: list[dict] = []

    @settings(
        max_examples=24,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(SCHEMA)
    def collect(schema) -> None:
        schemas.append(schema)

    collect()

    def ask(i: int) -> tuple[dict, object]:
        r = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=40, temperature=0.7, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schemas[i]}},
        )  # fmt: skip
        return schemas[i], r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(len(schemas))))
    stopped = 0
    for schema, choice in results:
        assert choice.finish_reason in ("stop", "length"), choice
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
            stopped += 1
    assert stopped >= len(results) * 2 // 3, f"only {stopped} of {len(results)} stopped before max_tokens"
