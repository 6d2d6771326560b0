"""Badly written tool calls through the whole server (a fake engine core whose model writes given text, the
official openai client): a whole answer is 200 with the text as content, a stream always ends with [DONE]."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pagoda.engine.server.app import build_app
from pagoda.engine.server.settings import ServerSettings

pytestmark = pytest.mark.asyncio

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "weather in Paris?"}]
GOOD = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
# Malformed before the call's name is read: content whole and streamed.
BAD = [
    '<tool_call>{"name": get_weather, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get\\qweather", "arguments": {}}</tool_call>',
    '<tool_call>{"na\\qme": "get_weather", "arguments": {}}</tool_call>',
    '<tool_call>{"name": None, "arguments": {}}</tool_call>',
    "Sure.<tool_call>{",
]
# Malformed only in the arguments, after a stream has sent the call's name: a whole answer is content; a
# stream has sent what it sent (as vLLM's), and still ends properly.
BAD_ARGUMENTS = [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa\\qris"}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"x": ' + "[" * 1200 + "]" * 1200 + "}}</tool_call>",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}, "arguments": {}}</tool_call>',
]


def scripted(fakes, text: str):
    """A tokenizer whose token k (the fake core's k-th output token) is the k-th character of ``text``."""

    class Scripted(fakes.FakeTokenizer):
        def decode(self, ids: list[int], skip_special_tokens: bool = False, **_: object) -> str:
            return "".join(text[(i - 1) % len(text)] for i in ids)

    return Scripted()


@pytest.fixture
def served(fakes):
    """A function: (openai client, raw httpx client) on a server whose model writes ``text``."""
    from pagoda.engine.frontend.async_engine import AsyncEngine, CoreThread

    engines = []

    def make(text: str, parser: str = "hermes"):
        core = fakes.FakeCore(max_model_len=8192)
        engine = AsyncEngine(CoreThread(core), scripted(fakes, text))
        engine.start()
        engines.append(engine)
        app = build_app(engine, ServerSettings(tool_call_parser=parser))
        raw = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pagoda", timeout=60)
        client = openai.AsyncOpenAI(base_url="http://pagoda/v1", api_key="x", http_client=raw, max_retries=0)
        return client, raw

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.mark.parametrize("text", BAD + BAD_ARGUMENTS)
async def test_bad_tool_text_is_content_whole_and_streamed(served, text) -> None:
    client, raw = served(text)
    body = dict(model="fake", messages=ASK, tools=[WEATHER], max_tokens=len(text))
    out = await client.chat.completions.create(**body)
    (choice,) = out.choices
    assert choice.message.content == text and not choice.message.tool_calls
    assert choice.finish_reason == "length"

    chunks = [c async for c in await client.chat.completions.create(**body, stream=True)]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if text in BAD:
        assert content == text
        assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)

    r = await raw.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])


async def test_a_good_call_still_is_a_call(served) -> None:
    client, _ = served(GOOD)
    body = dict(model="fake", messages=ASK, tools=[WEATHER], max_tokens=len(GOOD))
    (choice,) = (await client.chat.completions.create(**body)).choices
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    chunks = [c async for c in await client.chat.completions.create(**body, stream=True)]
    args = "".join(t.function.arguments or "" for c in chunks for t in c.choices[0].delta.tool_calls or [])
    assert args == call.function.arguments


async def test_a_parser_bug_still_ends_the_stream_with_done(served, monkeypatch) -> None:
    """Whatever goes wrong while a stream is written, the client gets an error event and [DONE]."""
    from pagoda.engine.tool_parsers import ToolCallStream

    def broken(self, delta, final=False):
        raise RuntimeError("a bug")

    monkeypatch.setattr(ToolCallStream, "feed", broken)
    _, raw = served(GOOD)
    body = dict(model="fake", messages=ASK, tools=[WEATHER], max_tokens=len(GOOD), stream=True)
    r = await raw.post("/v1/chat/completions", json=body)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "internal_error"
