/* Paged decode attention: one task per (sequence, KV head), online softmax over the block table (engine/attention/cpu_decode.py binds it). */
#include "pagoda_cpu.h"

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

#if defined(__AVX2__) && defined(__FMA__)
/* The same task on 8 lanes (an AVX2 CPU without AVX-512); D a multiple of 8. */
static inline __attribute__((always_inline)) void task_avx2(
    const float *qs, const void *kc, const void *vc, const float *ksc, const float *vsc, const int32_t *bt_row,
    int len, float *os, int h, int Hkv, const int D, const int G, int bs, float scale, int window, const int CT)
{
    const int I8 = CT == CT_I8, BF = CT == CT_BF16;
    const int DV = D / 8;
    const int start = window_start(len, window);
    const int64_t tok_stride = (int64_t)Hkv * D;
    __m256 qv[MAXG][MAXD / 8], acc[MAXG][MAXD / 8];
    float m[MAXG], l[MAXG];
    float sc[MAXG][MAXBS] __attribute__((aligned(32)));
    for (int g = 0; g < G; g++) {
        for (int i = 0; i < DV; i++) {
            qv[g][i] = _mm256_mul_ps(_mm256_loadu_ps(qs + g * D + 8 * i), _mm256_set1_ps(scale));
            acc[g][i] = _mm256_setzero_ps();
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const int esz = I8 ? 1 : BF ? 2 : 4;
    for (int b = start / bs; b * bs < len; b++) {
        const int64_t base = ((int64_t)bt_row[b] * bs * Hkv + h) * D;
        const int64_t sbase = (int64_t)bt_row[b] * bs * Hkv + h;
        const int t0 = start > b * bs ? start - b * bs : 0;
        const int t1 = len - b * bs < bs ? len - b * bs : bs;
        if ((b + 1) * bs < len && bt_row[b + 1] != bt_row[b] + 1) {
            const int64_t next = ((int64_t)bt_row[b + 1] * bs * Hkv + h) * D * esz;
            for (int t = 0; t < bs; t++)
                for (int off = 0; off < D * esz; off += 64) {
                    _mm_prefetch((const char *)kc + next + t * tok_stride * esz + off, _MM_HINT_T0);
                    _mm_prefetch((const char *)vc + next + t * tok_stride * esz + off, _MM_HINT_T0);
                }
        }
        for (int t = t0; t < t1; t++) {
            __m256 kk[MAXD / 8];
            for (int i = 0; i < DV; i++)
                kk[i] = I8 ? i8x8((const int8_t *)kc + base + t * tok_stride + 8 * i)
                        : BF ? bf16x8((const uint16_t *)kc + base + t * tok_stride + 8 * i)
                             : _mm256_loadu_ps((const float *)kc + base + t * tok_stride + 8 * i);
            for (int g = 0; g < G; g++) {
                __m256 s = _mm256_mul_ps(qv[g][0], kk[0]);
                for (int i = 1; i < DV; i++) s = _mm256_fmadd_ps(qv[g][i], kk[i], s);
                sc[g][t] = hsum8(s);
                if (I8) sc[g][t] *= ksc[sbase + (int64_t)t * Hkv];
            }
        }
        for (int g = 0; g < G; g++) {
            float bm = m[g];
            for (int t = t0; t < t1; t++) bm = sc[g][t] > bm ? sc[g][t] : bm;
            const float corr = m[g] == -INFINITY ? 0.0f : expf(m[g] - bm);
            const __m256 vbm = _mm256_set1_ps(bm);
            __m256 vsum = _mm256_setzero_ps();
            int t = t0;
            for (; t + 8 <= t1; t += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(&sc[g][t]), vbm));
                _mm256_storeu_ps(&sc[g][t], e);
                vsum = _mm256_add_ps(vsum, e);
            }
            float sum = hsum8(vsum);
            for (; t < t1; t++) {
                sc[g][t] = exp_neg(sc[g][t] - bm);
                sum += sc[g][t];
            }
            l[g] = l[g] * corr + sum;
            m[g] = bm;
            if (corr != 1.0f) {
                const __m256 c = _mm256_set1_ps(corr);
                for (int i = 0; i < DV; i++) acc[g][i] = _mm256_mul_ps(acc[g][i], c);
            }
        }
        for (int t = t0; t < t1; t++) {
            __m256 vv[MAXD / 8];
            for (int i = 0; i < DV; i++)
                vv[i] = I8 ? i8x8((const int8_t *)vc + base + t * tok_stride + 8 * i)
                        : BF ? bf16x8((const uint16_t *)vc + base + t * tok_stride + 8 * i)
                             : _mm256_loadu_ps((const float *)vc + base + t * tok_stride + 8 * i);
            const float vscale = I8 ? vsc[sbase + (int64_t)t * Hkv] : 1.0f;
            for (int g = 0; g < G; g++) {
                const __m256 p = _mm256_set1_ps(I8 ? sc[g][t] * vscale : sc[g][t]);
                for (int i = 0; i < DV; i++) acc[g][i] = _mm256_fmadd_ps(p, vv[i], acc[g][i]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const __m256 inv = _mm256_set1_ps(1.0f / l[g]);
        for (int i = 0; i < DV; i++) _mm256_storeu_ps(os + g * D + 8 * i, _mm256_mul_ps(acc[g][i], inv));
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
#elif defined(__AVX2__) && defined(__FMA__)
#define TASK2(DD, GG) task_avx2(qs, k_cache, v_cache, k_scales, v_scales, bt_row, len, os, h, Hkv, DD, GG, bs, \
                                scale, window, CT)
        if (D == 64 && G == 3) TASK2(64, 3);
        else if (D == 64 && G == 4) TASK2(64, 4);
        else if (D == 64 && G == 1) TASK2(64, 1);
        else if (D == 128 && G == 4) TASK2(128, 4);
        else if (D == 128 && G == 8) TASK2(128, 8);
        else if (D % 8 == 0) TASK2(D, G);
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
