"""Paged decode attention on the CPU that reads K/V where they lie in the cache (no gather).

One task per (sequence, KV head): the task walks the sequence's block table, scores all query heads that share
the KV head against each key once (GQA reads every K/V row once), and keeps a running max / sum / weighted V
(online softmax), so no [seqs, max_len] scores or gathered K/V are ever materialised and nothing is padded to
the longest sequence. Tasks run in parallel on torch's OpenMP pool. Blocks lie anywhere in the cache, so a task
prefetches the next block's rows of its head while it scores the current one (unless that block is the adjacent
one, which the hardware prefetcher follows by itself): 1.2-1.3x less time per layer on scattered blocks at 1-64
decodes, the same on contiguous ones.

Gathering the context per layer and step used to cost more than the model's matmuls at 64 concurrent decodes:
the per-layer kernel time went from ~61 ms (gather + padded SDPA) to ~6 ms on one core, 64 sequences of 24-767
tokens, SmolLM2-135M shapes. With AVX-512 and a head size that is a multiple of 16 the inner loops use
intrinsics; otherwise a portable loop the compiler vectorises.
"""

from __future__ import annotations

import ctypes

import torch
from pagoda.engine.attention.native import C_PRELUDE, load_library

_MAX_GROUP = 16  # query heads per KV head
_MAX_HEAD_DIM = 256
_MAX_BLOCK = 128

