"""`--speculative-config`: vLLM's JSON, read and checked at the door.

Keys as vLLM names them: ``method`` ("ngram" or "draft_model"; a ``model`` of "ngram" means the n-gram
proposer, any other model a draft model), ``num_speculative_tokens``, ``prompt_lookup_min`` /
``prompt_lookup_max`` (n-gram; both default to 5 when neither is given, one given sets the other),
``num_speculative_tokens_per_batch_size`` ([start, end, k] rows: k proposed tokens while the batch size
is in [start, end], none outside every row), ``quantization`` (draft model: "gguf" keeps a GGUF draft's
blocks quantized, as --quantization gguf does for the target). Pagoda's own default for that schedule turns speculation off
above ``DEFAULT_MAX_BATCH`` sequences: a full batch is compute-bound, and scoring guesses there costs
more than the weight reads it saves. Unknown keys are refused, not dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
DEFAULT_LOOKUP = 5  # vLLM's default n-gram size when neither bound is given
DEFAULT_MAX_BATCH = 4  # speculation is off above this many running sequences unless a schedule says otherwise
MAX_SPECULATIVE_TOKENS = 16
_KNOWN = {
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "num_speculative_tokens_per_batch_size",
    "quantization",
}
DRAFT_QUANTIZATION = ("gguf",)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    model: str | None = None
    quantization: str | None = None  # the draft's: "gguf" or None
    # (first batch size, last batch size, k): k tokens while the running batch size lies in the range.
    per_batch_size: tuple[tuple[int, int, int], ...] = ()

    @property
    def max_tokens(self) -> int:
        """The most tokens a step may propose for one sequence (the exporter's per-position series)."""
        return max([self.num_speculative_tokens, *(k for _, _, k in self.per_batch_size)])

    def tokens_for_batch(self, batch_size: int) -> int:
        """How many tokens to propose per sequence when ``batch_size`` sequences are running."""
        for first, last, k in self.per_batch_size:
            if first <= batch_size <= last:
                return min(k, self.num_speculative_tokens)
        return 0


def _int(obj: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
        span = f"from {low} to {high}" if high else f"of at least {low}"
        raise ValueError(f"speculative config: {key} must be an integer {span}, got {value!r}")
    return value


def _schedule(raw: Any, k: int) -> tuple[tuple[int, int, int], ...]:
    if raw is None:
        return ((1, DEFAULT_MAX_BATCH, k),)
    rows = []
    for row in raw if isinstance(raw, list) else [None]:
        ok = isinstance(row, list | tuple) and len(row) == 3
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in row)
        if not ok or row[0] < 1 or row[1] < row[0]:
            raise ValueError(
                "speculative config: num_speculative_tokens_per_batch_size must be a list of "
                f"[first_batch_size, last_batch_size, tokens] rows with 1 <= first <= last, got {raw!r}"
            )
        rows.append((row[0], row[1], row[2]))
    return tuple(rows)


def parse_speculative_config(text: str | dict | None) -> SpeculativeConfig | None:
    """The config of a `--speculative-config` value (JSON text or an already-parsed dict); None for none.
    ValueError saying what is wrong otherwise."""
    if text is None or text == "" or text == {}:
        return None
    if isinstance(text, dict):
        obj = text
    else:
        try:
            obj = json.loads(text)
        except ValueError:
            raise ValueError(f"speculative config must be JSON, got {text!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"speculative config must be a JSON object, got {text!r}")
    unknown = sorted(set(obj) - _KNOWN)
    if unknown:
        raise ValueError(
            f"speculative config: unsupported key(s) {', '.join(unknown)} (Pagoda reads "
            f"{', '.join(sorted(_KNOWN))})"
        )
    method, model = obj.get("method"), obj.get("model")
    if method is None:
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model" if model else None
    if method not in METHODS:
        raise ValueError(
            f"speculative config: method must be one of {', '.join(METHODS)} (EAGLE, MTP, Medusa and "
            f"suffix decoding are not in Pagoda), got {method!r}"
        )
    k = _int(obj, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    if k is None:
        raise ValueError("speculative config: num_speculative_tokens is required")
    low, high = _int(obj, "prompt_lookup_min", 1), _int(obj, "prompt_lookup_max", 1)
    if method == "ngram":
        if low is None and high is None:
            low = high = DEFAULT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        if low > high:
            raise ValueError(
                f"speculative config: prompt_lookup_min={low} must be <= prompt_lookup_max={high}"
            )
        model = None
    else:
        if not isinstance(model, str) or not model:
            raise ValueError("speculative config: method draft_model needs model (a local checkpoint)")
        if low is not None or high is not None:
            raise ValueError("speculative config: prompt_lookup_min/max are for method ngram")
        low = high = 0
    quantization = obj.get("quantization")
    if quantization is not None and (method != "draft_model" or quantization not in DRAFT_QUANTIZATION):
        raise ValueError(
            f"speculative config: quantization is the draft model's, one of {', '.join(DRAFT_QUANTIZATION)} "
            f"(others are read from the draft's config.json), got {quantization!r} with method {method}"
        )
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        prompt_lookup_min=low,
        prompt_lookup_max=high,
        model=model,
        quantization=quantization,
        per_batch_size=_schedule(obj.get("num_speculative_tokens_per_batch_size"), k),
    )
