"""LoRA for a batch that mixes adapters: segment-wise shrink (x @ A) and expand (h @ B), grouped by adapter.

A step's tokens that use an adapter lie in segments (start, length, slot): one program walks a tile of one
segment's tokens against that slot's matrices, so each adapter's weights are read once per tile of its own
tokens and no per-token copy of any weight is made. The base model's tokens are in no segment and cost
nothing. Twins: `reference.lora_shrink_ref` and `reference.lora_expand_ref`.

The shrink's output h is float32 (rank columns per slice, side by side); the expand adds h's slice times B
into the base layer's output in place, summing in float32 and rounding once, as the twin does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagoda.kernels.launch_config import lora_config
from pagoda.kernels.runtime import check_launchable, device_limits, dtype_name, interpreting, launch


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:  # float32 operands (or bfloat16 under the interpreter, where its dot is unreliable)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _segment_tile(seg_start_ptr, seg_slot_ptr, length, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile of its segment: the segment's first row and slot, the tile's rows (within the
    segment) and columns, and which of them exist."""
    g = tl.program_id(0)
    start = tl.load(seg_start_ptr + g).to(tl.int64)
    slot = tl.load(seg_slot_ptr + g).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    return start, slot, rows, cols, rows < length, cols < N


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [slots, K, N]
    h_ptr,  # [T, N] float32
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    x_row_stride,
    K,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    length = tl.load(seg_len_ptr + tl.program_id(0))
    if tl.program_id(1) * BLOCK_M >= length:
        return
    start, slot, rows, cols, row_ok, col_ok = _segment_tile(
        seg_start_ptr, seg_slot_ptr, length, N, BLOCK_M, BLOCK_N
    )
    x_rows = x_ptr + (start + rows)[:, None] * x_row_stride
    a_slot = a_ptr + slot * K * N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(
            a_slot + ks[:, None] * N + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )
        acc += _dot(xt, at, UPCAST)
    h_out = h_ptr + (start + rows)[:, None] * N + cols[None, :]
    tl.store(h_out, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["h_offset"])
def _lora_expand_kernel(
    h_ptr,  # [T, h_width] float32
    b_ptr,  # [slots, R, N]
    y_ptr,  # [T, y_row_stride], this slice's columns from y_ptr on
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    h_width,
    h_offset,
    y_row_stride,
    R,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    length = tl.load(seg_len_ptr + tl.program_id(0))
    if tl.program_id(1) * BLOCK_M >= length:
        return
    start, slot, rows, cols, row_ok, col_ok = _segment_tile(
        seg_start_ptr, seg_slot_ptr, length, N, BLOCK_M, BLOCK_N
    )
    h_rows = h_ptr + (start + rows)[:, None] * h_width + h_offset
    b_slot = b_ptr + slot * R * N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < R
        ht = tl.load(h_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        bt = tl.load(
            b_slot + ks[:, None] * N + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )
        acc += tl.dot(ht, bt.to(tl.float32), input_precision="ieee")
    mask = row_ok[:, None] & col_ok[None, :]
    y_tile = y_ptr + (start + rows)[:, None] * y_row_stride + cols[None, :]
    y = tl.load(y_tile, mask=mask, other=0.0)
    tl.store(y_tile, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def _check_segments(seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor) -> None:
    if not (seg_starts.shape == seg_lens.shape == seg_slots.shape) or seg_starts.dim() != 1:
        raise ValueError("seg_starts, seg_lens and seg_slots must be 1-d tensors of one length")


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """h = x @ A[slot] per segment (float32 [T, width]); rows of no segment are left as ``out`` had them
    (zeros when allocated here). ``max_seg_len`` bounds the grid (the longest segment's tokens)."""
    check_launchable(a, "a")
    _check_segments(seg_starts, seg_lens, seg_slots)
    num_tokens, k = x.shape
    if a.dim() != 3 or a.shape[1] != k or not a.is_contiguous():
        raise ValueError(f"a must be a contiguous [slots, {k}, width] tensor, got {tuple(a.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    n = a.shape[2]
    if out is None:
        out = torch.zeros((num_tokens, n), dtype=torch.float32, device=x.device)
    if seg_starts.numel() == 0 or max_seg_len == 0:
        return out
    config = lora_config(device_limits(x.device), dtype_name(x.dtype), "shrink", n)
    grid = (seg_starts.numel(), triton.cdiv(max_seg_len, config.block_m), triton.cdiv(n, config.block_n))
    launch(
        _lora_shrink_kernel,
        grid,
        x,
        a,
        out,
        seg_starts,
        seg_lens,
        seg_slots,
        x.stride(0),
        k,
        n,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        UPCAST=_upcast(x.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        shared_memory_bound=config.shared_memory,
    )
    return out


def lora_expand(
    h: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    h_offset: int = 0,
) -> None:
    """y += h[:, h_offset : h_offset + rank] @ B[slot] per segment, in place; ``y`` may be a column slice of
    a wider output (unit column stride)."""
    check_launchable(b, "b")
    _check_segments(seg_starts, seg_lens, seg_slots)
    if b.dim() != 3 or not b.is_contiguous():
        raise ValueError(f"b must be a contiguous [slots, rank, out_features] tensor, got {tuple(b.shape)}")
    rank, n = b.shape[1], b.shape[2]
    if y.shape[1] != n or y.stride(1) != 1:
        raise ValueError(f"y must be [tokens, {n}] with unit column stride, got {tuple(y.shape)}")
    if h.dtype != torch.float32 or not h.is_contiguous() or h_offset + rank > h.shape[1]:
        raise ValueError("h must be the shrink's contiguous float32 output, wide enough for this slice")
    if seg_starts.numel() == 0 or max_seg_len == 0:
        return
    config = lora_config(device_limits(y.device), dtype_name(y.dtype), "expand", rank)
    grid = (seg_starts.numel(), triton.cdiv(max_seg_len, config.block_m), triton.cdiv(n, config.block_n))
    launch(
        _lora_expand_kernel,
        grid,
        h,
        b,
        y,
        seg_starts,
        seg_lens,
        seg_slots,
        h.shape[1],
        h_offset,
        y.stride(0),
        rank,
        n,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        shared_memory_bound=config.shared_memory,
    )