_SOURCE = (
    C_PRELUDE
    + r"""
#define MAXG 16
#define MAXD 256
#define MAXBS 128
#define CT_F32 0 /* cache element types */
#define CT_I8 1
#define CT_BF16 2

/* Block range of one task: keys [start, len) where start honours the sliding window. */
static inline int window_start(int len, int window) { return (window > 0 && len > window) ? len - window : 0; }

#if defined(__AVX512F__)
/* One (sequence, KV head) task; D a multiple of 16. Inlined with constant D and G so the accumulators stay in
   registers. */
static inline __attribute__((always_inline)) void task_avx512(
    const float *qs, const void *kc, const void *vc, const float *ksc, const float *vsc, const int32_t *bt_row,
    int len, float *os, int h, int Hkv, const int D, const int G, int bs, float scale, int window, const int CT)
{
    const int I8 = CT == CT_I8, BF = CT == CT_BF16;
    const int DV = D / 16;
    const int start = window_start(len, window);
    const int64_t tok_stride = (int64_t)Hkv * D;
    __m512 qv[MAXG][MAXD / 16], acc[MAXG][MAXD / 16];
    float m[MAXG], l[MAXG];
    float sc[MAXG][MAXBS] __attribute__((aligned(64)));
    for (int g = 0; g < G; g++) {
        for (int i = 0; i < DV; i++) {
            qv[g][i] = _mm512_mul_ps(_mm512_loadu_ps(qs + g * D + 16 * i), _mm512_set1_ps(scale));
            acc[g][i] = _mm512_setzero_ps();
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const int esz = I8 ? 1 : BF ? 2 : 4;
    for (int b = start / bs; b * bs < len; b++) {
        const int64_t base = ((int64_t)bt_row[b] * bs * Hkv + h) * D;
        const int64_t sbase = (int64_t)bt_row[b] * bs * Hkv + h; /* INT8: scale of token t at sbase + t*Hkv */
        const int t0 = start > b * bs ? start - b * bs : 0;
        const int t1 = len - b * bs < bs ? len - b * bs : bs;
        if ((b + 1) * bs < len && bt_row[b + 1] != bt_row[b] + 1) {
            /* The next block lies anywhere in the cache: fetch its rows of this head while this one is scored
               (an adjacent block is left to the hardware prefetcher, which follows it on its own). */
            const int64_t next = ((int64_t)bt_row[b + 1] * bs * Hkv + h) * D * esz;
            for (int t = 0; t < bs; t++)
                for (int off = 0; off < D * esz; off += 64) {
                    _mm_prefetch((const char *)kc + next + t * tok_stride * esz + off, _MM_HINT_T0);
                    _mm_prefetch((const char *)vc + next + t * tok_stride * esz + off, _MM_HINT_T0);
                }
        }
        for (int t = t0; t < t1; t++) {
            __m512 kk[MAXD / 16];
            if (I8) {
                const int8_t *kt = (const int8_t *)kc + base + t * tok_stride;
                for (int i = 0; i < DV; i++)
                    kk[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(kt + 16 * i))));
            } else if (BF) {
                const uint16_t *kt = (const uint16_t *)kc + base + t * tok_stride;
                for (int i = 0; i < DV; i++) kk[i] = bf16x16(kt + 16 * i);
            } else {
                const float *kt = (const float *)kc + base + t * tok_stride;
                for (int i = 0; i < DV; i++) kk[i] = _mm512_loadu_ps(kt + 16 * i);
            }
            for (int g = 0; g < G; g++) {
                __m512 s = _mm512_mul_ps(qv[g][0], kk[0]);
                for (int i = 1; i < DV; i++) s = _mm512_fmadd_ps(qv[g][i], kk[i], s);
                sc[g][t] = _mm512_reduce_add_ps(s);
                if (I8) sc[g][t] *= ksc[sbase + (int64_t)t * Hkv];
            }
        }
        for (int g = 0; g < G; g++) {
            float bm = m[g];
            for (int t = t0; t < t1; t++) bm = sc[g][t] > bm ? sc[g][t] : bm;
            const float corr = m[g] == -INFINITY ? 0.0f : expf(m[g] - bm);
            float sum = 0.0f;
            for (int t = t0; t < t1; t += 16) {
                const int n = t1 - t < 16 ? t1 - t : 16;
                const __mmask16 mk = (__mmask16)((1u << n) - 1u);
                __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, &sc[g][t]), _mm512_set1_ps(bm)));
                e = _mm512_maskz_mov_ps(mk, e);
                _mm512_mask_storeu_ps(&sc[g][t], mk, e);
                sum += _mm512_reduce_add_ps(e);
            }
            l[g] = l[g] * corr + sum;
            m[g] = bm;
            if (corr != 1.0f) {
                const __m512 c = _mm512_set1_ps(corr);
                for (int i = 0; i < DV; i++) acc[g][i] = _mm512_mul_ps(acc[g][i], c);
            }
        }
        for (int t = t0; t < t1; t++) {
            __m512 vv[MAXD / 16];
            float vscale = 1.0f;
            if (I8) {
                const int8_t *vt = (const int8_t *)vc + base + t * tok_stride;
                for (int i = 0; i < DV; i++)
                    vv[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(vt + 16 * i))));
                vscale = vsc[sbase + (int64_t)t * Hkv];
            } else if (BF) {
                const uint16_t *vt = (const uint16_t *)vc + base + t * tok_stride;
                for (int i = 0; i < DV; i++) vv[i] = bf16x16(vt + 16 * i);
            } else {
                const float *vt = (const float *)vc + base + t * tok_stride;
                for (int i = 0; i < DV; i++) vv[i] = _mm512_loadu_ps(vt + 16 * i);
            }
            for (int g = 0; g < G; g++) {
                const __m512 p = _mm512_set1_ps(I8 ? sc[g][t] * vscale : sc[g][t]);
                for (int i = 0; i < DV; i++) acc[g][i] = _mm512_fmadd_ps(p, vv[i], acc[g][i]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[g]);
        for (int i = 0; i < DV; i++) _mm512_storeu_ps(os + g * D + 16 * i, _mm512_mul_ps(acc[g][i], inv));
    }
}
#endif

/* Portable version of the same task (any D up to MAXD). */
static inline __attribute__((always_inline)) void task_portable(
    const float *qs, const void *kc, const void *vc, const float *ksc, const float *vsc, const int32_t *bt_row,
    int len, float *os, int h, int Hkv, int D, int G, int bs, float scale, int window, const int CT)
{
    const int I8 = CT == CT_I8, BF = CT == CT_BF16;
    const int start = window_start(len, window);
    const int64_t tok_stride = (int64_t)Hkv * D;
    float qv[MAXG][MAXD], acc[MAXG][MAXD], m[MAXG], l[MAXG], sc[MAXG][MAXBS];
    for (int g = 0; g < G; g++) {
        for (int d = 0; d < D; d++) { qv[g][d] = qs[g * D + d] * scale; acc[g][d] = 0.0f; }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    float row[MAXD];
    for (int b = start / bs; b * bs < len; b++) {
        const int64_t base = ((int64_t)bt_row[b] * bs * Hkv + h) * D;
        const int64_t sbase = (int64_t)bt_row[b] * bs * Hkv + h;
        const int t0 = start > b * bs ? start - b * bs : 0;
        const int t1 = len - b * bs < bs ? len - b * bs : bs;
        for (int t = t0; t < t1; t++) {
            const float *kt = (const float *)kc + base + t * tok_stride;
            if (I8) {
                const int8_t *k8 = (const int8_t *)kc + base + t * tok_stride;
                for (int d = 0; d < D; d++) row[d] = (float)k8[d];
                kt = row;
            } else if (BF) {
                const uint16_t *kb = (const uint16_t *)kc + base + t * tok_stride;
                for (int d = 0; d < D; d++) row[d] = bf16_to_f32(kb[d]);
                kt = row;
            }
            for (int g = 0; g < G; g++) {
                float s = 0.0f;
                #pragma omp simd reduction(+:s)
                for (int d = 0; d < D; d++) s += qv[g][d] * kt[d];
                sc[g][t] = I8 ? s * ksc[sbase + (int64_t)t * Hkv] : s;
            }
        }
        for (int g = 0; g < G; g++) {
            float bm = m[g];
            for (int t = t0; t < t1; t++) bm = sc[g][t] > bm ? sc[g][t] : bm;
            const float corr = m[g] == -INFINITY ? 0.0f : expf(m[g] - bm);
            float sum = 0.0f;
            for (int t = t0; t < t1; t++) { sc[g][t] = expf(sc[g][t] - bm); sum += sc[g][t]; }
            l[g] = l[g] * corr + sum;
            m[g] = bm;
            for (int d = 0; d < D; d++) acc[g][d] *= corr;
        }
        for (int t = t0; t < t1; t++) {
            const float *vt = (const float *)vc + base + t * tok_stride;
            float vscale = 1.0f;
            if (I8) {
                const int8_t *v8 = (const int8_t *)vc + base + t * tok_stride;
                for (int d = 0; d < D; d++) row[d] = (float)v8[d];
                vt = row;
                vscale = vsc[sbase + (int64_t)t * Hkv];
            } else if (BF) {
                const uint16_t *vb = (const uint16_t *)vc + base + t * tok_stride;
                for (int d = 0; d < D; d++) row[d] = bf16_to_f32(vb[d]);
                vt = row;
            }
            for (int g = 0; g < G; g++) {
                const float p = I8 ? sc[g][t] * vscale : sc[g][t];
                #pragma omp simd
                for (int d = 0; d < D; d++) acc[g][d] += p * vt[d];
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) os[g * D + d] = acc[g][d] / l[g];
}

/* q/out: [tokens, H, D] rows at q_stride/out_stride floats; caches: [num_blocks, bs, Hkv, D] float32, or
   int8 with float32 scales [num_blocks, bs, Hkv] (I8); seq_idx[i] (or i) picks the sequence of decode i (its
   block table row and length); tok_rows[i] (or i) its row in q and out. */
static inline __attribute__((always_inline)) int paged_decode(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, const float *k_scales,
    const float *v_scales, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    const int64_t *seq_idx, const int64_t *tok_rows, int n, float *out, int64_t out_stride, int H, int Hkv,
    int D, int bs, float scale, int window, int nthreads, const int CT)
{
    const int G = H / Hkv;
    if (G * Hkv != H || G > MAXG || D > MAXD || bs > MAXBS) return 1;
    (void)nthreads;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int task = 0; task < n * Hkv; task++) {
        const int i = task / Hkv, h = task % Hkv;
        const int64_t s = seq_idx ? seq_idx[i] : i;
        const int64_t row = tok_rows ? tok_rows[i] : i;
        const float *qs = q + row * q_stride + (int64_t)h * G * D;
        float *os = out + row * out_stride + (int64_t)h * G * D;
        const int32_t *bt_row = block_tables + s * bt_stride;
        const int len = seq_lens[s];
#if defined(__AVX512F__)
#define TASK(DD, GG) task_avx512(qs, k_cache, v_cache, k_scales, v_scales, bt_row, len, os, h, Hkv, DD, GG, bs, \
                                 scale, window, CT)
        if (D == 64 && G == 3) TASK(64, 3);
        else if (D == 64 && G == 4) TASK(64, 4);
        else if (D == 64 && G == 1) TASK(64, 1);
        else if (D == 128 && G == 4) TASK(128, 4);
        else if (D == 128 && G == 8) TASK(128, 8);
        else if (D % 16 == 0) TASK(D, G);
        else
#endif
        task_portable(qs, k_cache, v_cache, k_scales, v_scales, bt_row, len, os, h, Hkv, D, G, bs, scale, window,
                      CT);
    }
    return 0;
}

int pagoda_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                            const int64_t *seq_idx, const int64_t *tok_rows, int n, float *out,
                            int64_t out_stride, int H, int Hkv, int D, int bs, float scale, int window,
                            int nthreads)
{
    return paged_decode(q, q_stride, k_cache, v_cache, 0, 0, block_tables, bt_stride, seq_lens, seq_idx, tok_rows,
                        n, out, out_stride, H, Hkv, D, bs, scale, window, nthreads, CT_F32);
}

/* bfloat16 cache (a bfloat16 model's): values widened to float32 in registers. */
int pagoda_paged_decode_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                             const int64_t *seq_idx, const int64_t *tok_rows, int n, float *out,
                             int64_t out_stride, int H, int Hkv, int D, int bs, float scale, int window,
                             int nthreads)
{
    return paged_decode(q, q_stride, k_cache, v_cache, 0, 0, block_tables, bt_stride, seq_lens, seq_idx, tok_rows,
                        n, out, out_stride, H, Hkv, D, bs, scale, window, nthreads, CT_BF16);
}

/* INT8 cache: values dequantized in registers, each token's K scale on its score, V scale on its weight. */
int pagoda_paged_decode_i8(const float *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                           const float *k_scales, const float *v_scales, const int32_t *block_tables,
                           int64_t bt_stride, const int32_t *seq_lens, const int64_t *seq_idx,
                           const int64_t *tok_rows, int n, float *out, int64_t out_stride, int H, int Hkv, int D,
                           int bs, float scale, int window, int nthreads)
{
    return paged_decode(q, q_stride, k_cache, v_cache, k_scales, v_scales, block_tables, bt_stride, seq_lens,
                        seq_idx, tok_rows, n, out, out_stride, H, Hkv, D, bs, scale, window, nthreads, CT_I8);
}
"""
)

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _library() -> ctypes.CDLL | None:
    lib = load_library("paged_decode", _SOURCE)
    if lib is not None and not hasattr(lib, "_pagoda_typed"):
        for fn in (lib.pagoda_paged_decode_f32, lib.pagoda_paged_decode_bf16):
            fn.argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I, _P, _I64, _I, _I, _I, _I, _F, _I, _I]
            fn.restype = _I
        fn = lib.pagoda_paged_decode_i8
        fn.argtypes = [_P, _I64, _P, _P, _P, _P, _P, _I64, _P, _P, _P, _I, _P, _I64, _I, _I, _I, _I, _F, _I, _I]  # fmt: skip
        fn.restype = _I
        lib._pagoda_typed = True
    return lib


