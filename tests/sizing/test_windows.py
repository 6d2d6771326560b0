"""Sliding-window capacity: what the engine's full-attention KV layout holds next to a window-aware one.

The issue's target (item 2): on a Gemma-3-27B shape at 32k context the window-aware cache admits at least 4x
the concurrent sequences of the full-attention layout of the same memory. The engine's window group
(engine/kv_cache/manager.py) frees out-of-window blocks; the planner, the engine's start-up plan and the dry
run split the KV budget between its two pools with one function (engine/sizing/kv_split.py); these tests pin
that arithmetic and the numbers it gives.
"""

from __future__ import annotations

from pagoda.engine.sizing import Hints, gpu_info, plan, well_known_shape
from pagoda.engine.sizing.kv_split import engine_sliding_layout, split_kv_blocks, window_blocks_per_sequence
from pagoda.engine.sizing.windows import (
    layer_tokens_held,
    sequence_kv_bytes,
    shape_layout,
    sliding_layers,
    window_capacity,
)

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


def test_the_plan_admits_what_the_window_group_holds() -> None:
    """The same H100 budget split as the engine splits it: 1,049 window blocks (12 sequences x 66 + the null
    block + a 4,096-token chunk's 256) for the 52 sliding layers, 25,483 blocks for the 10 global ones
    (12 x 2,048 for 32k sequences, the rest spare): 12 sequences of 32k at once against 2, 6x."""
    p = plan(GEMMA_3_27B, gpu_info("H100", 1), Hints(target_context=CONTEXT))
    (note,) = [w for w in p.warnings if "sliding window" in w]
    assert "1024-token sliding window on 52 of 62 layers" in note
    assert "12 sequences of 32768 tokens fit at once, against 2 in a full-attention layout" in note
    assert (p.num_window_blocks, p.window_sequences, p.max_num_batched_tokens) == (1049, 12, 4096)
    assert 1049 == 1 + 4096 // 16 + 12 * window_blocks_per_sequence(1024, 16)
    split = split_kv_blocks(
        p.kv_cache_bytes, p.kv_bytes_per_token, 16, CONTEXT, p.max_num_seqs, 4096, shape_layout(GEMMA_3_27B)
    )
    assert (split.num_blocks, split.num_window_blocks, split.sequences) == (25483, 1049, 12)
    assert split.num_blocks >= 12 * CONTEXT // 16 and split.allocated_bytes <= p.kv_cache_bytes
    assert split.sequences / (p.kv_cache_bytes // (CONTEXT * p.kv_bytes_per_token)) >= 4
    assert "12 sequences of 32768 tokens fit at once" in p.reasons["max_num_seqs"]
    # the window group runs without offload tiers: the plan renders none
    assert (p.kv_offload_host_bytes, p.kv_offload_disk_bytes) == (0, 0)
    # bfloat16 KV (quality first): 5 against 1
    q = plan(GEMMA_3_27B, gpu_info("H100", 1), Hints(target_context=CONTEXT, quality_first=True))
    assert (q.kv_cache_dtype, q.window_sequences) == ("auto", 5)
    assert "5 sequences of 32768 tokens fit at once, against 1 in" in q.warnings[-1]


def test_the_split_keeps_one_pool_where_a_window_gains_nothing() -> None:
    layout = shape_layout(GEMMA_3_27B)
    assert layout is not None and (layout.window, len(layout.sliding), layout.num_layers) == (1024, 52, 62)
    one = split_kv_blocks(10 << 30, 253_952, 16, 1024, 256, 2048, layout)  # context within the window
    assert one.num_window_blocks == 0 and one.num_blocks == (10 << 30) // (253_952 * 16)
    assert split_kv_blocks(10 << 30, 253_952, 16, CONTEXT, 256, 2048, None).num_window_blocks == 0
    # a budget too small for one sequence in both pools keeps the full layout
    assert split_kv_blocks(200 << 20, 253_952, 16, CONTEXT, 256, 2048, layout).num_window_blocks == 0
    # max_num_seqs caps the window pool; the full pool takes the rest
    capped = split_kv_blocks(20 << 30, 253_952, 16, CONTEXT, 2, 2048, layout)
    assert capped.sequences == 2 and capped.num_window_blocks == 1 + 128 + 2 * 66
    # no layer sliding (Qwen3): one pool
    assert shape_layout(well_known_shape("Qwen3-8B")) is None


MISTRAL_7B = well_known_shape("Mistral-7B-v0.1")


def test_an_all_sliding_model_gets_the_window_group_with_a_bookkeeping_full_pool() -> None:
    """Mistral-7B-v0.1 (a 4,096-token window on all 32 layers): the window pool takes the whole budget and
    the full group's pool, which holds no KV, is sized never to bind."""
    layout = shape_layout(MISTRAL_7B)
    assert layout is not None and (layout.window, len(layout.sliding), layout.num_layers) == (4096, 32, 32)
    per_token = MISTRAL_7B.kv_bytes_per_token("auto")  # 131,072 B: 32 layers x 8 KV heads x 128 x 2 x 2
    split = split_kv_blocks(10 << 30, per_token, 16, CONTEXT, 256, 2048, layout)
    assert (split.block_bytes, split.window_block_bytes) == (0, per_token * 16)
    assert split.num_window_blocks == (10 << 30) // (per_token * 16) == 5120
    assert split.allocated_bytes == 5120 * per_token * 16
    # sequences of 32k at once: (5,120 - the null block - a 2,048-token chunk) // 258 window blocks each
    assert split.sequences == (5120 - 1 - 128) // window_blocks_per_sequence(4096, 16) == 19
    # every sequence holding >= 256 window blocks once past the window: 5,119 // 256 x 2,049 full blocks at most
    assert split.num_blocks >= (5119 // 256) * 2049 and split.num_blocks == 5119 * 9 + 2049
    # the dry run of one model a full layout would give: 10 GiB / 2 MiB = 5,120 blocks, 2 sequences of 32k
    assert 5120 // (CONTEXT // 16) == 2


def test_mistral_7b_at_32k_plans_and_dry_runs_with_the_window_group() -> None:
    """One H100 (bfloat16 weights) at 32k: the plan admits 222 sequences with FP8 KV against 28 in a full
    layout, 109 against 14 in bfloat16; the dry run (max_num_seqs 256) 114 against 14 and 228 against 28; on
    an L4 the plan admits 20 against 2 (FP8), the dry run 11 against 1 and 23 against 3."""
    import json

    from pagoda.engine.cli.dry_run import check, shape_config

    p = plan(MISTRAL_7B, gpu_info("H100", 1), Hints(target_context=CONTEXT))
    assert (p.kv_cache_dtype, p.max_model_len, p.window_sequences) == ("fp8", CONTEXT, 222)
    assert "222 sequences of 32768 tokens fit at once, against 28 in a full-attention layout" in " ".join(
        p.warnings
    )
    assert "every layer keeps only its window" in p.reasons["max_num_seqs"]
    q = plan(MISTRAL_7B, gpu_info("H100", 1), Hints(target_context=CONTEXT, quality_first=True))
    assert (q.kv_cache_dtype, q.window_sequences) == ("auto", 109)
    assert plan(MISTRAL_7B, gpu_info("L4", 1), Hints(target_context=CONTEXT)).window_sequences == 20
    # requests of 1,200 tokens: max_num_seqs from the window pool (5,599 blocks of 16), not the full group's
    # bookkeeping blocks
    hinted = plan(
        MISTRAL_7B,
        gpu_info("L4", 1),
        Hints(target_context=CONTEXT, p50_prompt_tokens=1000, p50_output_tokens=200),
    )
    assert hinted.max_num_seqs == 5599 * 16 // 1200 == 74
    common = ["/models/mistral", "--model-shape", json.dumps(shape_config(MISTRAL_7B)), "--max-model-len"]
    got = {}
    for kv in ("auto", "fp8"):
        for mode in ("auto", "off"):
            report = check(
                [*common, "32768", "--gpu", "H100", "--kv-cache-dtype", kv, "--sliding-window-cache", mode]
            )
            d = report.plan
            got[kv, mode] = (d.num_window_blocks, d.sequences_at_max_len)
            assert d.profile.kv_allocated_bytes <= d.profile.kv_cache_bytes
            assert ("32 of 32 layers" if mode == "auto" else "off") in report.device["window_cache"]
    assert got == {
        ("auto", "auto"): (29589, 114),
        ("auto", "off"): (0, 14),
        ("fp8", "auto"): (59178, 228),
        ("fp8", "off"): (0, 28),
    }
    on_l4 = {}
    for kv in ("auto", "fp8"):
        for mode in ("auto", "off"):
            args = [*common, "32768", "--gpu", "L4", "--kv-cache-dtype", kv, "--sliding-window-cache", mode]
            on_l4[kv, mode] = check(args).plan.sequences_at_max_len
    assert on_l4 == {("auto", "auto"): 11, ("auto", "off"): 1, ("fp8", "auto"): 23, ("fp8", "off"): 3}


def test_the_engine_and_the_dry_run_decide_the_window_group_alike() -> None:
    from pagoda.engine.config import EngineConfig

    windows = [1024, None, 1024]
    layout, why = engine_sliding_layout(EngineConfig(), windows)
    assert layout is not None and layout.sliding == (0, 2) and "2 of 3 layers" in why
    for change, word in (
        ({"sliding_window_cache": "off"}, "--sliding-window-cache off"),
        ({"kv_offload_host_bytes": 1 << 30}, "offload"),
        ({"kv_eviction": "streaming"}, "streaming"),
        ({"preemption_mode": "swap"}, "swap"),
    ):
        layout, why = engine_sliding_layout(EngineConfig(**change), windows)
        assert layout is None and word in why
    assert engine_sliding_layout(EngineConfig(), [None, None])[0] is None
    assert engine_sliding_layout(EngineConfig(), [512, 1024, None])[0].window == 1024  # the largest


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
    assert f"sequences of 8192 tokens fit at once, against {cap.full_attention_sequences} in" in note
    assert "on 21 of 42 layers" in note
    assert p.window_sequences > cap.full_attention_sequences > 0 and p.num_window_blocks > 0


def test_the_dry_run_sizes_the_window_group_as_the_engine_does() -> None:
    """`pagoda serve --dry-run` for Gemma-3-27B at 32k on an H100 (bfloat16 weights, max_num_seqs 256, a
    2,048-token step): 6 sequences of 32k at once against 1 with bfloat16 KV, 13 against 2 with FP8."""
    import json

    from pagoda.engine.cli.dry_run import check, shape_config

    config = shape_config(GEMMA_3_27B)
    common = ["/models/gemma-3-27b", "--model-shape", json.dumps(config), "--max-model-len", "32768"]
    common += ["--gpu", "H100"]
    got = {}
    for kv in ("auto", "fp8"):
        for mode in ("auto", "off"):
            report = check([*common, "--kv-cache-dtype", kv, "--sliding-window-cache", mode])
            p = report.plan
            got[kv, mode] = (p.num_blocks, p.num_window_blocks, p.sequences_at_max_len)
            assert ("52 of 62 layers" if mode == "auto" else "off") in report.device["window_cache"]
            assert p.profile.kv_allocated_bytes <= p.profile.kv_cache_bytes
    assert got == {
        ("auto", "auto"): (14341, 525, 6),
        ("auto", "off"): (2753, 0, 1),
        ("fp8", "auto"): (29011, 987, 13),
        ("fp8", "off"): (5507, 0, 2),
    }
    assert 525 == 1 + 2048 // 16 + 6 * window_blocks_per_sequence(1024, 16)
