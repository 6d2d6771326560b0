"""Fuzzing the completion endpoints: schemathesis against the server's own OpenAPI schema never gets a 5xx,
and random valid-schema requests aimed at the edges (token ids up to 2^31-1, min_tokens, extreme sampling
values) never make an engine step fail: nothing a client sends may raise inside step()."""

from __future__ import annotations

import math

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

EXAMPLES = {"positive": 15, "negative": 10}


def at_most(value: object, top: int) -> object:
    """`value` no larger than `top`, in the type it came in: the door takes 300.0 and "300" for an integer
    field as pydantic's lax mode does (the negative cases send both), and either would be 300 tokens."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value if value <= top else type(value)(top)
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return str(top) if math.isfinite(number) and number > top else value
    return value


def bound(body: object) -> None:
    """Keep generated work small (2 CPU cores): few tokens, few choices, few prompts."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if key not in body:
            continue
        value = body[key]
        if value is None:
            body[key] = 2  # null means "up to the context": hundreds of tokens on a CPU
        elif isinstance(value, int) and not isinstance(value, bool):
            body[key] = max(min(value, 2), -1)
        else:
            body[key] = at_most(value, 2)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2
    for key in ("n", "best_of", "min_tokens"):  # 88.0 is a valid n too: 88 sequences thrash the cache
        if key in body:
            body[key] = at_most(body[key], 2)
    if isinstance(body.get("prompt"), list):
        body["prompt"] = body["prompt"][:3]


def test_completion_endpoints_never_answer_5xx(server) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    seen: dict[int, int] = {}
    for path in ("/v1/completions", "/v1/chat/completions"):
        operation = schema[path]["POST"]
        for mode, count in EXAMPLES.items():
            strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

            @settings(
                max_examples=count,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=strategy)
            def check(case) -> None:
                bound(case.body)
                response = case.call(base_url=server.url, timeout=300)
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                assert response.status_code < 500, (case.body, response.status_code, response.text[:500])

            check()
    assert any(code == 200 for code in seen), seen  # the fuzzer did reach the engine
    assert any(400 <= code < 500 for code in seen), seen
    assert httpx.get(server.url + "/health").status_code == 200


TOKEN_ID = st.one_of(st.integers(0, 49151), st.integers(49152, 2**31 - 1), st.sampled_from([0, 49151, 49152]))
FLOAT = {"allow_nan": False, "allow_infinity": False}
SAMPLING = {
    "min_tokens": st.integers(0, 3),
    "n": st.integers(1, 2),
    "stop_token_ids": st.lists(TOKEN_ID, max_size=4),
    "temperature": st.one_of(st.floats(0, 100, **FLOAT), st.sampled_from([0.0, 1e-30, 100.0])),
    "top_p": st.floats(1e-9, 1, **FLOAT),
    "top_k": st.one_of(st.integers(-1, 100), st.integers(-1, 2**31 - 1)),
    "min_p": st.floats(0, 1, **FLOAT),
    "presence_penalty": st.floats(-2, 2, **FLOAT),
    "frequency_penalty": st.floats(-2, 2, **FLOAT),
    "repetition_penalty": st.floats(1e-6, 100, **FLOAT),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "ignore_eos": st.booleans(),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "priority": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "logit_bias": st.dictionaries(TOKEN_ID.map(str), st.floats(-100, 100, **FLOAT), max_size=3),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "reasoning_effort": st.sampled_from(["low", "high"]),
}
COMPLETION = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            st.text(min_size=1, max_size=40),
            st.lists(TOKEN_ID, min_size=1, max_size=8),
            st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3),
        ),
        "max_tokens": st.integers(1, 3),  # always bounded: the 2 CPU cores decode a few tokens a second
    },
    optional={
        **SAMPLING,
        "logprobs": st.integers(0, 20),
        "echo": st.booleans(),
        "prompt_logprobs": st.integers(0, 5),
    },
)
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": st.text(max_size=40)}), min_size=1, max_size=3),
     "max_tokens": st.integers(1, 3)},
    optional={**SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)},
)  # fmt: skip


def test_random_valid_requests_never_fail_an_engine_step(server) -> None:
    failures_before = server.metric("pagoda:engine_step_failures_total")
    seen: dict[int, int] = {}

    @settings(max_examples=80, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=st.one_of(st.tuples(st.just("/v1/completions"), COMPLETION),
                          st.tuples(st.just("/v1/chat/completions"), CHAT)))  # fmt: skip
    def check(case) -> None:
        path, body = case
        response = httpx.post(server.base_url + path.removeprefix("/v1"), json=body, timeout=120)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (body, response.status_code, response.text[:500])
        if body.get("stream") and response.status_code == 200:
            assert "engine_error" not in response.text, (body, response.text[-500:])

    check()
    assert seen.get(200, 0) >= 10 and seen.get(400, 0) >= 5, seen  # both sides of the door were reached
    assert server.metric("pagoda:engine_step_failures_total") == failures_before == 0
    assert httpx.get(server.url + "/health").status_code == 200
