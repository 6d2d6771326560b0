"""Paged prefill / chunked-prefill attention: the new tokens of many sequences in one launch.

One program per (sequence, tile of BLOCK_M new tokens, query head). The new tokens were written to the
cache first, so a program reads every key it needs (the cached prefix and the chunk itself) through the
block table, with online softmax over BLOCK_N-token tiles. Tiles wholly before the tile's first query need
no mask; only the last few, on the causal diagonal, are masked. Sequences are found through cu_seqlens
(`query_start_loc`), so ragged lengths share one launch; programs past a sequence's length exit at once.
INT8 caches apply their per-token scales to the score columns and probabilities (see `paged_decode`), and
a logit soft-cap (SOFTCAP) squashes the scores before the mask, as there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagoda.kernels.convert import widen
from pagoda.kernels.launch_config import DOT_MIN, prefill_config
from pagoda.kernels.runtime import (
    check_int8_scales,
    device_limits,
    dtype_name,
    launch,
    next_power_of_2,
    prepare_attention,
)
from pagoda.kernels.scores import head_lanes, softcap_scales, tanh

# Integers kept out of Triton's specialization, as in paged_decode.
DYNAMIC_ARGS = ["window", "q_row_heads", "out_row_heads", "stride_bt", "num_blocks", "num_kv_heads"]
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _paged_prefill_kernel(
    q_ptr,
    kv_ptr,
    scales_ptr,  # INT8: [2, num_blocks, block_size, num_kv_heads] float32 (else unused)
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    seq_ids_ptr,
    sinks_ptr,  # [num_heads] float32 learned sink logits (used when SINKS)
    qk_scale_log2,  # softmax scale * k_scale * log2(e); with SOFTCAP: softmax scale * k_scale / cap
    v_scale,
    softcap_log2,  # cap * log2(e) (used when SOFTCAP)
    window,
    q_row_heads,  # q.stride(0) / HEAD_DIM: rows are whole heads apart, heads HEAD_DIM apart
    out_row_heads,
    stride_bt,
    num_blocks,
    num_kv_heads,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (the lanes of a head)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INT8: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr = False,
):
    i = tl.program_id(0)
    m_tile = tl.program_id(1)
    head = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + i)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d, d_ok = head_lanes(HEAD_DIM, HEAD_DIM_PAD)
    row_mask = m < q_len
    rows = (q_start + m).to(tl.int64)
    q_mask = row_mask[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + (rows[:, None] * q_row_heads + head) * HEAD_DIM + d[None, :], mask=q_mask, other=0.0)
    q_pos = context_len + m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The cache is contiguous [2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]: its strides follow.
    stride_tok = num_kv_heads * HEAD_DIM
    stride_block = stride_tok * BLOCK_SIZE
    v_offset = num_blocks.to(tl.int64) * stride_block
    kv_base = kv_ptr + (head // GROUP).to(tl.int64) * HEAD_DIM

    first_q = context_len + m_tile * BLOCK_M  # smallest query position of this tile
    kv_hi = tl.minimum(seq_len, first_q + BLOCK_M)  # one past the largest key any row may see
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(first_q - window + 1, 0) // BLOCK_N * BLOCK_N
        unmasked_hi = kv_lo  # the window moves with each row: mask every tile
    else:
        unmasked_hi = (first_q + 1) // BLOCK_N * BLOCK_N  # keys < first_q + 1 are visible to every row

    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        block = tl.load(table + n // BLOCK_SIZE, mask=n < seq_len, other=0).to(tl.int64)
        offs = block * stride_block + (n % BLOCK_SIZE).to(tl.int64) * stride_tok
        kv_mask = (n < seq_len)[:, None] & d_ok[None, :]
        k = widen(tl.load(kv_base + offs[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if INT8:  # per-token scales, as in the decode kernel
            s_offs = (block * BLOCK_SIZE + (n % BLOCK_SIZE).to(tl.int64)) * num_kv_heads + head // GROUP
            k_s = tl.load(scales_ptr + s_offs, mask=n < seq_len, other=0.0)
            v_s = tl.load(scales_ptr + v_offset // HEAD_DIM + s_offs, mask=n < seq_len, other=0.0)
            s = s * k_s[None, :]
        if SOFTCAP:
            s = tanh(s * qk_scale_log2) * softcap_log2
        else:
            s = s * qk_scale_log2
        if start >= unmasked_hi:
            visible = (n[None, :] <= q_pos[:, None]) & (n < seq_len)[None, :]
            if USE_WINDOW:
                visible = visible & (n[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv_base + v_offset + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = widen(v, q.dtype)
        if INT8:
            p = p * v_s[None, :]
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if SINKS:  # the head's sink: one more softmax column (log2 domain), weighing no value
        sink = tl.load(sinks_ptr + head) * LOG2E
        m_f = tl.maximum(m_i, sink)
        c = tl.exp2(m_i - m_f)  # 0 where the row saw no key
        o = acc * (c * v_scale / (l_i * c + tl.exp2(sink - m_f)))[:, None]
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc * (v_scale / l_safe)[:, None]
    dst = out_ptr + (rows[:, None] * out_row_heads + head) * HEAD_DIM + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], new tokens already in
    query_start_loc: torch.Tensor,  # [S + 1] int32 cu_seqlens of the new tokens
    seq_lens: torch.Tensor,  # [S] int32, cached + new
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    scale: float,
    *,
    max_query_len: int,  # host-side, sizes the grid
    out: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,  # [n] int32, sequences to serve; default: all
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_scales: torch.Tensor | None = None,  # INT8 caches: [2, num_blocks, block_size, num_kv_heads] float32
    sliding_window: int | None = None,
    logit_softcap: float | None = None,  # Gemma 2's c: scores c * tanh(score / c); None or 0 = off
    sinks: torch.Tensor | None = None,  # [num_heads] float32: gpt-oss's learned sink logit per query head
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.paged_prefill_attention_ref`."""
    q, out, num_heads, head_dim, block_size, num_kv_heads = prepare_attention(q, kv_cache, out)
    if seq_ids is None:
        seq_ids = torch.arange(seq_lens.shape[0], dtype=torch.int32, device=q.device)
    n = seq_ids.shape[0]
    if n == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    head_pad = next_power_of_2(head_dim)
    config = prefill_config(
        device_limits(q.device), dtype_name(q.dtype), dtype_name(kv_cache.dtype), head_pad, group
    )
    block_m, block_n = block_m or config.block_m, block_n or config.block_n
    if min(block_m, block_n) < DOT_MIN:  # the interpreter runs such tiles; the GPU compiler refuses them
        raise ValueError(f"prefill tiles of {block_m} x {block_n}: tl.dot needs at least {DOT_MIN} each way")
    int8 = kv_cache.dtype == torch.int8
    if int8:
        check_int8_scales(kv_cache, kv_scales)
    qk_scale, softcap_log2 = softcap_scales(scale * k_scale, logit_softcap)
    launch(
        _paged_prefill_kernel,
        (n, triton.cdiv(max_query_len, block_m), num_heads),
        q,
        kv_cache,
        kv_scales if int8 else kv_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        seq_ids,
        sinks if sinks is not None else out,
        qk_scale,
        v_scale,
        softcap_log2,
        sliding_window or 0,
        q.stride(0) // head_dim,
        out.stride(0) // head_dim,
        block_tables.stride(0),
        kv_cache.shape[1],
        num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        IEEE_DOT=q.dtype == torch.float32,
        INT8=int8,
        SOFTCAP=bool(logit_softcap),
        SINKS=sinks is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        shared_memory_bound=config.shared_memory,
    )
    return out
