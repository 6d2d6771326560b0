"""The C signatures of every exported kernel, as ctypes types: the one table the loader types a library with.

Keep in step with the definitions in the .c files (tests/kernels/test_cpu_library.py compares each entry
with the C prototype). Pointers are passed as ``data_ptr()`` integers, so they are plain ``c_void_p``.
"""

from __future__ import annotations

import ctypes

P, I64, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float  # noqa: E741

# q, q_stride, k_cache, v_cache, [k_scales, v_scales,] block_tables, bt_stride, seq_lens, seq_idx, tok_rows,
# n, out, out_stride, H, Hkv, D, bs, scale, window, logit_softcap (0 = off), sinks ([H] float32 or NULL), nthreads
_DECODE = [P, I64, P, P, P, I64, P, P, P, I, P, I64, I, I, I, I, F, I, F, P, I]
_DECODE_I8 = [P, I64, P, P, P, P, P, I64, P, P, P, I, P, I64, I, I, I, I, F, I, F, P, I]
# q, q_stride, k_cache, v_cache, block_tables, bt_stride, seq_idx, starts, qlens, ctx_lens, n, out, out_stride,
# H, Hkv, D, bs, scale, window, logit_softcap (0 = off), sinks ([H] float32 or NULL), scratch,
# scratch_per_thread, nthreads
_PREFILL = [P, I64, P, P, P, I64, P, P, P, P, I, P, I64, I, I, I, I, F, I, F, P, P, I64, I]
# out, residual, x, w, T, n, x_stride, out_stride, res_stride, eps, nthreads
_RMS_NORM = [P, P, P, P, I64, I64, I64, I64, I64, F, I]
# x, T, x_stride, nheads, D, cos, sin, nthreads
_ROTARY = [P, I64, I64, I, I, P, P, I]
# out, gate_up, T, I, gu_stride, out_stride, nthreads
_SILU_MUL = [P, P, I64, I64, I64, I64, I]

# x, x_stride, y, y_stride, a, in_features, width, b_ptrs, slice_offsets, slice_sizes, nslices, rank,
# seg_starts, seg_lens, seg_slots, nseg, nthreads
_LORA = [P, I64, P, I64, P, I64, I64, P, P, P, I, I64, P, P, P, I, I]

# name -> (restype, argtypes)
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "pagoda_cpu_variant": (ctypes.c_char_p, []),
    "pagoda_cpu_features": (I, []),
    "pagoda_paged_decode_f32": (I, _DECODE),
    "pagoda_paged_decode_bf16": (I, _DECODE),
    "pagoda_paged_decode_i8": (I, _DECODE_I8),
    "pagoda_paged_prefill_f32": (I, _PREFILL),
    "pagoda_paged_prefill_bf16": (I, _PREFILL),
    "pagoda_add_rms_norm": (None, _RMS_NORM),
    "pagoda_add_rms_norm_bf16": (None, _RMS_NORM),
    "pagoda_rotary": (None, _ROTARY),
    "pagoda_rotary_bf16": (None, _ROTARY),
    "pagoda_silu_mul": (None, _SILU_MUL),
    "pagoda_silu_mul_bf16": (None, _SILU_MUL),
    "pagoda_lora_f32": (None, _LORA),
    "pagoda_lora_bf16": (None, _LORA),
    # x, N, V, ld, want, ids, lp, nthreads
    "pagoda_greedy": (None, [P, I64, I64, I64, P, P, P, I]),
    # x, M, K, x_stride, w, N, w_stride, y, y_stride, nthreads
    "pagoda_small_rows_f32": (I, [P, I64, I64, I64, P, I64, I64, P, I64, I]),
    "pagoda_small_rows_bf16w": (I, [P, I64, I64, I64, P, I64, I64, P, I64, I]),
    # x (bfloat16), M, K, x_stride, w (bfloat16), N, w_stride, y, y_stride, y_bf16, nthreads
    "pagoda_small_rows_bf16dp": (I, [P, I64, I64, I64, P, I64, I64, P, I64, I, I]),
    "pagoda_cpu_has_bf16_dot": (I, []),
    # x, M, K, x_stride, w (GGUF blocks), N, w_stride (bytes), ggml type, y, y_stride, nthreads
    "pagoda_gguf_linear": (I, [P, I64, I64, I64, P, I64, I64, I, P, I64, I]),
    # the same with x quantized to int8 per 32 values (Q4_0, Q4_1, Q8_0 only: quant_gguf_q8act.c)
    "pagoda_gguf_linear_q8": (I, [P, I64, I64, I64, P, I64, I64, I, P, I64, I]),
    # want (-1 asks, 0 off, 1 on where the CPU has it) -> whether the int8 product takes AVX512-VNNI
    "pagoda_gguf_q8_vnni": (I, [I]),
    # x, M, K, x_stride, q (int8 [M, K]), d (float32 [M, K / 32])
    "pagoda_gguf_quantize_q8": (I, [P, I64, I64, I64, P, P]),
    # w, N, K, w_stride (bytes), ggml type, out, out_stride, nthreads
    "pagoda_gguf_dequantize": (I, [P, I64, I64, I64, I, P, I64, I]),
}

FEATURE_PREFILL = 1  # pagoda_cpu_features() bit: the causal prefill kernel is compiled in
FEATURE_SMALL_ROWS = 2  # pagoda_cpu_features() bit: the vector small-rows product is compiled in
FEATURE_BF16_DOT = 4  # pagoda_cpu_features() bit: pagoda_small_rows_bf16dp runs here (AVX512-BF16)
