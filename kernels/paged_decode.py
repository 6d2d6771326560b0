"""Paged decode attention: one new token per sequence against its block-paged KV cache.

Layout of the work: one program per (sequence, KV head, KV split). A program holds all the query heads
that share its KV head (grouped-query attention), so every K/V byte is read from memory once, and walks
its range of the sequence in tiles of BLOCK_N tokens, translating each token to its physical slot through
the block table. When sequences x KV heads are too few to fill the GPU, the sequence is cut into
`num_splits` ranges ("flash decoding"); each writes a normalised partial output and its log-sum-exp, and a
second small kernel merges them. FP8 caches are read as FP8 and widened in registers: the K scale is
folded into the softmax scale and the V scale into the output, so dequantizing costs no extra pass. INT8
caches are read as INT8 (exact in fp16/bf16) with their per-token scales: each key's scale multiplies its
score column, each value's scale its probability before the P @ V product (the softmax sum uses P
unscaled), again with no dequantized copy of K or V. A logit soft-cap (Gemma 2, the SOFTCAP constexpr:
no cost when off) squashes each score to c * tanh(score / c) before the mask and the softmax.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from pagoda.kernels.convert import widen
from pagoda.kernels.launch_config import SCRATCH_SHARED_MEMORY, decode_config, group_pad
from pagoda.kernels.runtime import (
    check_int8_scales,
    device_limits,
    dtype_name,
    launch,
    next_power_of_2,
    num_sms,
    prepare_attention,
)
from pagoda.kernels.scores import head_lanes, softcap_scales, tanh

# Integers that change from step to step or with the cache's size stay out of Triton's specialization
# (see pagoda.kernels.runtime.launch): a variant depends on the constexprs and dtypes only.
DYNAMIC_ARGS = [
    "window", "q_row_heads", "out_row_heads", "stride_bt", "num_blocks", "num_kv_heads", "num_heads", "num_splits",
]  # fmt: skip
MERGE_DYNAMIC_ARGS = ["out_row_heads", "num_heads", "num_splits"]
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _paged_decode_kernel(
    q_ptr,
    kv_ptr,
    scales_ptr,  # INT8: [2, num_blocks, block_size, num_kv_heads] float32 (else unused)
    out_ptr,
    part_out_ptr,  # [n, num_heads, num_splits, HEAD_DIM] float32 (only with SPLIT)
    part_lse_ptr,  # [n, num_heads, num_splits] float32, log2 domain
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    seq_ids_ptr,  # [n] which sequences of the batch this launch serves
    sinks_ptr,  # [num_heads] float32 learned sink logits (used when SINKS, unsplit; split: the merge adds them)
    qk_scale_log2,  # softmax scale * k_scale * log2(e); with SOFTCAP: softmax scale * k_scale / cap
    v_scale,
    softcap_log2,  # cap * log2(e) (used when SOFTCAP)
    window,  # sliding window in tokens (used when USE_WINDOW)
    q_row_heads,  # q.stride(0) / HEAD_DIM: rows are whole heads apart, heads HEAD_DIM apart
    out_row_heads,
    stride_bt,
    num_blocks,
    num_kv_heads,
    num_heads,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (the lanes of a head)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INT8: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr = False,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + i)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)

    g = tl.arange(0, GROUP_PAD)
    d, d_ok = head_lanes(HEAD_DIM, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g
    head_mask = g < GROUP
    q_mask = head_mask[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + (q_row * q_row_heads + heads[:, None]) * HEAD_DIM + d[None, :], mask=q_mask, other=0.0
    )

    # The cache is contiguous [2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]: its strides follow.
    stride_tok = num_kv_heads * HEAD_DIM
    stride_block = stride_tok * BLOCK_SIZE
    v_offset = num_blocks.to(tl.int64) * stride_block
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(seq_len - window, 0)
    first_tile = kv_start // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_base = kv_ptr + kv_head.to(tl.int64) * HEAD_DIM
    for tile in range(tile_lo, tile_hi):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        in_seq = n < seq_len
        valid = in_seq & (n >= kv_start)
        block = tl.load(table + n // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        offs = block * stride_block + (n % BLOCK_SIZE).to(tl.int64) * stride_tok
        kv_mask = valid[:, None] & d_ok[None, :]
        k = widen(tl.load(kv_base + offs[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if INT8:
            # per-token scales: a key's scale multiplies its score column, a value's its probability
            s_offs = (block * BLOCK_SIZE + (n % BLOCK_SIZE).to(tl.int64)) * num_kv_heads + kv_head
            k_s = tl.load(scales_ptr + s_offs, mask=valid, other=0.0)
            v_s = tl.load(scales_ptr + v_offset // HEAD_DIM + s_offs, mask=valid, other=0.0)
            s = s * k_s[None, :]
        if SOFTCAP:
            s = tanh(s * qk_scale_log2) * softcap_log2
        else:
            s = s * qk_scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = widen(tl.load(kv_base + v_offset + offs[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype)
        if INT8:
            p = p * v_s[None, :]
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc * (v_scale / l_safe)[:, None]
    if SINKS and not SPLIT:  # each head's sink: one more softmax column (log2 domain), weighing no value
        sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0) * LOG2E
        m_f = tl.maximum(m_i, sink)
        c = tl.exp2(m_i - m_f)  # 0 where nothing was seen
        o = acc * (c * v_scale / (l_i * c + tl.exp2(sink - m_f)))[:, None]
    if SPLIT:
        row = (i.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=q_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + row, lse, mask=head_mask)
    else:
        dst = out_ptr + (q_row * out_row_heads + heads[:, None]) * HEAD_DIM + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=MERGE_DYNAMIC_ARGS)
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    seq_ids_ptr,
    sinks_ptr,  # [num_heads] float32 (used when SINKS)
    out_row_heads,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SINKS: tl.constexpr = False,
):
    # One pass over the splits with a running maximum (online softmax over their log-sum-exps).
    i = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + i)
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    d, d_ok = head_lanes(HEAD_DIM, HEAD_DIM_PAD)
    first = (i.to(tl.int64) * num_heads + h) * num_splits
    m = tl.full([], float("-inf"), tl.float32)
    w_sum = tl.zeros([], tl.float32)
    if SINKS:  # the sink starts the merge as a split of weight exp2(sink) and no value
        m = tl.load(sinks_ptr + h) * LOG2E
        w_sum = tl.full([], 1.0, tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    for sp in range(num_splits):
        lse = tl.load(part_lse_ptr + first + sp)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)  # an empty split carries -inf and weighs 0
        acc = acc * alpha + w * tl.load(part_out_ptr + (first + sp) * HEAD_DIM + d, mask=d_ok, other=0.0)
        w_sum = w_sum * alpha + w
        m = m_new
    o = acc / w_sum
    tl.store(out_ptr + (q_row * out_row_heads + h) * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split the KV walk only when sequences x KV heads leave SMs idle, and never below ~256 tokens a split."""
    programs = max(1, num_seqs * num_kv_heads)
    want = math.ceil(2 * num_sms(device) / programs)
    cap = max(1, math.ceil(max_seq_len / 256))
    n = min(want, cap, 64)
    return 1 if n <= 1 else next_power_of_2(n)


