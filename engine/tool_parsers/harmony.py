"""The Harmony chat format of gpt-oss: rendering a chat as its prompt, reading its output's channels.

A Harmony message is `<|start|>{role}[ to={recipient}]<|channel|>{channel}[ to={recipient}][ <|constrain|>
{type}]<|message|>{body}` ended by `<|end|>`, `<|return|>` (the last answer) or `<|call|>` (a tool call). The
assistant writes its reasoning on the `analysis` channel, its answer on `final`, and calls a function on
`commentary` addressed `to=functions.{name}` with JSON arguments. Tools are declared in the developer
message as a TypeScript-like `namespace functions`.

Rendering: with PyPI `openai-harmony` (OpenAI's renderer) where it is installed and $TIKTOKEN_ENCODINGS_BASE
names a directory holding its o200k vocabulary file (it would otherwise download the file, hash-checked, on
first use; the engine fetches nothing at run time); elsewhere (this project's CI) with the renderer below,
which writes the same layout for the messages the API takes.

Reading (`HarmonyStream`): the output's text with the special tokens kept, fed as it grows, gives the deltas
of `reasoning_content` (the analysis channel, as vLLM's gpt-oss reasoning parser returns it), `content` (final,
and commentary without a recipient) and OpenAI `tool_calls` (commentary to functions.*), in ToolCallStream's
delta format. A stream holds back a trailing `<|...` that may still become a marker.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.tool_parsers.stream import new_call_id

log = logging.getLogger(__name__)

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
_ENDS = (END, RETURN, CALL, START)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"([^\s<]+)")
EFFORTS = ("low", "medium", "high")


# ---- rendering ----------------------------------------------------------------------------------------------


def render(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    reasoning_effort: str | None = None,
    today: datetime.date | None = None,
) -> str:
    """The Harmony prompt of a chat (OpenAI messages as chat templates get them: a `system` message is the
    developer's instructions; tools as the request's `{"type": "function", "function": {...}}`)."""
    effort = reasoning_effort or "medium"
    if effort not in EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {effort!r}")
    day = (today or datetime.date.today()).isoformat()
    system = (
        "You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
        f"Current date: {day}\n\nReasoning: {effort}\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    )
    if tools:
        system += "\nCalls to these tools must go to the commentary channel: 'functions'."
    out = [f"{START}system{MESSAGE}{system}{END}"]
    instructions = "\n\n".join(m.get("content") or "" for m in messages if m.get("role") == "system")
    developer = f"# Instructions\n\n{instructions}" if instructions else ""
    if tools:
        developer += ("\n\n" if developer else "") + "# Tools\n\n" + _namespace(tools)
    if developer:
        out.append(f"{START}developer{MESSAGE}{developer}{END}")
    call_names: dict[str, str] = {}
    for m in messages:
        role = m.get("role")
        content = m.get("content") or ""
        if role == "user":
            out.append(f"{START}user{MESSAGE}{content}{END}")
        elif role == "assistant":
            for call in m.get("tool_calls") or []:
                fn = call.get("function") or {}
                call_names[call.get("id") or ""] = fn.get("name", "")
                out.append(
                    f"{START}assistant{CHANNEL}commentary to=functions.{fn.get('name', '')} {CONSTRAIN}json"
                    f"{MESSAGE}{fn.get('arguments') or '{}'}{CALL}"
                )
            if content or not m.get("tool_calls"):
                out.append(f"{START}assistant{CHANNEL}final{MESSAGE}{content}{END}")
        elif role == "tool":
            name = m.get("name") or call_names.get(m.get("tool_call_id") or "", "")
            out.append(f"{START}functions.{name} to=assistant{CHANNEL}commentary{MESSAGE}{content}{END}")
    if add_generation_prompt:
        out.append(f"{START}assistant")
    return "".join(out)


def _namespace(tools: list[dict[str, Any]]) -> str:
    lines = ["## functions", "", "namespace functions {", ""]
    for tool in tools:
        fn = tool.get("function") or tool
        if fn.get("description"):
            lines.append(f"// {fn['description']}")
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        if not props:
            lines.append(f"type {fn['name']} = () => any;")
        else:
            lines.append(f"type {fn['name']} = (_: {{")
            required = set(params.get("required") or [])
            for name, spec in props.items():
                if spec.get("description"):
                    lines.append(f"// {spec['description']}")
                optional = "" if name in required else "?"
                default = f" // default: {json.dumps(spec['default'])}" if "default" in spec else ""
                lines.append(f"{name}{optional}: {_ts_type(spec)},{default}")
            lines.append("}) => any;")
        lines.append("")
    lines.append("} // namespace functions")
    return "\n".join(lines)


def _ts_type(spec: dict[str, Any]) -> str:
    """A JSON schema as the TypeScript type Harmony declares it."""
    if "enum" in spec:
        return " | ".join(json.dumps(v) for v in spec["enum"])
    kind = spec.get("type")
    if isinstance(kind, list):
        return " | ".join(_ts_type({**spec, "type": k}) for k in kind)
    if kind == "integer" or kind == "number":
        return "number"
    if kind == "array":
        return f"{_ts_type(spec.get('items') or {})}[]"
    if kind == "object":
        props = spec.get("properties") or {}
        if not props:
            return "object"
        return "{ " + ", ".join(f"{k}: {_ts_type(v)}" for k, v in props.items()) + " }"
    return {"string": "string", "boolean": "boolean", "null": "null"}.get(kind, "any")


def render_with_openai_harmony(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, reasoning_effort: str | None
) -> str | None:
    """The prompt as openai-harmony renders it (decoded, special tokens kept), or None where its encoding does
    not load (not installed, or no local vocabulary)."""
    encoding = _encoding()
    if encoding is None:
        return None
    import openai_harmony as oh

    system = oh.SystemContent.new().with_reasoning_effort(
        {"low": oh.ReasoningEffort.LOW, "high": oh.ReasoningEffort.HIGH}.get(
            reasoning_effort or "", oh.ReasoningEffort.MEDIUM
        )
    )
    convo = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    instructions = "\n\n".join(m.get("content") or "" for m in messages if m.get("role") == "system")
    if instructions or tools:
        dev = oh.DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions(instructions)
        if tools:
            dev = dev.with_function_tools(
                [
                    oh.ToolDescription.new(
                        t["function"]["name"],
                        t["function"].get("description", ""),
                        t["function"].get("parameters"),
                    )
                    for t in tools
                ]
            )
        convo.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev))
    names: dict[str, str] = {}
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "user":
            convo.append(oh.Message.from_role_and_content(oh.Role.USER, content))
        elif role == "assistant":
            for call in m.get("tool_calls") or []:
                fn = call.get("function") or {}
                names[call.get("id") or ""] = fn.get("name", "")
                convo.append(
                    oh.Message.from_role_and_content(oh.Role.ASSISTANT, fn.get("arguments") or "{}")
                    .with_channel("commentary")
                    .with_recipient(f"functions.{fn.get('name', '')}")
                    .with_content_type("<|constrain|>json")
                )
            if content or not m.get("tool_calls"):
                convo.append(
                    oh.Message.from_role_and_content(oh.Role.ASSISTANT, content).with_channel("final")
                )
        elif role == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id") or "", "")
            convo.append(
                oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, f"functions.{name}"), content)
                .with_recipient("assistant")
                .with_channel("commentary")
            )
    tokens = encoding.render_conversation_for_completion(
        oh.Conversation.from_messages(convo), oh.Role.ASSISTANT
    )
    return encoding.decode(tokens)


_ENCODING: list[Any] = []


def _encoding() -> Any:
    """openai-harmony's gpt-oss encoding, loaded once, where its vocabulary is local; else None."""
    if not _ENCODING:
        if not os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
            _ENCODING.append(None)  # no local vocabulary: openai-harmony would download it
            return None
        try:
            import openai_harmony as oh

            _ENCODING.append(oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS))
        except Exception as exc:  # noqa: BLE001 - not installed, or its vocabulary cannot be fetched
            log.info("openai-harmony unavailable (%s): Pagoda's Harmony renderer is used", exc)
            _ENCODING.append(None)
    return _ENCODING[0]


