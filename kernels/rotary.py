"""Rotary embedding applied in place to the query and key heads of the fused QKV output: one launch for
both, instead of a neg, a cat and three multiply-adds per tensor.

Rotate-half (GPT-NeoX) convention, as `pagoda.engine.models.layers.apply_rotary`: each head's halves
(x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin), with cos and sin the token's row of the rotary table
(its position's, gathered once per step for every layer: [T, head_dim], the halves' columns each read
their own). The twin is `reference.rotary_ref`: float32 math, rounded once to the activation dtype.

One program per (token, BLOCK_H heads). A row of x holds the heads side by side (q's, then k's, then v's,
which are left alone); the row stride enters in whole heads, so a variant depends on the head dim, the
dtype and the launch configuration only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagoda.kernels.launch_config import rotary_config
from pagoda.kernels.runtime import check_launchable, device_limits, launch, next_power_of_2

DYNAMIC_ARGS = ["row_heads", "nheads"]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _rotary_kernel(
    x_ptr,  # [T, row_heads * HEAD_DIM]: the first nheads heads of each row are rotated in place
    cos_ptr,  # [T, HEAD_DIM] contiguous
    sin_ptr,
    row_heads,
    nheads,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,  # HEAD_DIM // 2, padded to a power of two
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF_PAD)
    half: tl.constexpr = HEAD_DIM // 2
    d_mask = d < half
    mask = (h < nheads)[:, None] & d_mask[None, :]
    first = x_ptr + (t * row_heads + h[:, None]) * HEAD_DIM + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    table = t * HEAD_DIM + d
    c1 = tl.load(cos_ptr + table, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + table + half, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + table, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + table + half, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    dtype = x_ptr.dtype.element_ty
    tl.store(first, (x1 * c1 - x2 * s1).to(dtype), mask=mask)
    tl.store(first + half, (x2 * c2 + x1 * s2).to(dtype), mask=mask)


def rotary_(x: torch.Tensor, nheads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first ``nheads`` heads of each row of ``x`` [T, >= nheads * head_dim] in place with the
    tokens' cos/sin rows [T, head_dim] (any dtype; read as float32)."""
    check_launchable(x, "x")
    if x.dim() != 2 or x.stride(1) != 1 or x.stride(0) % head_dim or x.shape[1] < nheads * head_dim:
        raise ValueError(
            f"x {tuple(x.shape)} with strides {x.stride()} is not rows of at least {nheads} heads of {head_dim}"
        )
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x is {x.dtype}; the rotary kernel takes {DTYPES}")
    num_tokens = x.shape[0]
    if cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(
            f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [{num_tokens}, {head_dim}]"
        )
    if num_tokens == 0 or nheads == 0:
        return
    cos, sin = cos.contiguous(), sin.contiguous()
    config = rotary_config(device_limits(x.device), head_dim)
    launch(
        _rotary_kernel,
        (num_tokens, triton.cdiv(nheads, config.block)),
        x,
        cos,
        sin,
        x.stride(0) // head_dim,
        nheads,
        HEAD_DIM=head_dim,
        HALF_PAD=next_power_of_2(head_dim // 2),
        BLOCK_H=config.block,
        num_warps=config.num_warps,
        shared_memory_bound=config.shared_memory,
    )
