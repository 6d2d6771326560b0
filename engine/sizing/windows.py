"""What a KV cache that knows sliding windows holds, next to a full-attention layout of the same memory.

A full-attention layout keeps every layer's blocks for every token of a sequence (`ModelShape.kv_bytes_per_token`).
The engine's window group (engine/kv_cache/manager.py, split by kv_split.py) frees, for a sliding layer, the
blocks that have left its window: such a layer holds at most `window + one block` tokens of a sequence. This
module computes both layouts per sequence from a model shape, for the planner's note and the issue's capacity
target (tests/sizing/test_windows.py); `shape_layout` gives the planner the engine's split.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine.sizing.kv_split import SlidingLayout, sliding_layout
from pagoda.engine.sizing.shapes import ModelShape


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def sliding_layers(shape: ModelShape) -> int:
    """How many layers slide: none without a window, all when the shape does not say which."""
    if not shape.sliding_window:
        return 0
    return shape.num_layers if shape.sliding_window_layers is None else shape.sliding_window_layers


def shape_windows(shape: ModelShape) -> list[int | None]:
    """Per-layer windows of a model shape, as `ModelConfig.layer_sliding_window` gives them (which layers
    slide does not change any size, only how many: the first ones stand for them)."""
    n = sliding_layers(shape)
    return [shape.sliding_window if i < n else None for i in range(shape.num_layers)]


def shape_layout(shape: ModelShape) -> SlidingLayout | None:
    """The engine's window group for a model shape, whatever the flags (engine_sliding_layout adds them)."""
    return sliding_layout(shape_windows(shape))


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
    full_attention_sequences: int  # every layer keeps every block (no window group)
    window_aware_sequences: int  # sliding layers keep their window only (before the window pool's reserve)

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
