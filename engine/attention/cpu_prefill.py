"""Causal prefill attention on the CPU over the paged cache (float32; AVX2 or AVX-512), flash-attention style.

Why: torch's CPU flash-attention kernel runs its tiles through the BLAS sgemm, which reaches a fraction of
what the cores do on the default model's prefill shapes, and causal attention was a third of a long
prompt's prefill. This kernel reads K/V where they lie in the cache (every prefill chunk, with or without a
cached prefix, and with a sliding window) and is faster on the same shapes (measurements:
docs/benchmarks.md; `tests/models/test_torch_backend.py` checks it against the dense reference).

How: one task per (chunk, KV head, range of query positions). A task first copies the K rows it will read
into a transposed scratch, one vector of keys per chunk ([d][16 keys] on AVX-512, [d][8 keys] on AVX2), so
a tile's scores are broadcast-FMAs of query elements against key vectors with no horizontal sums. A tile is
12 query rows: the query positions times the query heads that share the KV head (GQA reads each K/V row
once per tile). Softmax is online per chunk (running max and sum per row); P.V accumulates in registers.
Masks (causal and sliding window) are applied per chunk only where a chunk crosses a row's edge.

Needs AVX2 + FMA or AVX-512, a head size that is a multiple of 16 (at most 256) and at most 12 query heads
per KV head; elsewhere `supports` says no and the backend keeps torch's SDPA. C source:
kernels/cpu/paged_prefill.c.
"""

from __future__ import annotations

import torch
from pagoda.kernels.cpu.loader import current, library

_ROWS = 12  # query rows per tile (PF_R)
_MAX_HEAD_DIM = 256


def available() -> bool:
    """Whether the loaded CPU kernels carry this one (the AVX2 and AVX-512 variants do)."""
    return current().prefill


def supports(q: torch.Tensor, kv: torch.Tensor, scales: torch.Tensor | None = None) -> bool:
    """float32 CPU queries over a float32 or bfloat16 cache (no INT8/FP8), contiguous head rows, shapes within
    the kernel's tiles."""
    _, _, _, hkv, d = kv.shape
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and kv.dtype in (torch.float32, torch.bfloat16)
        and scales is None
        and kv.is_contiguous()
        and q.stride(2) == 1
        and q.stride(1) == d
        and q.shape[1] % hkv == 0
        and q.shape[1] // hkv <= _ROWS
        and d % 16 == 0
        and d <= _MAX_HEAD_DIM
        and available()
    )


class PrefillChunks:
    """The step's prefill chunks as the kernel reads them (built once per step, shared by every layer)."""

    __slots__ = ("seq_idx", "starts", "qlens", "ctx_lens", "max_len", "_scratch")

    def __init__(self, seq_idx: list[int], starts: list[int], qlens: list[int], ctx_lens: list[int]) -> None:
        self.seq_idx = torch.tensor(seq_idx, dtype=torch.int64)
        self.starts = torch.tensor(starts, dtype=torch.int64)
        self.qlens = torch.tensor(qlens, dtype=torch.int64)
        self.ctx_lens = torch.tensor(ctx_lens, dtype=torch.int64)
        self.max_len = max(c + q for c, q in zip(ctx_lens, qlens, strict=True))
        self._scratch: torch.Tensor | None = None

    def scratch(self, head_dim: int, threads: int) -> tuple[torch.Tensor, int]:
        """Per-thread room for the transposed keys of the longest chunk (floats per thread)."""
        per = (self.max_len // 16 + 2) * head_dim * 16
        if self._scratch is None or self._scratch.numel() < per * threads:
            self._scratch = torch.empty(per * threads + 16, dtype=torch.float32)
        return self._scratch, per

    def __len__(self) -> int:
        return self.seq_idx.shape[0]


def paged_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    chunks: PrefillChunks,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal attention of every prefill chunk's tokens over its sequence's cached keys up to each token
    (the chunk's own K/V already written), scores soft-capped to c * tanh(score / c) with ``logit_softcap``
    (Gemma 2); ``sinks`` [H] float32: gpt-oss's learned per-head logits in the denominator. q, out: [T, H, D] float32; kv: [2, num_blocks, block_size, Hkv, D] float32 or bfloat16;
    block_tables [S, max_blocks] int32 contiguous. Caller checks `supports`."""
    lib = library()
    assert lib is not None, "paged_prefill called without the native library"
    if len(chunks) == 0:
        return
    assert block_tables.is_contiguous() and block_tables.dtype == torch.int32
    assert out.stride(2) == 1 and out.stride(1) == out.shape[2]
    assert sinks is None or (
        sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.numel() == q.shape[1]
    )
    _, _, bs, hkv, d = kv.shape
    threads = torch.get_num_threads()
    scratch, per = chunks.scratch(d, threads)
    fn = lib.pagoda_paged_prefill_bf16 if kv.dtype == torch.bfloat16 else lib.pagoda_paged_prefill_f32
    status = fn(
        q.data_ptr(),
        q.stride(0),
        kv[0].data_ptr(),
        kv[1].data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        chunks.seq_idx.data_ptr(),
        chunks.starts.data_ptr(),
        chunks.qlens.data_ptr(),
        chunks.ctx_lens.data_ptr(),
        len(chunks),
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
        scratch.data_ptr(),
        per,
        threads,
    )
    if status != 0:
        raise ValueError(f"paged prefill kernel refused shapes q={tuple(q.shape)} kv={tuple(kv.shape)}")
