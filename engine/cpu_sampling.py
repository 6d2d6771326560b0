"""Greedy sampling on the CPU in one pass over each row of logits: the argmax and, when wanted, its logprob.

torch needs an argmax (not vectorised, ~6 ms for 64 x 49152 on one core) plus a logsumexp (four passes) for
the same answer; this kernel reads each row once, keeping a running maximum (first index on ties, as
torch.argmax) and the sum of exponentials rescaled to it, so logprob(argmax) = -log(sum). Float32 CPU logits
with contiguous rows only; `greedy` returns None otherwise and the sampler uses torch.
"""

from __future__ import annotations

import ctypes

import torch
from pagoda.engine.attention.native import C_PRELUDE, load_library

_SOURCE = (
    C_PRELUDE
    + r"""
/* For each row r of x [N, V] (row stride ld): ids[r] = first index of the row maximum; when want[r] is
   non-zero, lp[r] = -log(sum_i exp(x_i - max)), the log-probability of that token. */
void pagoda_greedy(const float *x, int64_t N, int64_t V, int64_t ld, const uint8_t *want, int64_t *ids,
                   float *lp, int nthreads)
{
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (N * V >= 262144)
    for (int64_t r = 0; r < N; r++) {
        const float *row = x + r * ld;
        float best = -INFINITY, sum = 0.0f;
        int64_t arg = 0, i = 0;
        const int with_lp = want[r] != 0;
#if defined(__AVX512F__)
        __m512 vmax = _mm512_set1_ps(-INFINITY), vsum = _mm512_setzero_ps();
        __m512i varg = _mm512_setzero_si512(), vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        for (; i + 16 <= V && V < 2147483647; i += 16) {
            __m512 v = _mm512_loadu_ps(row + i);
            __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
            if (with_lp) {
                /* rescale the running sums of the lanes whose maximum grows */
                __m512 nmax = _mm512_max_ps(vmax, v);
                vsum = _mm512_mul_ps(vsum, exp16(_mm512_sub_ps(vmax, nmax)));
                vsum = _mm512_add_ps(vsum, exp16(_mm512_sub_ps(v, nmax)));
                vmax = nmax;
            } else {
                vmax = _mm512_mask_mov_ps(vmax, gt, v);
            }
            varg = _mm512_mask_mov_epi32(varg, gt, vidx);
            vidx = _mm512_add_epi32(vidx, step);
        }
        if (i > 0) {
            float lmax[16], lsum[16];
            int32_t larg[16];
            _mm512_storeu_ps(lmax, vmax);
            _mm512_storeu_ps(lsum, vsum);
            _mm512_storeu_si512((void *)larg, varg);
            for (int l = 0; l < 16; l++)
                if (lmax[l] > best || (lmax[l] == best && larg[l] < arg)) { best = lmax[l]; arg = larg[l]; }
            if (with_lp)
                for (int l = 0; l < 16; l++)
                    if (lmax[l] > -INFINITY) sum += lsum[l] * expf(lmax[l] - best);
        }
#endif
        for (; i < V; i++) {
            const float v = row[i];
            if (v > best) {
                if (with_lp) sum = sum * expf(best - v) + 1.0f;
                best = v;
                arg = i;
            } else if (with_lp) {
                sum += expf(v - best);
            }
        }
        ids[r] = arg;
        if (with_lp) lp[r] = -logf(sum);
    }
}
"""
)


def _library() -> ctypes.CDLL | None:
    lib = load_library("greedy", _SOURCE)
    if lib is not None and not hasattr(lib, "_pagoda_typed"):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.pagoda_greedy.argtypes = [p, i64, i64, i64, p, p, p, ctypes.c_int]
        lib.pagoda_greedy.restype = None
        lib._pagoda_typed = True
    return lib


def greedy(logits: torch.Tensor, want_logprob: list[bool]) -> tuple[list[int], list[float | None]] | None:
    """(argmax of each row, its logprob where ``want_logprob``), or None where the kernel does not apply."""
    lib = _library()
    if (
        lib is None
        or logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.stride(1) != 1
        or logits.shape[0] == 0
    ):
        return None
    n, vocab = logits.shape
    want = torch.tensor(want_logprob, dtype=torch.uint8)
    ids = torch.empty(n, dtype=torch.int64)
    lp = torch.empty(n, dtype=torch.float32)
    lib.pagoda_greedy(
        logits.data_ptr(),
        n,
        vocab,
        logits.stride(0),
        want.data_ptr(),
        ids.data_ptr(),
        lp.data_ptr(),
        torch.get_num_threads(),
    )
    return ids.tolist(), [v if w else None for v, w in zip(lp.tolist(), want_logprob, strict=True)]
