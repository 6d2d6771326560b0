"""Finding function calls in JSON text that may still be growing: `{"name": ..., "arguments": {...}}`
objects, alone, in a list, or one after another.

`scan` reads the text once with a small JSON tokenizer (strings, escapes, nesting) and reports, per call
object, its name once the name's string is closed and the raw text of its arguments so far: everything
from the start of the arguments value to where it closes, or to the end of the text while it is still
open. So a stream can send the arguments' new characters every time, and the concatenation is exactly
the arguments' JSON, as OpenAI streams them.

Nothing here raises on what a model writes: a call object that is not JSON (a bare word for the name, a
bad escape, a name or arguments key given twice) is marked `malformed`, and a text holding one is content.
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
    malformed: bool = False  # not JSON, or its name or arguments given twice: the text is content


_BAD = object()


MAX_DEPTH = 128  # arrays and objects nested deeper are not a tool call, whatever the recursion limit is


def _too_deep(text: str) -> bool:
    depth, in_string, escaped = 0, False, False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif c in "]}":
            depth -= 1
    return False


def _json(text: str) -> object:
    """The JSON value of ``text``, or _BAD (model text: any error, nesting past MAX_DEPTH included, so the
    answer never depends on the interpreter's recursion limit)."""
    if _too_deep(text):
        return _BAD
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _BAD


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
    """The call object starting at text[i] == '{': what is known of it, and the index past it (-1: open or
    malformed)."""
    call = CallText()
    seen: set[str] = set()
    i += 1
    while True:
        i = _skip_space(text, i)
        if i >= len(text):
            return call, -1
        if text[i] == "}":
            call.complete = True
            call.arguments = call.arguments or "{}"  # no arguments (or ""): none, as OpenAI sends them
            return call, i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return call, -1
        key_end = _string_end(text, i)
        if key_end < 0:
            return call, -1
        key = _json(text[i:key_end])
        if key is _BAD:
            call.malformed = True
            return call, -1
        field = "arguments" if key in ARGUMENT_KEYS else key
        if field in ("name", "arguments"):
            if field in seen:  # which one counts? a stream may have sent the first already
                call.malformed = True
                return call, -1
            seen.add(field)
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
            name = _json(text[i:end])
            if not isinstance(name, str):
                call.malformed = True
                return call, -1
            call.name = name
        elif field == "arguments":
            if text[i] == '"':  # arguments sent as a JSON-encoded string: only whole
                arguments = _json(text[i:end]) if end >= 0 else ""
                if not isinstance(arguments, str):
                    call.malformed = True
                    return call, -1
                call.arguments = arguments
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
    if not calls or not all(c.complete and c.name and not c.malformed for c in calls):
        return None
    for call in calls:
        if not isinstance(_json(call.arguments), dict):
            return None
    return calls
