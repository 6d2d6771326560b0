"""`check_spec`: a request's grammar refused at the door with the parser's reason, before the engine sees it."""

from __future__ import annotations

import json
from functools import lru_cache

from pagoda.engine.structured_output.spec import GRAMMAR_KINDS, MAX_SPEC_CHARS, GrammarSpec


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
