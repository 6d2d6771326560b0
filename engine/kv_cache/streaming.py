"""Attention sinks (StreamingLLM): which requests keep sinks + a recent window, and how many tokens each.

Resolved once at the door from the request's own fields and the server's flags, so a bad combination is a
400 there and never an exception inside the engine step. The scheduler then frees whole blocks between the
sinks and the window whenever a sequence's cache would exceed ``budget`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine.config import DEFAULT_STREAMING_MAX_TOKENS


@dataclass(frozen=True)
class StreamingDefaults:
    """The server-wide flags (--kv-eviction, --kv-sink-tokens, --kv-window-tokens, --kv-eviction-per-request,
    --kv-eviction-max-tokens)."""

    kv_eviction: str = "none"
    kv_sink_tokens: int = 16
    kv_window_tokens: int | None = None
    per_request: bool = True  # a request may opt in with kv_eviction: "streaming"
    max_tokens: int = (
        DEFAULT_STREAMING_MAX_TOKENS  # of a streaming request (never below what the context leaves)
    )
    # Why no request may stream on this engine whatever the flags say ("": none): a KV cache with a window
    # group (sliding layers) keeps no sinks.
    refused: str = ""


@dataclass(frozen=True)
class StreamingPlan:
    """sink: tokens kept for good (whole blocks); budget: most tokens of a sequence's block table (sinks +
    window; the sinks as written take ``sink`` more)."""

    sink: int
    budget: int

    @property
    def as_tuple(self) -> tuple[int, int]:
        return (self.sink, self.budget)


def resolve_streaming(
    params: object,
    defaults: StreamingDefaults,
    max_model_len: int,
    block_size: int,
    prompt_len: int,
    max_tokens: int | None = None,
) -> StreamingPlan | None:
    """The request's streaming plan, or None when it stops at max_model_len as usual. Raises ValueError
    naming the field on what the server does not allow (an opt-in it forbids, ``max_tokens`` past its cap)
    and on sizes that cannot work (window under two blocks, sinks + window past max_model_len, a prompt that
    does not fit the budget)."""
    asked = getattr(params, "kv_eviction", None)
    if asked == "streaming" and defaults.refused:
        raise ValueError(f'kv_eviction "streaming" is not allowed on this server: {defaults.refused}')
    if asked == "streaming" and defaults.kv_eviction != "streaming" and not defaults.per_request:
        raise ValueError(
            'kv_eviction "streaming" is not allowed on this server (it runs with --no-kv-eviction-per-request): '
            "a request stops at max-model-len"
        )
    mode = asked or defaults.kv_eviction
    if mode != "streaming":
        return None
    cap = max(defaults.max_tokens, max_model_len - prompt_len)
    if max_tokens is not None and max_tokens > cap:
        raise ValueError(
            f"max_tokens must be at most {cap} for a request under streaming KV eviction on this server "
            f"(--kv-eviction-max-tokens), got {max_tokens}"
        )
    sink_req = getattr(params, "kv_sink_tokens", None)
    sink_tokens = defaults.kv_sink_tokens if sink_req is None else sink_req
    sink = -(-sink_tokens // block_size) * block_size
    window_req = getattr(params, "kv_window_tokens", None)
    window = defaults.kv_window_tokens if window_req is None else window_req
    # The sinks take their blocks twice: as written, and rotated to follow the window (manager.drop_blocks).
    if window is None:
        window = max_model_len - 2 * sink
    if window < 2 * block_size:
        raise ValueError(
            f"kv_window_tokens must be at least two blocks ({2 * block_size} tokens) after twice the {sink} "
            f"sink tokens within max_model_len {max_model_len}, got {window}"
        )
    budget = sink + window
    if budget + sink > max_model_len:
        raise ValueError(
            f"kv_window_tokens plus twice the sink tokens (2 x {sink}, whole blocks of {block_size}: the sinks "
            f"as written and as rotated to follow the window) must not exceed max_model_len {max_model_len}, "
            f"got {window}"
        )
    if prompt_len >= budget:
        raise ValueError(
            f"This model's maximum context length for a streaming request is {budget} tokens (sinks + window); "
            f"the prompt has {prompt_len} tokens (at least one token must be left for the output)"
        )
    return StreamingPlan(sink, budget)
