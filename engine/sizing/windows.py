"""What a KV cache that knows sliding windows would hold, next to what the engine's cache holds today.

The engine keeps every layer's blocks for every token of a sequence (full-attention layout), so the planner
sizes with `ModelShape.kv_bytes_per_token`. A hybrid cache (vLLM's hybrid KV-cache manager) frees, for a
sliding layer, the blocks that have left its window: such a layer holds at most `window + one block` tokens
of a sequence. This module computes both layouts per sequence, so the planner can say what the hybrid cache
would admit (a labelled estimate, not what the engine allocates) and the issue's capacity target can be
checked (tests/sizing/test_windows.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine.sizing.shapes import ModelShape


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def sliding_layers(shape: ModelShape) -> int:
    """How many layers slide: none without a window, all when the shape does not say which."""
    if not shape.sliding_window:
        return 0
    return shape.num_layers if shape.sliding_window_layers is None else shape.sliding_window_layers


def layer_tokens_held(shape: ModelShape, context: int, block_size: int, *, sliding: bool) -> int:
    """KV tokens one layer keeps for a sequence of `context` tokens, in whole blocks: all of them for a
    full-attention layer, at most the window plus one block (the partly filled one) for a sliding layer."""
    tokens = context
    if sliding and shape.sliding_window:
        tokens = min(shape.sliding_window + block_size, context)
    return _ceil_div(tokens, block_size) * block_size


def sequence_kv_bytes(
    shape: ModelShape,
    context: int,
    block_size: int,
    *,
    kv_dtype: str | None = "auto",
    tp: int = 1,
    window_aware: bool,
) -> int:
    """KV bytes one sequence of `context` tokens occupies on the rank with the most KV heads: every layer
    for every token (window_aware False: the engine today), or sliding layers only for their window."""
    per_layer = shape.kv_bytes_per_token(kv_dtype, tp) // shape.num_layers  # one token, one layer
    sliding = sliding_layers(shape) if window_aware else 0
    full = shape.num_layers - sliding
    held = full * layer_tokens_held(shape, context, block_size, sliding=False) + sliding * layer_tokens_held(
        shape, context, block_size, sliding=True
    )
    return held * per_layer


@dataclass(frozen=True)
class WindowCapacity:
    """Concurrent sequences of one length a KV budget holds in each layout."""

    context: int
    kv_cache_bytes: int
    full_attention_sequences: int  # what the engine's cache holds (every layer keeps every block)
    window_aware_sequences: int  # what a cache freeing out-of-window blocks would hold

    @property
    def ratio(self) -> float:
        return self.window_aware_sequences / max(self.full_attention_sequences, 1)


def window_capacity(
    shape: ModelShape,
    kv_cache_bytes: int,
    context: int,
    block_size: int,
    *,
    kv_dtype: str | None = "auto",
    tp: int = 1,
) -> WindowCapacity:
    """Sequences of `context` tokens that `kv_cache_bytes` (one rank's KV budget) holds in both layouts."""
    full = sequence_kv_bytes(shape, context, block_size, kv_dtype=kv_dtype, tp=tp, window_aware=False)
    aware = sequence_kv_bytes(shape, context, block_size, kv_dtype=kv_dtype, tp=tp, window_aware=True)
    return WindowCapacity(context, kv_cache_bytes, kv_cache_bytes // full, kv_cache_bytes // aware)
