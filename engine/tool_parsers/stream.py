"""Tool calls out of an output: whole (`extract`) or as OpenAI streams them (`ToolCallStream`).

A stream sends the content before the calls as content deltas, then for each call one delta with its id,
type and name (and empty arguments), then the arguments' text in pieces as the model writes it; joined,
the pieces are the arguments' JSON exactly (engine/tool_parsers/json_calls.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pagoda.engine.tool_parsers.json_calls import parse_calls, scan
from pagoda.engine.tool_parsers.parsers import NamedCall, ToolParser


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def extract(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output; an output whose calls do not parse is all content."""
    if isinstance(parser, NamedCall):
        return None, [ToolCall(new_call_id(), parser.function, text)]
    content, calls_text = parser.split(text, final=True)
    calls = parse_calls(calls_text) if calls_text is not None else None
    if calls is None:
        return (text if text else None), []
    return (content or None), [ToolCall(new_call_id(), c.name, c.arguments) for c in calls]


class ToolCallStream:
    """Feed it the output's text as it grows; it returns the content and tool-call deltas to send."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []
        self.args_sent: list[int] = []

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        if isinstance(self.parser, NamedCall):
            calls = [_Known(self.parser.function, self.text)]
            content, calls_text = "", None
        else:
            content, calls_text = self.parser.split(self.text, final)
            calls = scan(calls_text) if calls_text is not None else []
        if final and calls_text is not None and not self.ids and parse_calls(calls_text) is None:
            content, calls = self.text, []  # never turned out to be calls: it was content all along
        new_content = content[self.content_sent :] if len(content) > self.content_sent else ""
        self.content_sent = max(self.content_sent, len(content))
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # later calls wait for this one's name
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.args_sent.append(0)
                deltas.append(
                    {
                        "index": index,
                        "id": self.ids[index],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            piece = call.arguments[self.args_sent[index] :]
            if piece:
                self.args_sent[index] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": piece}})
        return new_content, deltas


@dataclass
class _Known:
    name: str
    arguments: str
