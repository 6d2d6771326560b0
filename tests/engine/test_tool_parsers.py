"""Tool calls read from outputs per model family, whole and streamed (the pieces join to the arguments'
JSON exactly), and tool history rendered for templates that know tools and for those that do not."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from pagoda.engine.frontend.chat_messages import template_knows_tools, template_messages
from pagoda.engine.tool_parsers import PARSERS, RequiredCalls, ToolCallStream, extract, parser_for_template

ARGS = '{"city": "Paris", "opts": {"units": ["C", "}"], "note": "a\\"b"}}'
OUTPUTS = {
    "hermes": f'Let me check.<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\n'
    '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
    "llama3_json": f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS}}}; {{"name": "now", "parameters": {{}}}}',
    "mistral": f'Let me check.[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}, {{"name": "now", "arguments": {{}}}}]',
}


def streamed(parser, text: str, step: int) -> tuple[str, dict[int, str], dict[int, str]]:
    stream = ToolCallStream(parser)
    content, names, args = "", {}, {}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += c
        for d in deltas:
            if "id" in d:
                assert d["index"] not in names and d["type"] == "function"
                names[d["index"]] = d["function"]["name"]
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    return content, names, args


@pytest.mark.parametrize("family", sorted(OUTPUTS))
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_calls_whole_and_streamed(family, step) -> None:
    parser = PARSERS[family]()
    content, calls = extract(parser, OUTPUTS[family])
    assert [c.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].arguments) == json.loads(ARGS) and json.loads(calls[1].arguments) == {}
    assert content == (None if family == "llama3_json" else "Let me check.")
    s_content, names, args = streamed(parser, OUTPUTS[family], step)
    assert s_content == (content or "")
    assert names == {0: "get_weather", 1: "now"}
    assert args == {0: calls[0].arguments, 1: calls[1].arguments}


@pytest.mark.parametrize("family", sorted(OUTPUTS))
def test_plain_text_and_broken_calls_stay_content(family) -> None:
    parser = PARSERS[family]()
    for text in [
        "Paris is sunny < today.",
        "{not json at all",
        f'{parser.marker or "<tool_call>"}{{"name": 3}}',
    ]:
        content, calls = extract(parser, text)
        assert calls == [] and content == text
        s_content, names, _ = streamed(parser, text, 2)
        assert names == {} and s_content == text


def test_required_calls_list() -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    content, calls = extract(RequiredCalls(), text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]


def test_parser_follows_the_template() -> None:
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("<|python_tag|> ipython") == "llama3_json"
    assert parser_for_template(None) == "hermes"


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
HISTORY = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_history_for_a_template_without_tools_keeps_calls_and_results(default_model_dir) -> None:
    from pagoda.engine.loader import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    assert not template_knows_tools(tok.chat_template)
    msgs, extra = template_messages(HISTORY, TOOLS, knows_tools=False)
    assert extra == {}
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert (
        "<tool_response>\nSunny\n</tool_response>" in text
        and '"name": "get_weather"' in text.split("<|im_end|>")[0]
    )


def test_history_for_a_template_with_tools_is_passed_through() -> None:
    msgs, extra = template_messages(HISTORY, TOOLS, knows_tools=True)
    assert extra == {"tools": TOOLS}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}


# ---------------------------------------------------------------- model text never makes a parser raise

# Pieces a model writes when it gets the format almost right: markers, JSON punctuation, bare words where
# strings belong, bad escapes, deep nesting, duplicated keys.
NEAR_MISS = [
    "<tool_call>", "</tool_call>", "<tool_", "</tool", "[TOOL_CALLS]", "[TOOL", "<|python_tag|>", "<|py",
    "{", "}", "[", "]", ",", ";", ":", '"', "\\", " ", "\n", '"name"', '"arguments"', '"parameters"',
    '"get_weather"', "get_weather", "None", "null", "true", "3", "-1e999", '"\\q"', '"\\u12"', '"\\ud800"',
    '{"name": "now", "arguments": {}}', '{"name": get_weather, "arguments": {}}', '{"name": None, ',
    '"arguments": "{\\"a\\": 1}"', '"arguments": {"a": [1, "}"]}', '"parameters": 7', "[" * 50, "]" * 50,
    '"name": "a", "name": "b"', '"arguments": {}, "parameters": {}',
]  # fmt: skip
near_miss_text = st.lists(st.one_of(st.sampled_from(NEAR_MISS), st.text(max_size=4)), max_size=30).map(
    "".join
)


@st.composite
def edited_output(draw) -> str:
    """A well-formed output of some family with a few characters deleted, inserted or replaced."""
    text = draw(st.sampled_from(sorted(OUTPUTS.values())))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        piece = draw(st.one_of(st.sampled_from(NEAR_MISS), st.text(max_size=2)))
        cut = draw(st.integers(0, 3))
        text = text[:at] + piece + text[at + cut :]
    return text


model_text = st.one_of(st.text(max_size=80), near_miss_text, edited_output())


def chunked(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [""]


def check_whole_and_streamed(family: str, text: str, cuts: list[int]) -> None:
    parser = PARSERS[family]()
    content, calls = extract(parser, text)
    if calls:
        assert all(isinstance(c.name, str) and c.name for c in calls)
        assert all(isinstance(json.loads(c.arguments), dict) for c in calls)
    else:
        assert content == (text or None)  # a malformed call is content, all of it
    stream = ToolCallStream(parser)
    s_content, names, args = "", {}, {}
    pieces = chunked(text, cuts)
    for i, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        s_content += c
        for d in deltas:
            if "id" in d:
                names[d["index"]] = d["function"]["name"]
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    if calls:  # what the stream sent is what the whole answer says
        assert s_content == (content or "")
        assert names == {i: c.name for i, c in enumerate(calls)}
        assert args == {i: c.arguments for i, c in enumerate(calls)}
    elif not names:
        assert s_content == text
    assert not (names and s_content == text)  # never both a call and its text as content


@pytest.mark.parametrize("family", sorted(PARSERS))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=model_text, cuts=st.lists(st.integers(0, 10**6), max_size=12))
def test_parsers_never_raise_on_model_text(family, text, cuts) -> None:
    check_whole_and_streamed(family, text, cuts)


@pytest.mark.parametrize("family", sorted(PARSERS))
@pytest.mark.parametrize(
    "body",
    [
        '{"name": get_weather, "arguments": {}}',
        '{"name": "get\\qweather", "arguments": {}}',
        '{"na\\qme": "get_weather", "arguments": {}}',
        '{"name": "get_weather", "arguments": "{\\q}"}',
        '{"name": None, "parameters": {}}',
        '{"name": "a", "arguments": {"x": ' + "[" * 1500 + "]" * 1500 + "}}",
        '{"name": "a", "arguments": {"x": 1}, "arguments": {"y": 2}}',
    ],
)
def test_reported_malformed_calls_are_content(family, body) -> None:
    marker = {"hermes": "<tool_call>", "llama3_json": "", "mistral": "[TOOL_CALLS]"}[family]
    text = f"{marker}{body}</tool_call>" if family == "hermes" else f"{marker}{body}"
    content, calls = extract(PARSERS[family](), text)
    assert (content, calls) == (text, [])
    for step in (1, 7, len(text)):
        check_whole_and_streamed(family, text, list(range(step, len(text), step)))


@pytest.mark.parametrize("limit", [1000, 20000])
def test_nesting_past_the_depth_cap_is_content_whatever_the_recursion_limit(limit):
    """1,200 nested arrays: json.loads raises RecursionError only under a low recursion limit (a test runner
    may raise it), so the cap decides, the same way every time; 100 levels stay a call."""
    import sys

    def call(depth: int) -> str:
        return '<tool_call>{"name": "f", "arguments": {"x": ' + "[" * depth + "]" * depth + "}}</tool_call>"

    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        deep = extract(PARSERS["hermes"](), call(1200))
        shallow = extract(PARSERS["hermes"](), call(100))
    finally:
        sys.setrecursionlimit(before)
    assert deep[1] == [] and deep[0] == call(1200)
    assert [c.name for c in shallow[1]] == ["f"] and not shallow[0]
