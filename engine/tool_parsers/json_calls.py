"""Finding function calls in JSON text that may still be growing: `{"name": ..., "arguments": {...}}`
objects, alone, in a list, or one after another.

`scan` reads the text once with a small JSON tokenizer (strings, escapes, nesting) and reports, per call
object, its name once the name's string is closed and the raw text of its arguments so far: everything
from the start of the arguments value to where it closes, or to the end of the text while it is still
open. So a stream can send the arguments' new characters every time, and the concatenation is exactly
the arguments' JSON, as OpenAI streams them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class CallText:
    name: str | None = None
    arguments: str = ""  # raw JSON text of the arguments value so far
    complete: bool = False  # the call object closed


def _string_end(text: str, i: int) -> int:
    """Index just past the string starting at text[i] == '"', or -1 while it is still open."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return -1


def _value_end(text: str, i: int) -> int:
    """Index just past the JSON value starting at text[i], or -1 while it is still open."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                j = _string_end(text, j)
                if j < 0:
                    return -1
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return -1
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else -1


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _scan_object(text: str, i: int) -> tuple[CallText, int]:
    """The call object starting at text[i] == '{': what is known of it, and the index past it (-1: open)."""
    call = CallText()
    i += 1
    while True:
        i = _skip_space(text, i)
        if i >= len(text):
            return call, -1
        if text[i] == "}":
            call.complete = True
            return call, i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return call, -1
        key_end = _string_end(text, i)
        if key_end < 0:
            return call, -1
        key = json.loads(text[i:key_end])
        i = _skip_space(text, key_end)
        if i >= len(text) or text[i] != ":":
            return call, -1
        i = _skip_space(text, i + 1)
        if i >= len(text):
            return call, -1
        end = _value_end(text, i)
        if key == "name":
            if end < 0:
                return call, -1
            name = json.loads(text[i:end])
            call.name = name if isinstance(name, str) else None
        elif key in ARGUMENT_KEYS:
            if text[i] == '"':  # arguments sent as a JSON-encoded string: only whole
                call.arguments = json.loads(text[i:end]) if end >= 0 else ""
            else:
                call.arguments = text[i:] if end < 0 else text[i:end]
        if end < 0:
            return call, -1
        i = end


def scan(text: str) -> list[CallText]:
    """The call objects in ``text``: a single object, a JSON list of them, or objects separated by
    whitespace, commas or semicolons; the last one may be incomplete."""
    calls = []
    i = _skip_space(text, 0)
    if i < len(text) and text[i] == "[":
        i += 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i >= len(text) or text[i] != "{":
            return calls
        call, i = _scan_object(text, i)
        calls.append(call)
        if i < 0:
            return calls


def parse_calls(text: str) -> list[CallText] | None:
    """The calls of a whole text, or None unless it is nothing but complete calls with a name and JSON
    object arguments (then it is content)."""
    calls = scan(text)
    if not calls or not all(c.complete and c.name for c in calls):
        return None
    for call in calls:
        call.arguments = call.arguments or "{}"
        try:
            if not isinstance(json.loads(call.arguments), dict):
                return None
        except json.JSONDecodeError:
            return None
    return calls
