"""reshape_and_cache: write the step's new K and V into their cache slots, quantizing for FP8 and INT8 caches.

INT8: one scale per token and KV head (amax / 127), written to the scales tensor beside the cache at the
same slot; values rounded to nearest (ties to even, by the float32 add trick the torch twin uses too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagoda.kernels.launch_config import cache_write_config
from pagoda.kernels.reference import is_fp8, is_int8
from pagoda.kernels.runtime import (
    check_int8_scales,
    check_launchable,
    device_limits,
    heads_layout,
    launch,
    next_power_of_2,
)
from pagoda.kernels.scores import head_lanes

# Integers kept out of Triton's specialization, as in paged_decode.
DYNAMIC_ARGS = ["k_row_heads", "v_row_heads", "num_slots", "num_kv_heads"]


@triton.jit
def _quantize_rows_int8(x):
    """[rows, dim] float32 -> (int8 values, float32 scale per row); the twin of `reference.quantize_int8`."""
    scale = tl.max(tl.abs(x), 1) * (1.0 / 127.0)
    nonzero = scale > 0
    inv = tl.where(
        nonzero, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), tl.where(nonzero, scale, 1.0)), 0.0
    )
    y = x * inv[:, None]
    y = (y + 12582912.0) - 12582912.0  # round to nearest, ties to even (|y| <= 127)
    y = tl.clamp(y, -127.0, 127.0)
    return y.to(tl.int8), scale


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    kv_ptr,
    scales_ptr,  # INT8: [2, num_blocks, block_size, num_kv_heads] float32 (else unused)
    slot_ptr,
    inv_k_scale,
    inv_v_scale,
    k_row_heads,  # k.stride(0) / HEAD_DIM: rows are whole heads apart, heads HEAD_DIM apart
    v_row_heads,
    num_slots,  # num_blocks * block_size: the K half of the cache holds num_slots x num_kv_heads rows
    num_kv_heads,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    QUANTIZE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INT8: tl.constexpr,
):
    # One program per token: all its heads in one contiguous store (heads x dim are adjacent in a slot).
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # a padding token
        return
    h = tl.arange(0, HEADS_PAD)
    d, d_ok = head_lanes(HEAD_DIM, HEAD_DIM_PAD)
    mask = (h < num_kv_heads)[:, None] & d_ok[None, :]
    # padding lanes read as 0: an INT8 row's amax must not see them
    k = tl.load(k_ptr + (t * k_row_heads + h[:, None]) * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + (t * v_row_heads + h[:, None]) * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    dst = kv_ptr + (slot * num_kv_heads + h[:, None]) * HEAD_DIM + d[None, :]
    scales_v_offset = num_slots.to(tl.int64) * num_kv_heads  # K half of the scales to its V half
    v_offset = scales_v_offset * HEAD_DIM
    if INT8:
        s_dst = scales_ptr + slot * num_kv_heads + h
        k_q, k_s = _quantize_rows_int8(k.to(tl.float32))
        v_q, v_s = _quantize_rows_int8(v.to(tl.float32))
        tl.store(dst, k_q, mask=mask)
        tl.store(dst + v_offset, v_q, mask=mask)
        tl.store(s_dst, k_s, mask=h < num_kv_heads)
        tl.store(s_dst + scales_v_offset, v_s, mask=h < num_kv_heads)
        return
    if QUANTIZE:
        k = tl.clamp(k.to(tl.float32) * inv_k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) * inv_v_scale, -FP8_MAX, FP8_MAX)
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + v_offset, v.to(kv_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], any row/head strides, unit dim stride
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [T] int64, block_id * block_size + offset; negative = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_scales: torch.Tensor | None = None,  # INT8 caches: [2, num_blocks, block_size, num_kv_heads] float32
) -> None:
    """Triton twin of `reference.reshape_and_cache_ref`."""
    check_launchable(kv_cache, "kv_cache")
    num_tokens, num_kv_heads, head_dim = k.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not match k {tuple(k.shape)}: "
            "expected [2, num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    k, v = heads_layout(k, head_dim), heads_layout(v, head_dim)
    config = cache_write_config(device_limits(k.device))
    quantize = is_fp8(kv_cache.dtype)
    int8 = is_int8(kv_cache.dtype)
    if int8:
        check_int8_scales(kv_cache, kv_scales)
    launch(
        _reshape_and_cache_kernel,
        (num_tokens,),
        k,
        v,
        kv_cache,
        kv_scales if int8 else kv_cache,
        slot_mapping,
        1.0 / k_scale,
        1.0 / v_scale,
        k.stride(0) // head_dim,
        v.stride(0) // head_dim,
        kv_cache.shape[1] * kv_cache.shape[2],
        num_kv_heads,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        QUANTIZE=quantize,
        FP8_MAX=torch.finfo(kv_cache.dtype).max if quantize else 0.0,
        INT8=int8,
        num_warps=config.num_warps,
        # INT8 rounds x * (1 / scale) by adding and subtracting 1.5 * 2**23: fused into one FMA the product
        # is never rounded, and some values land one step off the torch twin's (seen on an H100)
        enable_fp_fusion=False,
        shared_memory_bound=config.shared_memory,
    )