def available() -> bool:
    """Whether the native decode kernel could be built and loaded on this machine."""
    return _library() is not None


def supports(q: torch.Tensor, kv: torch.Tensor, scales: torch.Tensor | None = None) -> bool:
    """The kernel's domain: float32 CPU queries over a float32 or bfloat16 cache (or an INT8 cache with its
    float32 scales), contiguous head rows, shapes within its fixed buffers."""
    _, _, bs, hkv, d = kv.shape
    int8_ok = (
        kv.dtype == torch.int8
        and scales is not None
        and scales.dtype == torch.float32
        and scales.is_contiguous()
        and tuple(scales.shape) == tuple(kv.shape[:4])
    )
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and (kv.dtype in (torch.float32, torch.bfloat16) or int8_ok)
        and kv.is_contiguous()
        and q.stride(2) == 1
        and q.stride(1) == d
        and q.shape[1] % hkv == 0
        and q.shape[1] // hkv <= _MAX_GROUP
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
) -> None:
    """Attention of one new token per sequence over its cached keys (its own K/V already written).

    q, out: [T, H, D] float32; kv: [2, num_blocks, block_size, Hkv, D] float32 or bfloat16, or int8 with ``scales``
    [2, num_blocks, block_size, Hkv] float32 (per token and head); block_tables [S, max_blocks] int32 and
    seq_lens [S] int32, both contiguous. Decode i is sequence ``seq_idx[i]`` (default i) and token row
    ``rows[i]`` of q and out (default i); ``len(rows)`` (or T) decodes in all. Caller checks `supports`.
    """
    lib = _library()
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
    _, _, bs, hkv, d = kv.shape
    if kv.dtype == torch.int8:
        fn = lib.pagoda_paged_decode_i8
        head = (q.data_ptr(), q.stride(0), kv[0].data_ptr(), kv[1].data_ptr(), scales[0].data_ptr(),
                scales[1].data_ptr())  # fmt: skip
    else:
        fn = lib.pagoda_paged_decode_bf16 if kv.dtype == torch.bfloat16 else lib.pagoda_paged_decode_f32
        head = (q.data_ptr(), q.stride(0), kv[0].data_ptr(), kv[1].data_ptr())
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
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"paged decode kernel refused shapes q={tuple(q.shape)} kv={tuple(kv.shape)}")
