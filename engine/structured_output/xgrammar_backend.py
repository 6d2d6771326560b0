"""The grammar engine: xgrammar (parsing, compiling against the vocabulary, matching, token bitmasks).

Compiled grammars are cached by xgrammar's compiler (keyed by the grammar's text, bounded in bytes), so the
same schema sent again compiles in microseconds. JSON is compact (`any_whitespace=False`):
a free-whitespace grammar lets a small model pad with newlines until max_tokens.
"""

from __future__ import annotations

import re
from typing import Any

import xgrammar as xgr
from pagoda.engine.structured_output.spec import GrammarSpec, choice_ebnf

COMPILED_CACHE_BYTES = 256 << 20
# json_object (OpenAI's JSON mode) is an object with any members, not any JSON value.
ANY_OBJECT = '{"type": "object"}'
# Repetition bounds beyond this are refused at the door: compile time grows with them (a string of at least
# 3,000 characters took 2.5 s, alone on the compile thread, holding every other grammar back).
MAX_REPETITION = 1024
_REPETITION = re.compile(r"\{(\d+), (-?\d+)\}")
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[17:16:08] /project/cpp/x.cc:83: " before the reason


def _reason(exc: Exception) -> str:
    return _LOCATION.sub("", str(exc).strip()).strip()


def parse(spec: GrammarSpec) -> Any:
    """The grammar of ``spec`` (no vocabulary needed); ValueError with xgrammar's reason, or when a
    repetition bound exceeds MAX_REPETITION."""
    grammar = _parse(spec)
    for low, high in _REPETITION.findall(str(grammar)):
        if int(low) > MAX_REPETITION or int(high) > MAX_REPETITION:
            raise ValueError(
                f"the {spec.kind} repeats something {max(int(low), int(high))} times; at most "
                f"{MAX_REPETITION} can be compiled in reasonable time"
            )
    return grammar


def _parse(spec: GrammarSpec) -> Any:
    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema(ANY_OBJECT, any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choices()))
        return xgr.Grammar.from_ebnf(spec.value)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"the {spec.kind} cannot be compiled: {_reason(exc)}") from exc


class XGrammarBackend:
    """One vocabulary's compiler, its cache and the matchers of its compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILED_CACHE_BYTES)
        self.words = (vocab_size + 31) // 32  # int32 words of one row of a token bitmask

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar (the compiler's cache is keyed by the grammar's text)."""
        return self.compiler.compile_grammar(parse(spec))

    def matcher(self, compiled: Any) -> Any:
        return xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)

    def fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def cache_bytes(self) -> int:
        return int(self.compiler.get_cache_size_bytes())
