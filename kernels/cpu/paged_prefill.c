/* Causal prefill attention over the paged cache, flash-attention style (engine/attention/cpu_prefill.py binds
   it): tiles over chunks of one vector of keys (16 on AVX-512, 8 on AVX2); the portable build returns 2. */
#include "pagoda_cpu.h"

#define PF_R 12        /* query rows per tile: positions x query heads of one KV head */
#define PF_MAXD 256
#define PF_RV 16       /* PF_R rounded up to whole vectors (of 8 or 16 lanes) */

#ifdef VLEN
#define PF_W VLEN /* keys per chunk: one vector of scores per query row */
/* One tile of PF_R query rows against the key chunks [c0, c1) of the transposed K in kt, with P.V ordered by
   head-dimension slice (outer) and key (inner) so the 12 rows' accumulators of one slice stay in registers
   (AVX2 has 16). */
static inline __attribute__((always_inline)) void pf_tile(
    const float *qs /* [PF_R][D] scaled */, const int *pos, const int *ws, int R, const float *kt, int c0,
    int c1, const void *vc, const int32_t *bt_row, int bs, int64_t tok_stride, int h, int kend, float *O,
    float *m, float *l, float cap, const int D, const int BF)
{
    const int DV = D / VLEN;
    const vint iota = viota();
    int minpos = pos[0], maxws = ws[0], maxpos = pos[0], minws = ws[0];
    for (int r = 1; r < R; r++) {
        minpos = pos[r] < minpos ? pos[r] : minpos;
        maxws = ws[r] > maxws ? ws[r] : maxws;
        maxpos = pos[r] > maxpos ? pos[r] : maxpos;
        minws = ws[r] < minws ? ws[r] : minws;
    }
    float ps[PF_R][VLEN] __attribute__((aligned(64)));
    float sc[PF_R][VLEN] __attribute__((aligned(64)));
    float corr[PF_RV] __attribute__((aligned(64))), rsum[PF_R];
    float qt[PF_MAXD][PF_R]; /* the queries transposed: one pointer serves the 12 broadcasts of a d */
    for (int r = 0; r < PF_R; r++)
        for (int d = 0; d < D; d++) qt[d][r] = qs[r * D + d];
    const int cl = minws / VLEN, ch = maxpos / VLEN + 1; /* chunks any row of this tile sees */
    for (int c = cl > c0 ? cl : c0; c < ch && c < c1; c++) {
        const float *ktc = kt + (int64_t)(c - c0) * D * VLEN;
        vfloat S[PF_R]; /* indexed by constants only (unrolled), so it lives in registers */
#pragma GCC unroll 12
        for (int r = 0; r < PF_R; r++) S[r] = vzero();
        for (int d = 0; d < D; d++) {
            const vfloat kv = vload(ktc + d * VLEN);
#pragma GCC unroll 12
            for (int r = 0; r < PF_R; r++) S[r] = vfmadd(vbroadcast(&qt[d][r]), kv, S[r]);
        }
        if (cap > 0.0f) { /* Gemma 2's soft-cap, on the scores in registers before any mask */
            const vfloat vcap = vset1(cap), vinv = vset1(1.0f / cap);
#pragma GCC unroll 12
            for (int r = 0; r < PF_R; r++) S[r] = vsoftcap(S[r], vcap, vinv);
        }
#pragma GCC unroll 12
        for (int r = 0; r < PF_R; r++) vstore(sc[r], S[r]);
        const int full = c * VLEN + VLEN - 1 <= minpos && c * VLEN >= maxws;
        const vint kidx = viadd(viset1(c * VLEN), iota);
        for (int r = 0; r < PF_R; r++) {
            const vmask mk = full ? vmask_first(VLEN) : vmask_range(kidx, ws[r], pos[r]); /* ws <= key <= pos */
            const vfloat sr = vload(sc[r]);
            const float mx = vhmax(vblend(vset1(-INFINITY), sr, mk));
            const float mnew = mx > m[r] ? mx : m[r];
            if (mnew == -INFINITY) {
                vstore(ps[r], vzero());
                corr[r] = 0.0f; /* exp(0): the row's sums stay as they are (zero) */
                rsum[r] = 0.0f;
                continue;
            }
            const vfloat e = vmaskz(mk, vexp(vsub(sr, vset1(mnew))));
            vstore(ps[r], e);
            corr[r] = m[r] == -INFINITY ? -INFINITY : m[r] - mnew; /* exp below: 0 where nothing was seen */
            rsum[r] = vhsum(e);
            m[r] = mnew;
        }
        for (int r = PF_R; r < PF_RV; r++) corr[r] = 0.0f;
        for (int r = 0; r < PF_RV; r += VLEN) vstore(corr + r, vexp(vload(corr + r))); /* the rows' rescales */
        for (int r = 0; r < PF_R; r++) l[r] = l[r] * corr[r] + rsum[r];
        const int j1 = kend - c * VLEN < VLEN ? kend - c * VLEN : VLEN;
        int64_t vrow[VLEN]; /* element offsets of the chunk's V rows */
        for (int j = 0; j < j1; j++) {
            const int key = c * VLEN + j;
            vrow[j] = ((int64_t)bt_row[key / bs] * bs + key % bs) * tok_stride + (int64_t)h * D;
        }
        for (int i = 0; i < DV; i++) {
            vfloat acc[PF_R];
#pragma GCC unroll 12
            for (int r = 0; r < PF_R; r++) acc[r] = vmul(vload(O + r * D + VLEN * i), vset1(corr[r]));
            for (int j = 0; j < j1; j++) {
                const vfloat vv = vload_as(vc, vrow[j] + VLEN * i, BF);
#pragma GCC unroll 12
                for (int r = 0; r < PF_R; r++) acc[r] = vfmadd(vbroadcast(&ps[r][j]), vv, acc[r]);
            }
#pragma GCC unroll 12
            for (int r = 0; r < PF_R; r++) vstore(O + r * D + VLEN * i, acc[r]);
        }
    }
}
#endif

