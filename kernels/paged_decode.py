"""Paged decode attention: one new token per sequence against its block-paged KV cache.

Layout of the work: one program per (sequence, KV head, KV split). A program holds all the query heads
that share its KV head (grouped-query attention), so every K/V byte is read from memory once, and walks
its range of the sequence in tiles of BLOCK_N tokens, translating each token to its physical slot through
the block table. When sequences x KV heads are too few to fill the GPU, the sequence is cut into
NUM_SPLITS ranges ("flash decoding"); each writes a normalised partial output and its log-sum-exp, and a
second small kernel merges them. FP8 caches are read as FP8 and widened in registers: the K scale is
folded into the softmax scale and the V scale into the output, so dequantizing costs no extra pass. INT8
caches are read as INT8 (exact in fp16/bf16) with their per-token scales: each key's scale multiplies its
score column, each value's scale its probability before the P @ V product (the softmax sum uses P
unscaled), again with no dequantized copy of K or V.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from pagoda.kernels.runtime import (
    check_int8_scales,
    interpreting,
    next_power_of_2,
    num_sms,
    prepare_attention,
)


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    kv_ptr,
    scales_ptr,  # INT8: [2, num_blocks, block_size, num_kv_heads] float32 (else unused)
    out_ptr,
    part_out_ptr,  # [n, num_heads, NUM_SPLITS, HEAD_DIM] float32 (only with NUM_SPLITS > 1)
    part_lse_ptr,  # [n, num_heads, NUM_SPLITS] float32, log2 domain
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    seq_ids_ptr,  # [n] which sequences of the batch this launch serves
    qk_scale_log2,  # softmax scale * k_scale * log2(e)
    v_scale,
    window,  # sliding window in tokens (used when USE_WINDOW)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    v_offset,  # elements from the K half of the cache to the V half
    stride_block,
    stride_tok,
    stride_head,
    scales_v_offset,  # INT8: elements from the K half of the scales to the V half
    num_kv_heads,
    num_heads,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INT8: tl.constexpr,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_ids_ptr + i)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    head_mask = g < GROUP
    q = tl.load(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=head_mask[:, None])

    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(seq_len - window, 0)
    first_tile = kv_start // BLOCK_N
    num_tiles = tl.cdiv(seq_len, BLOCK_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_base = kv_ptr + kv_head.to(tl.int64) * stride_head
    for tile in range(tile_lo, tile_hi):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        in_seq = n < seq_len
        valid = in_seq & (n >= kv_start)
        block = tl.load(table + n // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        offs = block * stride_block + (n % BLOCK_SIZE).to(tl.int64) * stride_tok
        k = tl.load(kv_base + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if INT8:
            # per-token scales: a key's scale multiplies its score column, a value's its probability
            s_offs = (block * BLOCK_SIZE + (n % BLOCK_SIZE).to(tl.int64)) * num_kv_heads + kv_head
            k_s = tl.load(scales_ptr + s_offs, mask=valid, other=0.0)
            v_s = tl.load(scales_ptr + scales_v_offset + s_offs, mask=valid, other=0.0)
            s = s * k_s[None, :]
        s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv_base + v_offset + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(
            q.dtype
        )
        if INT8:
            p = p * v_s[None, :]
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc * (v_scale / l_safe)[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    else:
        row = (i.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=head_mask[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + row, lse, mask=head_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    seq_ids_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + i)
    q_row = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    row = (i.to(tl.int64) * num_heads + h) * NUM_SPLITS + sp
    lse = tl.load(part_lse_ptr + row)
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)  # empty splits carry -inf and weigh 0
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :])
    o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + q_row * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


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
    if block_n is None:
        block_n = 16 if interpreting() else (64 if head_dim <= 128 else 32)
    if num_splits is None:
        num_splits = choose_num_splits(n, num_kv_heads, max_seq_len, q.device)
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if num_splits > 1:
        part_out = torch.empty((n, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    kv_k = kv_cache[0]
    int8 = kv_cache.dtype == torch.int8
    if int8:
        check_int8_scales(kv_cache, kv_scales)
    _paged_decode_kernel[(n, num_kv_heads, num_splits)](
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
        scale * k_scale * math.log2(math.e),
        v_scale,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_cache[1].storage_offset() - kv_k.storage_offset(),
        kv_k.stride(0),
        kv_k.stride(1),
        kv_k.stride(2),
        kv_scales[1].storage_offset() - kv_scales[0].storage_offset() if int8 else 0,
        num_kv_heads,
        num_heads,
        GROUP=group,
        GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None,
        IEEE_DOT=q.dtype == torch.float32,
        INT8=int8,
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _merge_splits_kernel[(n, num_heads)](
            out,
            part_out,
            part_lse,
            query_start_loc,
            seq_ids,
            out.stride(0),
            out.stride(1),
            num_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            num_warps=4,
        )
    return out
