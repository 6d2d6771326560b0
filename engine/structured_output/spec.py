"""What a request's output must match, as plain data that crosses a process boundary unchanged.

A spec is a kind and its text: the JSON schema (serialised), the regex, the EBNF grammar, or the choices
(a JSON list); "json_object" needs no text. `check_spec` parses it into a grammar without a tokenizer
(milliseconds, no vocabulary work), so a bad schema is refused at the door with the parser's reason; the
engine compiles it against the vocabulary later, off its loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

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
