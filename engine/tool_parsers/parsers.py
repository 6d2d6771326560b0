"""Where a model's output holds its tool calls, per format (`--tool-call-parser`, named as vLLM's).

A parser splits an output into the content before the calls and the calls' JSON text (`json_calls`
reads the calls from it). `split` is given the text so far: while it streams, a parser keeps back content
that could still turn out to start its marker.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Hermes; a JSON
  list inside one block is read too). Also the format Pagoda renders for chat templates that know no
  tools, such as the default model's.
- llama3_json: the output is the call object itself, `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`; several are separated by `;` (Llama 3.1-3.3).
- mistral: `[TOOL_CALLS]` followed by a JSON list of `{"name", "arguments"}` objects.
- harmony: gpt-oss's channels (engine/tool_parsers/harmony.py): the server renders the prompt in Harmony and
  reads reasoning, answer and calls from the output's messages; chosen for a chat template that writes
  `<|channel|>`.

`tool_choice` "required" and a named function do not parse the model's format: their output is grammar-
constrained to a JSON list of calls (`RequiredCalls`) or to the function's arguments (`NamedCall`).
"""

from __future__ import annotations


class ToolParser:
    name = ""
    marker = ""  # starts the calls

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        """(content, calls' JSON text or None): content holds back a possible start of the marker unless
        ``final``."""
        at = text.find(self.marker)
        if at >= 0:
            return text[:at], self.calls_text(text[at + len(self.marker) :])
        if final:
            return text, None
        return text[: len(text) - _partial_suffix(text, self.marker)], None

    def calls_text(self, after_marker: str) -> str:
        return after_marker


class Hermes(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    end = "</tool_call>"

    def calls_text(self, after_marker: str) -> str:
        body = after_marker.replace(self.end, "\n").replace(self.marker, "\n")
        return body[: len(body) - _partial_suffix(body, self.end)]


class Mistral(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"


class Llama3Json(ToolParser):
    """The whole output is calls when it starts with `<|python_tag|>` or `{`."""

    name = "llama3_json"
    marker = "<|python_tag|>"

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        body = text.lstrip()
        if body.startswith(self.marker):
            return "", body[len(self.marker) :]
        if body.startswith("{"):
            return "", body
        if not final and (not body or self.marker.startswith(body)):
            return "", None  # undecided
        return text, None


class RequiredCalls(ToolParser):
    """tool_choice "required": the output is a JSON list of {"name", "parameters"} (grammar-constrained)."""

    name = "required"

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        return "", text


class NamedCall(ToolParser):
    """A named tool_choice: the output is that function's arguments (grammar-constrained)."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        return "", text


class Harmony(ToolParser):
    """gpt-oss's Harmony format: calls, reasoning and answer are channels of its messages. The server reads
    them with engine/tool_parsers/harmony.py (and renders the prompt with it); this entry names the format."""

    name = "harmony"
    marker = "<|channel|>"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that starts ``marker`` (what a stream must hold back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Hermes, Llama3Json, Mistral)}
# every --tool-call-parser: the text parsers above and the channel formats, which the server reads its own way
FORMATS: dict[str, type[ToolParser]] = {**PARSERS, Harmony.name: Harmony}


def writes_harmony(template: str | None) -> bool:
    """Whether a chat template writes gpt-oss's Harmony format (its messages' channels)."""
    return "<|channel|>" in (template or "")


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's own tool format needs; hermes (Pagoda's rendering) when it has none."""
    text = template or ""
    if writes_harmony(text):
        return "harmony"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "hermes"