def paged_decode_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]; rows query_start_loc[seq_ids] are read
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32, context length including the new token
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]; written at the same rows as q
    query_start_loc: torch.Tensor | None = None,  # [S + 1]; default: one token per sequence
    seq_ids: torch.Tensor | None = None,  # [n] int32, sequences to serve; default: all
    max_seq_len: int | None = None,  # host-side bound, avoids a device sync
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_scales: torch.Tensor | None = None,  # INT8 caches: [2, num_blocks, block_size, num_kv_heads] float32
    sliding_window: int | None = None,
    logit_softcap: float | None = None,  # Gemma 2's c: scores c * tanh(score / c); None or 0 = off
    sinks: torch.Tensor | None = None,  # [num_heads] float32: gpt-oss's learned sink logit per query head
    num_splits: int | None = None,  # None = heuristic; tests force values
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.paged_decode_attention_ref` (one query token per served sequence)."""
    q, out, num_heads, head_dim, block_size, num_kv_heads = prepare_attention(q, kv_cache, out)
    if query_start_loc is None:
        query_start_loc = torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=q.device)
    if seq_ids is None:
        seq_ids = torch.arange(seq_lens.shape[0], dtype=torch.int32, device=q.device)
    n = seq_ids.shape[0]
    if n == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    group = num_heads // num_kv_heads
    head_pad = next_power_of_2(head_dim)
    config = decode_config(
        device_limits(q.device), dtype_name(q.dtype), dtype_name(kv_cache.dtype), head_pad, group
    )
    if num_splits is None:
        num_splits = choose_num_splits(n, num_kv_heads, max_seq_len, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if num_splits > 1:
        part_out = torch.empty((n, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    int8 = kv_cache.dtype == torch.int8
    if int8:
        check_int8_scales(kv_cache, kv_scales)
    qk_scale, softcap_log2 = softcap_scales(scale * k_scale, logit_softcap)
    launch(
        _paged_decode_kernel,
        (n, num_kv_heads, num_splits),
        q,
        kv_cache,
        kv_scales if int8 else kv_cache,
        out,
        part_out,
        part_lse,
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
        num_heads,
        num_splits,
        GROUP=group,
        GROUP_PAD=group_pad(group),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n or config.block_n,
        SPLIT=num_splits > 1,
        USE_WINDOW=sliding_window is not None,
        IEEE_DOT=q.dtype == torch.float32,
        INT8=int8,
        SOFTCAP=bool(logit_softcap),
        SINKS=sinks is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        shared_memory_bound=config.shared_memory,
    )
    if num_splits > 1:
        launch(
            _merge_splits_kernel,
            (n, num_heads),
            out,
            part_out,
            part_lse,
            query_start_loc,
            seq_ids,
            sinks if sinks is not None else out,
            out.stride(0) // head_dim,
            num_heads,
            num_splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_pad,
            SINKS=sinks is not None,
            num_warps=config.merge_warps,
            shared_memory_bound=SCRATCH_SHARED_MEMORY,
        )
    return out
