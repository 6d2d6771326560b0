"""Per-request sampling parameters, named and defaulted as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.engine.structured_output.spec import GrammarSpec

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a token's bias


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # number of top log-probabilities per generated token
    prompt_logprobs: int | None = None  # number of top log-probabilities per prompt token (vLLM's field)
    # Added to the logits before sampling (OpenAI semantics: token id -> bias in [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # What the output must match (engine/structured_output); compiled by the engine off its loop.
    structured_outputs: GrammarSpec | None = None
    skip_special_tokens: bool = True
    # Attention sinks for this request (None = the server's --kv-eviction / --kv-sink-tokens /
    # --kv-window-tokens): "streaming" keeps sinks + a recent window and may generate past max_model_len.
    kv_eviction: str | None = None
    kv_sink_tokens: int | None = None
    kv_window_tokens: int | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be at least 1")
        if self.temperature < 0:
            bad("temperature", "must be non-negative")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be greater than 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", "must be non-negative")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", "must be non-negative")
        for value in (self.logit_bias or {}).values():
            if isinstance(value, bool) or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                bad("logit_bias", f"values must be numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        if any(not s for s in self.stop):
            bad("stop", "must not contain empty strings")
        if self.kv_eviction not in (None, "none", "streaming"):
            bad("kv_eviction", "must be 'none' or 'streaming'")
        for name in ("kv_sink_tokens", "kv_window_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                bad(name, "must be a non-negative integer")

    def validate_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError naming the field when a token id lies outside [0, vocab_size).

        The schema only bounds ids by int32; an id past the vocabulary would index past the logits inside
        the engine step and fail every request in the batch, so it has to be refused at the door.
        """
        for name in ("stop_token_ids", "logit_bias"):
            ids = list(getattr(self, name) or [])
            bad = next(
                (t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size),
                None,
            )
            if bad is not None:
                raise ValueError(
                    f"{name} contains {bad!r}, which is outside the vocabulary: token ids are integers "
                    f"in [0, {vocab_size})"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
