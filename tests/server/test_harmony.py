"""gpt-oss's Harmony format: the renderer's prompt, the reader's channels (whole and streamed in any pieces),
and a chat with a tool call through the whole server and the official openai client.

The served test forces the model's output: a fake engine core whose "model" writes a given Harmony text (token
k of the output is its k-th character, test_tool_text.py's harness), so the server's own path runs end to end
(its Harmony prompt, skip_special_tokens off, the channel reader, whole and streamed answers, the client's
parsing); a random tiny gpt-oss would never write Harmony by itself. The model itself is checked against
transformers in tests/models/test_gpt_oss_vs_hf.py.
"""

from __future__ import annotations

import datetime
import json

import httpx
import openai
import pytest
from pagoda.engine.server.app import build_app
from pagoda.engine.server.settings import ServerSettings
from pagoda.engine.tool_parsers import harmony, parser_for_template

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            },
            "required": ["location"],
        },
    },
}
ASK = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Paris?"}]
OUTPUT = (
    "<|channel|>analysis<|message|>User asks weather; call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location": "Paris"}<|call|>'
)


def test_render_writes_harmony():
    """The layout of OpenAI's Harmony guide: system (reasoning effort, channels, tools go to commentary),
    developer (instructions, the functions namespace in TypeScript), the turns, then the assistant's header."""
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location":"Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"sunny": true}'},
    ]  # fmt: skip
    text = harmony.render(history, [WEATHER], reasoning_effort="low", today=datetime.date(2026, 11, 27))
    assert text == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2026-11-27\n\nReasoning: low\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// Gets the current weather in the provided location.\n"
        "type get_weather = (_: {\n// The city and state, e.g. San Francisco, CA\nlocation: string,\n"
        'format?: "celsius" | "fahrenheit", // default: "celsius"\n}) => any;\n\n} // namespace functions<|end|>'
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location":"Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true}<|end|>'
        "<|start|>assistant"
    )
    with pytest.raises(ValueError, match="reasoning_effort"):
        harmony.render(ASK, reasoning_effort="extreme")


def test_parse_reads_the_channels():
    reasoning, content, calls = harmony.parse(OUTPUT)
    assert reasoning == "User asks weather; call the tool." and content is None
    (call,) = calls
    assert call["function"] == {"name": "get_weather", "arguments": '{"location": "Paris"}'}
    answer = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
    assert harmony.parse(answer) == ("Think.", "Sunny.", [])
    assert harmony.parse("no harmony at all") == (None, "no harmony at all", [])


@pytest.mark.parametrize("step", [1, 2, 3, 7, 50])
def test_streamed_in_any_pieces_reads_as_the_whole(step):
    stream = harmony.HarmonyStream()
    reasoning, content, args, names = "", "", "", []
    for i in range(0, len(OUTPUT), step):
        piece = OUTPUT[i : i + step]
        d = stream.feed(piece, final=i + step >= len(OUTPUT))
        assert "<|" not in d.reasoning + d.content
        reasoning += d.reasoning
        content += d.content
        for t in d.tool_calls:
            names += [t["function"]["name"]] if "id" in t else []
            args += t["function"].get("arguments", "")
    assert (reasoning, content, names, args) == (
        "User asks weather; call the tool.", "", ["get_weather"], '{"location": "Paris"}',
    )  # fmt: skip


def test_harmony_is_chosen_for_a_template_that_writes_channels():
    assert parser_for_template("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "harmony"


def _scripted(fakes, text: str):
    class Scripted(fakes.FakeTokenizer):
        def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: object) -> str:
            return "".join(text[(i - 1) % len(text)] for i in ids)

    return Scripted()


@pytest.fixture
def served(fakes):
    from pagoda.engine.frontend.async_engine import AsyncEngine, CoreThread

    engines = []

    def make(text: str):
        core = fakes.FakeCore(max_model_len=8192)
        engine = AsyncEngine(CoreThread(core), _scripted(fakes, text))
        engine.start()
        engines.append(engine)
        app = build_app(engine, ServerSettings(tool_call_parser="harmony"))
        raw = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pagoda", timeout=60)
        return openai.AsyncOpenAI(base_url="http://pagoda/v1", api_key="x", http_client=raw, max_retries=0)

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.mark.asyncio
async def test_a_chat_with_a_tool_call_through_the_official_client(served):
    client = served(OUTPUT)
    body = dict(model="fake", messages=ASK, tools=[WEATHER], max_tokens=len(OUTPUT))
    (choice,) = (await client.chat.completions.create(**body)).choices
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"location": "Paris"})
    assert choice.message.reasoning_content == "User asks weather; call the tool."
    assert not choice.message.content

    chunks = [c async for c in await client.chat.completions.create(**body, stream=True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    args = "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or [])
    names = [t.function.name for d in deltas for t in d.tool_calls or [] if t.function.name]
    assert reasoning == choice.message.reasoning_content
    assert (names, args) == (["get_weather"], call.function.arguments)
    assert not "".join(d.content or "" for d in deltas)


@pytest.mark.asyncio
async def test_a_final_answer_is_content_and_its_reasoning_apart(served):
    text = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Four.<|return|>"
    client = served(text)
    (choice,) = (
        await client.chat.completions.create(model="fake", messages=ASK, max_tokens=len(text))
    ).choices
    assert (choice.message.content, choice.message.reasoning_content) == ("Four.", "Easy.")
    assert not choice.message.tool_calls
