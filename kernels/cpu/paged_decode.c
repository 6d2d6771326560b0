/* Paged decode attention: one task per (sequence, KV head), online softmax over the block table (engine/attention/cpu_decode.py binds it). */
#include "pagoda_cpu.h"

#define MAXG 16
#define MAXD 256
#define MAXBS 128
#define CT_F32 0 /* cache element types */
#define CT_I8 1
#define CT_BF16 2

/* Soft-cap the scores [t0, t1) of G rows `ld` floats apart (Gemma 2; only called with a cap). */
static inline void cap_scores(float *sc, int ld, int G, int t0, int t1, float cap)
{
    const float inv = 1.0f / cap;
    for (int g = 0; g < G; g++)
        for (int t = t0; t < t1; t++) sc[g * ld + t] = softcap(sc[g * ld + t], cap, inv);
}

/* Block range of one task: keys [start, len) where start honours the sliding window. */
static inline int window_start(int len, int window) { return (window > 0 && len > window) ? len - window : 0; }

#ifdef VLEN
/* A row of D cache elements of one token from element `at` on: float32, int8 (before its scale) or bfloat16,
   widened to VLEN-lane vectors. */
static inline __attribute__((always_inline)) void load_row(vfloat *dst, const void *cache, int64_t at, int DV,
                                                           const int CT)
{
    for (int i = 0; i < DV; i++)
        dst[i] = CT == CT_I8 ? vload_i8((const int8_t *)cache + at + VLEN * i)
                 : CT == CT_BF16 ? vload_bf16((const uint16_t *)cache + at + VLEN * i)
                                 : vloadu((const float *)cache + at + VLEN * i);
}

/* One (sequence, KV head) task on VLEN lanes; D a multiple of VLEN. Inlined with constant D and G so the
   accumulators stay in registers. */
static inline __attribute__((always_inline)) void task_vec(
    const float *qs, const void *kc, const void *vc, const float *ksc, const float *vsc, const int32_t *bt_row,
    int len, float *os, int h, int Hkv, const int D, const int G, int bs, float scale, int window, float cap,
    const float *snk, const int CT)
{
    const int I8 = CT == CT_I8, BF = CT == CT_BF16;
    const int DV = D / VLEN;
    const int start = window_start(len, window);
    const int64_t tok_stride = (int64_t)Hkv * D;
    vfloat qv[MAXG][MAXD / VLEN], acc[MAXG][MAXD / VLEN];
    float m[MAXG], l[MAXG];
    /* a block's scores, then its weights; a vector past the block's last token reads only this array */
    float sc[MAXG][MAXBS + VLEN] __attribute__((aligned(64)));
    for (int g = 0; g < G; g++) {
        for (int i = 0; i < DV; i++) {
            qv[g][i] = vmul(vloadu(qs + g * D + VLEN * i), vset1(scale));
            acc[g][i] = vzero();
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
            vfloat kk[MAXD / VLEN];
            load_row(kk, kc, base + t * tok_stride, DV, CT);
            for (int g = 0; g < G; g++) {
                vfloat s = vmul(qv[g][0], kk[0]);
                for (int i = 1; i < DV; i++) s = vfmadd(qv[g][i], kk[i], s);
                sc[g][t] = vhsum(s);
                if (I8) sc[g][t] *= ksc[sbase + (int64_t)t * Hkv];
            }
        }
        if (cap > 0.0f) cap_scores(&sc[0][0], MAXBS + VLEN, G, t0, t1, cap);
        for (int g = 0; g < G; g++) {
            float bm = m[g];
            for (int t = t0; t < t1; t++) bm = sc[g][t] > bm ? sc[g][t] : bm;
            const float corr = m[g] == -INFINITY ? 0.0f : expf(m[g] - bm);
            const vfloat vbm = vset1(bm);
            vfloat vsum = vzero();
            for (int t = t0; t < t1; t += VLEN) {
                const int n = t1 - t < VLEN ? t1 - t : VLEN;
                const vfloat e = vmaskz(vmask_first(n), vexp(vsub(vloadu(&sc[g][t]), vbm)));
                vstoreu(&sc[g][t], e);
                vsum = vadd(vsum, e);
            }
            l[g] = l[g] * corr + vhsum(vsum);
            m[g] = bm;
            if (corr != 1.0f) {
                const vfloat c = vset1(corr);
                for (int i = 0; i < DV; i++) acc[g][i] = vmul(acc[g][i], c);
            }
        }
        for (int t = t0; t < t1; t++) {
            vfloat vv[MAXD / VLEN];
            load_row(vv, vc, base + t * tok_stride, DV, CT);
            const float vscale = I8 ? vsc[sbase + (int64_t)t * Hkv] : 1.0f;
            for (int g = 0; g < G; g++) {
                const vfloat p = vset1(I8 ? sc[g][t] * vscale : sc[g][t]);
                for (int i = 0; i < DV; i++) acc[g][i] = vfmadd(p, vv[i], acc[g][i]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const vfloat inv = vset1(snk ? sink_norm(m[g], l[g], snk[g]) : 1.0f / l[g]);
        for (int i = 0; i < DV; i++) vstoreu(os + g * D + VLEN * i, vmul(acc[g][i], inv));
    }
}
#endif

/* Portable version of the same task (any D up to MAXD). */
static inline __attribute__((always_inline)) void task_portable(
    const float *qs, const void *kc, const void *vc, const float *ksc, const float *vsc, const int32_t *bt_row,
    int len, float *os, int h, int Hkv, int D, int G, int bs, float scale, int window, float cap, const float *snk,
    const int CT)
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
        if (cap > 0.0f) cap_scores(&sc[0][0], MAXBS, G, t0, t1, cap);
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
    for (int g = 0; g < G; g++) {
        const float inv = snk ? sink_norm(m[g], l[g], snk[g]) : 1.0f / l[g];
        for (int d = 0; d < D; d++) os[g * D + d] = acc[g][d] * inv;
    }
}

/* q/out: [tokens, H, D] rows at q_stride/out_stride floats; caches: [num_blocks, bs, Hkv, D] float32, or
   int8 with float32 scales [num_blocks, bs, Hkv] (I8); seq_idx[i] (or i) picks the sequence of decode i (its
   block table row and length); tok_rows[i] (or i) its row in q and out. */
static inline __attribute__((always_inline)) int paged_decode(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, const float *k_scales,
    const float *v_scales, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
    const int64_t *seq_idx, const int64_t *tok_rows, int n, float *out, int64_t out_stride, int H, int Hkv,
    int D, int bs, float scale, int window, float cap, const float *sinks, int nthreads, const int CT)
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
        const float *snk = sinks ? sinks + h * G : 0;
#ifdef VLEN
#define TASK(DD, GG) task_vec(qs, k_cache, v_cache, k_scales, v_scales, bt_row, len, os, h, Hkv, DD, GG, bs, \
                              scale, window, cap, snk, CT)
        if (D == 64 && G == 3) TASK(64, 3);
        else if (D == 64 && G == 4) TASK(64, 4);
        else if (D == 64 && G == 1) TASK(64, 1);
        else if (D == 128 && G == 4) TASK(128, 4);
        else if (D == 128 && G == 8) TASK(128, 8);
        else if (D % VLEN == 0) TASK(D, G);
        else
#undef TASK
#endif
        task_portable(qs, k_cache, v_cache, k_scales, v_scales, bt_row, len, os, h, Hkv, D, G, bs, scale, window,
                      cap, snk, CT);
    }
    return 0;
}

