"""What a request asks its output to match, from OpenAI's and vLLM's fields, as one GrammarSpec.

Sources: `response_format` (json_object, json_schema), vLLM's `structured_outputs` and `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar`, and tool_choice "required" or a named function (the
calls' JSON, so their arguments always validate). At most one may be given; two are a 400 naming both.
"""

from __future__ import annotations

import json
from typing import Any

from pagoda.engine.server import protocol as P
from pagoda.engine.server.errors import bad_request
from pagoda.engine.structured_output import GrammarSpec

OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def _json_spec(value: Any) -> GrammarSpec:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
    return GrammarSpec.json_schema(value)


def requested_spec(req: P.SamplingFields) -> tuple[str, GrammarSpec] | None:
    """(the field that asked, its spec) or None; a 400 when several fields ask."""
    found: list[tuple[str, GrammarSpec]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", GrammarSpec("json_object")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
        found.append(("response_format", GrammarSpec.json_schema(rf.json_schema.schema_)))
    so = req.structured_outputs
    if so is not None:
        given = [
            (name, spec)
            for name, spec in (
                ("json", so.json_),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
                ("json_object", so.json_object or None),
            )
            if spec is not None
        ]
        if len(given) != 1:
            raise bad_request(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                "structured_outputs",
            )
        found.append(("structured_outputs", _spec_of(*given[0])))
    for field, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, field)
        if value is not None:
            found.append((field, _spec_of(kind, value)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"Give one way to structure the output, not several ({names}).", found[1][0])
    return found[0] if found else None


def _spec_of(kind: str, value: Any) -> GrammarSpec:
    try:
        if kind == "json":
            return _json_spec(value)
        if kind == "choice":
            return GrammarSpec.choice(value)
        if kind == "json_object":
            return GrammarSpec("json_object")
        return GrammarSpec(kind, value)
    except ValueError as exc:
        raise bad_request(str(exc), kind) from exc


def tool_choice_spec(tools: list[P.Tool], choice: Any, parallel: bool | None) -> GrammarSpec | None:
    """The grammar of tool_choice "required" (a JSON list of calls to the given tools) or of a named
    function (its arguments); None for auto and none."""
    if isinstance(choice, P.NamedToolChoice):
        fn = next((t.function for t in tools if t.function.name == choice.function.name), None)
        if fn is None:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice"
            )
        return GrammarSpec.json_schema(fn.parameters or OBJECT_SCHEMA)
    if choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or OBJECT_SCHEMA,
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel is False:
        schema["maxItems"] = 1
    return GrammarSpec.json_schema(schema)