#ifdef PF_W
/* KV head h of one prefill chunk, query positions [i0, i1) of the chunk (absolute ctx + i). */
static inline __attribute__((always_inline)) void pf_task(
    const float *q, int64_t q_stride, const void *kc, const void *vc, const int32_t *bt_row, int ctx,
    int i0, int i1, float *out, int64_t out_stride, int h, int Hkv, const int D, int G, int bs, float scale,
    int window, float cap, const float *sinks, float *kt, const int BF)
{
    const int64_t tok_stride = (int64_t)Hkv * D;
    const int kend = ctx + i1;
    const int first = ctx + i0;
    const int kstart = window > 0 && first - window + 1 > 0 ? first - window + 1 : 0;
    const int c0 = kstart / PF_W, c1 = (kend + PF_W - 1) / PF_W;
    for (int c = c0; c < c1; c++) { /* K of the chunks this task reads, transposed: kt[c][d][PF_W keys] */
        float *dst = kt + (int64_t)(c - c0) * D * PF_W;
        for (int j = 0; j < PF_W; j++) {
            const int key = c * PF_W + j;
            if (key >= kstart && key < kend) {
                const int64_t at = ((int64_t)bt_row[key / bs] * bs + key % bs) * tok_stride + (int64_t)h * D;
                if (BF) {
                    const uint16_t *src = (const uint16_t *)kc + at;
                    for (int d = 0; d < D; d++) dst[d * PF_W + j] = bf16_to_f32(src[d]);
                } else {
                    const float *src = (const float *)kc + at;
                    for (int d = 0; d < D; d++) dst[d * PF_W + j] = src[d];
                }
            } else {
                for (int d = 0; d < D; d++) dst[d * PF_W + j] = 0.0f;
            }
        }
    }
    const int P = PF_R / G; /* positions per tile */
    float qs[PF_R * PF_MAXD] __attribute__((aligned(64)));
    float O[PF_R * PF_MAXD] __attribute__((aligned(64)));
    float m[PF_R], l[PF_R];
    int pos[PF_R], ws[PF_R];
    const float *qrow[PF_R];
    float *orow[PF_R];
    for (int i = i0; i < i1; i += P) {
        const int np = i1 - i < P ? i1 - i : P;
        const int R = np * G;
        for (int r = 0; r < PF_R; r++) {
            const int rr = r < R ? r : R - 1; /* padding rows repeat the last real row, never stored */
            const int p = rr / G, g = rr % G;
            qrow[r] = q + (int64_t)(i + p) * q_stride + (int64_t)(h * G + g) * D;
            orow[r] = r < R ? out + (int64_t)(i + p) * out_stride + (int64_t)(h * G + g) * D : 0;
            pos[r] = ctx + i + p;
            ws[r] = window > 0 && pos[r] - window + 1 > 0 ? pos[r] - window + 1 : 0;
            for (int d = 0; d < D; d++) { qs[r * D + d] = qrow[r][d] * scale; O[r * D + d] = 0.0f; }
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
        pf_tile(qs, pos, ws, PF_R, kt, c0, c1, vc, bt_row, bs, tok_stride, h, kend, O, m, l, cap, D, BF);
        for (int r = 0; r < R; r++) {
            const float inv = sinks ? sink_norm(m[r], l[r], sinks[h * G + r % G]) : 1.0f / l[r];
            for (int d = 0; d < D; d++) orow[r][d] = O[r * D + d] * inv;
        }
    }
}
#endif

/* Prefill chunks of one step: chunk i has rows [starts[i], starts[i] + qlens[i]) of q/out, ctx_lens[i] tokens
   cached before it, and block table row seq_idx[i]. Tasks: (chunk, KV head, range of pr positions). */
static inline __attribute__((always_inline)) int paged_prefill(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int32_t *block_tables,
    int64_t bt_stride, const int64_t *seq_idx, const int64_t *starts, const int64_t *qlens,
    const int64_t *ctx_lens, int n, float *out, int64_t out_stride, int H, int Hkv, int D, int bs, float scale,
    int window, float cap, const float *sinks, float *scratch, int64_t scratch_per_thread, int nthreads,
    const int BF)
{
#ifdef PF_W
    const int G = H / Hkv;
    if (G * Hkv != H || G > PF_R || D > PF_MAXD || D % 16) return 1;
    const int P = PF_R / G;
    const int pr = P * (128 / PF_W); /* positions per task range: 16 tiles on AVX2, 8 on AVX-512 */
    int64_t ntask = 0;
    for (int i = 0; i < n; i++) ntask += (int64_t)Hkv * ((qlens[i] + pr - 1) / pr);
    #pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
        float *kt = scratch + (int64_t)omp_get_thread_num() * scratch_per_thread;
#else
        float *kt = scratch;
#endif
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntask; task++) {
            /* later ranges first: they see more keys */
            int64_t t = ntask - 1 - task;
            int i = 0;
            for (; i < n; i++) {
                const int64_t c = (int64_t)Hkv * ((qlens[i] + pr - 1) / pr);
                if (t < c) break;
                t -= c;
            }
            const int h = (int)(t % Hkv);
            const int r = (int)(t / Hkv);
            const int i0 = r * pr, i1 = (r + 1) * pr < qlens[i] ? (r + 1) * pr : (int)qlens[i];
            const float *qi = q + starts[i] * q_stride;
            float *oi = out + starts[i] * out_stride;
            const int32_t *bt = block_tables + seq_idx[i] * bt_stride;
            if (D == 64)
                pf_task(qi, q_stride, k_cache, v_cache, bt, (int)ctx_lens[i], i0, i1, oi, out_stride, h, Hkv, 64, G,
                        bs, scale, window, cap, sinks, kt, BF);
            else
                pf_task(qi, q_stride, k_cache, v_cache, bt, (int)ctx_lens[i], i0, i1, oi, out_stride, h, Hkv, D, G,
                        bs, scale, window, cap, sinks, kt, BF);
        }
    }
    return 0;
#else
    return 2;
#endif
}

#define PF_ARGS_DECL const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, \
    const int32_t *block_tables, int64_t bt_stride, const int64_t *seq_idx, const int64_t *starts, \
    const int64_t *qlens, const int64_t *ctx_lens, int n, float *out, int64_t out_stride, int H, int Hkv, int D, \
    int bs, float scale, int window, float logit_softcap, const float *sinks, float *scratch, \
    int64_t scratch_per_thread, int nthreads
#define PF_ARGS q, q_stride, k_cache, v_cache, block_tables, bt_stride, seq_idx, starts, qlens, ctx_lens, n, out, \
    out_stride, H, Hkv, D, bs, scale, window, logit_softcap, sinks, scratch, scratch_per_thread, nthreads

int pagoda_paged_prefill_f32(PF_ARGS_DECL) { return paged_prefill(PF_ARGS, 0); }
/* bfloat16 cache (a bfloat16 model's): keys widened into the transposed scratch, values in registers. */
int pagoda_paged_prefill_bf16(PF_ARGS_DECL) { return paged_prefill(PF_ARGS, 1); }
