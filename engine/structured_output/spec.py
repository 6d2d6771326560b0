"""What a request's output must match, as plain data that crosses a process boundary unchanged.

A spec is a kind and its text: the JSON schema (serialised), the regex, the EBNF grammar, or the choices
(a JSON list); "json_object" needs no text. `check_spec` parses it into a grammar without a tokenizer
(milliseconds, no vocabulary work), so a bad schema is refused at the door with the parser's reason; the
engine compiles it against the vocabulary later, off its loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar larger than this is refused before parsing


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of GRAMMAR_KINDS
    value: str = ""  # schema JSON | regex | EBNF | JSON list of choices; "" for json_object

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> GrammarSpec:
        text = schema if isinstance(schema, str) else json.dumps(schema)  # key order = property order
        return cls("json", text)

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(choices)))

    def choices(self) -> list[str]:
        return json.loads(self.value)


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (JSON string escapes are valid EBNF ones)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@lru_cache(maxsize=32)
def check_spec(spec: GrammarSpec) -> None:
    """Raise ValueError saying why ``spec`` cannot be compiled (bad JSON, an unsupported schema keyword, an
    unclosed regex group, an undefined grammar rule). Cached: a server checks a spec off its event loop
    first, and input processing's check on the loop (once per prompt) is then a lookup."""
    from pagoda.engine.structured_output import xgrammar_backend

    if spec.kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown grammar kind {spec.kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")
    if len(spec.value) > MAX_SPEC_CHARS:
        raise ValueError(f"the {spec.kind} is {len(spec.value)} characters, more than {MAX_SPEC_CHARS}")
    if spec.kind == "json":
        try:
            schema = json.loads(spec.value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema must be an object or a boolean")
    if spec.kind == "choice":
        try:
            choices = spec.choices()
        except json.JSONDecodeError as exc:
            raise ValueError(f"the choices are not a JSON list: {exc}") from exc
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choice must be a non-empty list of non-empty strings")
    if spec.kind in ("regex", "grammar") and not spec.value:
        raise ValueError(f"the {spec.kind} is empty")
    xgrammar_backend.parse(spec)