def render_prompt(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    reasoning_effort: str | None = None,
) -> str:
    """openai-harmony's rendering where it loads, else ours (`render`)."""
    if add_generation_prompt:
        rendered = render_with_openai_harmony(messages, tools, reasoning_effort)
        if rendered is not None:
            return rendered
    return render(messages, tools, add_generation_prompt, reasoning_effort)


# ---- reading --------------------------------------------------------------------------------------------------


@dataclass
class HarmonyDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


class HarmonyStream:
    """Feed it the output's text (special tokens kept) as it grows: the reasoning, content and tool-call deltas
    to send. The output starts inside the assistant's first message header (the prompt ended `<|start|>
    assistant`)."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.in_body = False
        self.channel: str | None = None
        self.recipient: str | None = None
        self.ids: list[str] = []
        self.arguments: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def feed(self, delta: str, final: bool = False) -> HarmonyDelta:
        self.text += delta
        out = HarmonyDelta()
        while True:
            if not self.in_body:
                at = self.text.find(MESSAGE, self.pos)
                if at < 0:
                    break
                self._open(self.text[self.pos : at], out)
                self.pos = at + len(MESSAGE)
                continue
            ends = [(i, m) for m in _ENDS if (i := self.text.find(m, self.pos)) >= 0]
            if ends:
                at, marker = min(ends)
                self._body(self.text[self.pos : at], out)
                self.pos = at if marker == START else at + len(marker)
                self.in_body = False
                continue
            stop = len(self.text) if final else _safe_end(self.text, self.pos)
            self._body(self.text[self.pos : stop], out)
            self.pos = stop
            break
        if final and not self.in_body and self.pos < len(self.text):
            # text outside any message (a model that did not write Harmony): plain content
            rest = self.text[self.pos :]
            self.pos = len(self.text)
            if rest.strip() and MESSAGE not in rest:
                out.content += rest
        return out

    def _open(self, header: str, out: HarmonyDelta) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self.channel = channel.group(1) if channel else None
        self.recipient = recipient.group(1) if recipient else None
        self.in_body = True
        if self.recipient and self.recipient.startswith("functions."):
            index = len(self.ids)
            self.ids.append(new_call_id())
            self.arguments.append("")
            name = self.recipient[len("functions.") :]
            out.tool_calls.append(
                {
                    "index": index,
                    "id": self.ids[index],
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            )

    def _body(self, piece: str, out: HarmonyDelta) -> None:
        if not piece:
            return
        if self.recipient and self.recipient.startswith("functions."):
            index = len(self.ids) - 1
            self.arguments[index] += piece
            out.tool_calls.append({"index": index, "function": {"arguments": piece}})
        elif self.channel == "analysis":
            out.reasoning += piece
        else:  # final, or commentary addressed to no tool (a preamble the user sees)
            out.content += piece


def _safe_end(text: str, pos: int) -> int:
    """Where a stream may send up to: before a trailing `<|...` that could still become a marker."""
    at = text.rfind("<", pos)
    if at >= 0 and "|>" not in text[at:] and any(m.startswith(text[at:]) for m in (*_ENDS, "<|")):
        return at
    return len(text)


def parse(text: str) -> tuple[str | None, str | None, list[dict]]:
    """(reasoning_content, content, OpenAI tool_calls) of a whole output."""
    stream = HarmonyStream()
    d = stream.feed(text, final=True)
    calls = [
        {"id": i, "type": "function", "function": {"name": _name(d.tool_calls, n), "arguments": a}}
        for n, (i, a) in enumerate(zip(stream.ids, stream.arguments, strict=True))
    ]
    return (d.reasoning or None), (d.content or None), calls


def _name(deltas: list[dict], index: int) -> str:
    return next(d["function"]["name"] for d in deltas if d["index"] == index and "id" in d)
