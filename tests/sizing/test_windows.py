"""Sliding-window capacity: what the engine's full-attention KV layout holds next to a window-aware one.

The issue's target (item 2): on a Gemma-3-27B shape at 32k context the window-aware cache admits at least 4x
the concurrent sequences of the full-attention layout of the same memory. The engine does not free
out-of-window blocks yet (issue 35's contract item 6), so the planner sizes the full layout and only reports
the other; these tests pin the arithmetic both use.
"""

from __future__ import annotations

from pagoda.engine.sizing import Hints, gpu_info, plan, well_known_shape
from pagoda.engine.sizing.windows import layer_tokens_held, sequence_kv_bytes, sliding_layers, window_capacity

GEMMA_3_27B = well_known_shape("google/gemma-3-27b-it")
CONTEXT = 32768


def test_gemma_3_27b_at_32k_on_an_h100_admits_over_4x_with_a_window_aware_cache() -> None:
    """The planner's budget for one H100-80GB: 54.0 GB of bfloat16 weights leave 4,990 blocks of 16 tokens
    (20.28 GB of FP8 KV, 253,952 B per token over 62 layers x 16 KV heads x 128 x 2).

    Full layout: 62 layers x 32,768 tokens = 8.32 GB a sequence -> 2 sequences.
    Window-aware: 10 global layers x 32,768 + 52 sliding layers x (1,024 + 16) tokens = 1.56 GB -> 12.
    Bytes per sequence 5.32x fewer; whole sequences 6x more."""
    p = plan(GEMMA_3_27B, gpu_info("H100", 1), Hints(target_context=CONTEXT))
    assert (p.tensor_parallel_size, p.kv_cache_dtype, p.block_size, p.max_model_len) == (
        1,
        "fp8",
        16,
        CONTEXT,
    )
    assert p.num_gpu_blocks == 4990 and p.kv_bytes_per_token == 253_952
    full = sequence_kv_bytes(GEMMA_3_27B, CONTEXT, 16, kv_dtype="fp8", window_aware=False)
    aware = sequence_kv_bytes(GEMMA_3_27B, CONTEXT, 16, kv_dtype="fp8", window_aware=True)
    assert full == 62 * CONTEXT * 4096 and aware == (10 * CONTEXT + 52 * 1040) * 4096
    assert round(full / aware, 2) == 5.32
    cap = window_capacity(GEMMA_3_27B, p.kv_cache_bytes, CONTEXT, 16, kv_dtype="fp8")
    assert (cap.full_attention_sequences, cap.window_aware_sequences) == (2, 12)
    assert cap.ratio >= 4
    # the same budget in bfloat16 KV (quality first): 1 against 6
    q = plan(GEMMA_3_27B, gpu_info("H100", 1), Hints(target_context=CONTEXT, quality_first=True))
    cap = window_capacity(GEMMA_3_27B, q.kv_cache_bytes, CONTEXT, 16, kv_dtype=q.kv_cache_dtype)
    assert (cap.full_attention_sequences, cap.window_aware_sequences) == (1, 6)


def test_the_plan_says_what_a_window_aware_cache_would_hold_and_that_it_is_not_allocated() -> None:
    p = plan(GEMMA_3_27B, gpu_info("H100", 1), Hints(target_context=CONTEXT))
    (note,) = [w for w in p.warnings if "sliding window" in w]
    assert "1024-token sliding window on 52 of 62 layers" in note
    assert (
        "2 sequences of 32768 tokens fit at once" in note
        and "which the engine does not yet, would hold 12" in note
    )
    # the plan itself sizes the full layout: its KV bytes per token count every layer
    assert p.kv_bytes_per_token == GEMMA_3_27B.kv_bytes_per_token("fp8")


def test_layers_hold_their_window_plus_one_block_or_the_whole_context() -> None:
    assert layer_tokens_held(GEMMA_3_27B, 500, 16, sliding=True) == 512  # shorter than the window: all of it
    assert layer_tokens_held(GEMMA_3_27B, 5000, 16, sliding=True) == 1040
    assert layer_tokens_held(GEMMA_3_27B, 5000, 16, sliding=False) == 5008
    g2 = well_known_shape("Gemma-2-27B")
    assert sliding_layers(g2) == 23 and sliding_layers(well_known_shape("Mistral-7B-v0.1")) == 32
    assert sliding_layers(well_known_shape("Qwen3-8B")) == 0
    # a window longer than the context (Phi-3.5-mini's 262,144 tokens) changes nothing
    phi = well_known_shape("Phi-3.5-mini")
    assert sequence_kv_bytes(phi, 131072, 16, window_aware=True) == sequence_kv_bytes(
        phi, 131072, 16, window_aware=False
    )


def test_tensor_parallel_ranks_count_their_own_kv_heads() -> None:
    one = sequence_kv_bytes(GEMMA_3_27B, CONTEXT, 16, window_aware=True)
    two = sequence_kv_bytes(GEMMA_3_27B, CONTEXT, 16, tp=2, window_aware=True)
    assert one == 2 * two


def test_a_cpu_plan_says_it_too() -> None:
    shape = well_known_shape("Gemma-2-9B")
    p = plan(shape, None, Hints(memory_limit_bytes=128 << 30, target_context=8192))
    (note,) = [w for w in p.warnings if "sliding window" in w]
    cap = window_capacity(shape.with_dtype("float32"), p.kv_cache_bytes, p.max_model_len, p.block_size)
    assert f"{cap.full_attention_sequences} sequences of 8192 tokens fit at once" in note
    assert f"would hold {cap.window_aware_sequences})" in note and "on 21 of 42 layers" in note
    assert cap.window_aware_sequences > cap.full_attention_sequences > 0
