"""Paged decode attention on the CPU that reads K/V where they lie in the cache (no gather).

One task per (sequence, KV head): the task walks the sequence's block table, scores all query heads that share
the KV head against each key once (GQA reads every K/V row once), and keeps a running max / sum / weighted V
(online softmax), so no [seqs, max_len] scores or gathered K/V are ever materialised and nothing is padded to
the longest sequence. Tasks run in parallel on torch's OpenMP pool. Blocks lie anywhere in the cache, so a task
prefetches the next block's rows of its head while it scores the current one (unless that block is the adjacent
one, which the hardware prefetcher follows by itself): scattered blocks cost less, contiguous ones the same.

Gathering the context per layer and step used to cost more than the model's matmuls at 64 concurrent decodes
(measurements: docs/benchmarks.md, "Numbers behind the code"). With AVX-512 and a head size that is a multiple
of 16, or AVX2 and a multiple of 8, the inner loops use intrinsics (with a vector exp); otherwise a portable
loop the compiler vectorises. C source: kernels/cpu/paged_decode.c.
"""

from __future__ import annotations

import torch
from pagoda.kernels.cpu.loader import library

_MAX_GROUP = 16  # query heads per KV head
_MAX_HEAD_DIM = 256
_MAX_BLOCK = 128


def available() -> bool:
    """Whether the native decode kernel could be built and loaded on this machine."""
    return library() is not None


def supports(q: torch.Tensor, kv: torch.Tensor, scales: torch.Tensor | None = None) -> bool:
    """The kernel's domain: float32 CPU queries over a float32 or bfloat16 cache (or an INT8 cache with its
    float32 scales), contiguous head rows, shapes within its fixed buffers."""
    _, _, bs, hkv, d = kv.shape
    kv_dtype = kv.dtype
    if q.dtype is not torch.float32 or not q.is_cpu:
        return False
    if kv_dtype is not torch.float32 and kv_dtype is not torch.bfloat16:
        int8_ok = (
            kv_dtype == torch.int8
            and scales is not None
            and scales.dtype == torch.float32
            and scales.is_contiguous()
            and tuple(scales.shape) == tuple(kv.shape[:4])
        )
        if not int8_ok:
            return False
    _, heads, _ = q.shape
    _, head_stride, dim_stride = q.stride()
    return (
        kv.is_contiguous()
        and dim_stride == 1
        and head_stride == d
        and heads % hkv == 0
        and heads // hkv <= _MAX_GROUP
        and d <= _MAX_HEAD_DIM
        and bs <= _MAX_BLOCK
        and available()
    )


def paged_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    seq_idx: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention of one new token per sequence over its cached keys (its own K/V already written), scores
    soft-capped to c * tanh(score / c) with ``logit_softcap`` c (Gemma 2); ``sinks`` [H] float32 (gpt-oss):
    one learned logit per query head that joins the softmax's denominator and adds no value.

    q, out: [T, H, D] float32; kv: [2, num_blocks, block_size, Hkv, D] float32 or bfloat16, or int8 with ``scales``
    [2, num_blocks, block_size, Hkv] float32 (per token and head); block_tables [S, max_blocks] int32 and
    seq_lens [S] int32, both contiguous. Decode i is sequence ``seq_idx[i]`` (default i) and token row
    ``rows[i]`` of q and out (default i); ``len(rows)`` (or T) decodes in all. Caller checks `supports`.
    """
    lib = library()
    assert lib is not None, "paged_decode called without the native library"
    n = rows.shape[0] if rows is not None else q.shape[0]
    if n == 0:
        return
    for t, dtype in (
        (block_tables, torch.int32),
        (seq_lens, torch.int32),
        (seq_idx, torch.int64),
        (rows, torch.int64),
    ):
        assert t is None or (t.is_contiguous() and t.dtype == dtype)
    assert out.stride(2) == 1 and out.stride(1) == out.shape[2]
    assert sinks is None or (
        sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.numel() == q.shape[1]
    )
    _, _, bs, hkv, d = kv.shape
    k_ptr = kv.data_ptr()
    v_ptr = k_ptr + kv.stride(0) * kv.element_size()  # kv[1].data_ptr(), without making the view
    if kv.dtype == torch.int8:
        fn = lib.pagoda_paged_decode_i8
        ks_ptr = scales.data_ptr()
        vs_ptr = ks_ptr + scales.stride(0) * scales.element_size()
        head = (q.data_ptr(), q.stride(0), k_ptr, v_ptr, ks_ptr, vs_ptr)
    else:
        fn = lib.pagoda_paged_decode_bf16 if kv.dtype == torch.bfloat16 else lib.pagoda_paged_decode_f32
        head = (q.data_ptr(), q.stride(0), k_ptr, v_ptr)
    status = fn(
        *head,
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        None if seq_idx is None else seq_idx.data_ptr(),
        None if rows is None else rows.data_ptr(),
        n,
        out.data_ptr(),
        out.stride(0),
        q.shape[1],
        hkv,
        d,
        bs,
        scale,
        sliding_window or 0,
        logit_softcap or 0.0,
        None if sinks is None else sinks.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"paged decode kernel refused shapes q={tuple(q.shape)} kv={tuple(kv.shape)}")