/* q, caches (float32, or bfloat16 in pagoda_paged_decode_bf16), block tables, ... as paged_decode. */
#define DECODE_ARGS_DECL const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, \
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, const int64_t *seq_idx, \
    const int64_t *tok_rows, int n, float *out, int64_t out_stride, int H, int Hkv, int D, int bs, float scale, \
    int window, float logit_softcap, const float *sinks, int nthreads
#define DECODE_ARGS q, q_stride, k_cache, v_cache, 0, 0, block_tables, bt_stride, seq_lens, seq_idx, tok_rows, n, \
    out, out_stride, H, Hkv, D, bs, scale, window, logit_softcap, sinks, nthreads

int pagoda_paged_decode_f32(DECODE_ARGS_DECL) { return paged_decode(DECODE_ARGS, CT_F32); }
/* bfloat16 cache (a bfloat16 model's): values widened to float32 in registers. */
int pagoda_paged_decode_bf16(DECODE_ARGS_DECL) { return paged_decode(DECODE_ARGS, CT_BF16); }

/* INT8 cache: values dequantized in registers, each token's K scale on its score, V scale on its weight. */
int pagoda_paged_decode_i8(const float *q, int64_t q_stride, const int8_t *k_cache, const int8_t *v_cache,
                           const float *k_scales, const float *v_scales, const int32_t *block_tables,
                           int64_t bt_stride, const int32_t *seq_lens, const int64_t *seq_idx,
                           const int64_t *tok_rows, int n, float *out, int64_t out_stride, int H, int Hkv, int D,
                           int bs, float scale, int window, float logit_softcap, const float *sinks,
                           int nthreads)
{
    return paged_decode(q, q_stride, k_cache, v_cache, k_scales, v_scales, block_tables, bt_stride, seq_lens,
                        seq_idx, tok_rows, n, out, out_stride, H, Hkv, D, bs, scale, window, logit_softcap, sinks, nthreads,
                        CT_I8);
}
