"""Tool calls read from outputs per model family, whole and streamed (the pieces join to the arguments'
JSON exactly), and tool history rendered for templates that know tools and for those that do not."""

from __future__ import annotations

import json

import pytest
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
