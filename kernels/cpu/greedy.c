/* Greedy sampling: argmax and its logprob in one pass over each row of logits (engine/cpu_sampling.py binds it).

   Every path keeps 16 lanes, each with its own running maximum, first index of it and sum of exponentials
   rescaled to it, and combine the lanes at the end: a row of 49,152 logits is 16 sums of about 3,000 terms
   instead of one serial sum of all of them, whose float32 rounding moved the logprob by 1e-4. */
#include "pagoda_cpu.h"

#define LANES 16

/* Lanes -> the row's first maximum and, with want_lp, the sum of exp(x - max) (lanes that saw nothing hold
   -inf and contribute nothing). */
static inline void combine(const float *lmax, const float *lsum, const int64_t *larg, int with_lp, float *best,
                           int64_t *arg, float *sum)
{
    for (int l = 0; l < LANES; l++)
        if (lmax[l] > *best || (lmax[l] == *best && larg[l] < *arg)) { *best = lmax[l]; *arg = larg[l]; }
    if (with_lp)
        for (int l = 0; l < LANES; l++)
            if (lmax[l] > -INFINITY) *sum += lsum[l] * expf(lmax[l] - *best);
}

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
        float lmax[LANES] __attribute__((aligned(64))), lsum[LANES] __attribute__((aligned(64)));
        int64_t larg[LANES];
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
            int32_t larg32[LANES];
            _mm512_store_ps(lmax, vmax);
            _mm512_store_ps(lsum, vsum);
            _mm512_storeu_si512((void *)larg32, varg);
            for (int l = 0; l < LANES; l++) larg[l] = larg32[l];
            combine(lmax, lsum, larg, with_lp, &best, &arg, &sum);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        /* the same sixteen lanes as two halves of eight */
        __m256 vmax[2], vsum[2];
        __m256i varg[2], vidx[2];
        for (int h = 0; h < 2; h++) {
            vmax[h] = _mm256_set1_ps(-INFINITY);
            vsum[h] = _mm256_setzero_ps();
            varg[h] = _mm256_setzero_si256();
            vidx[h] = _mm256_setr_epi32(8 * h, 8 * h + 1, 8 * h + 2, 8 * h + 3, 8 * h + 4, 8 * h + 5, 8 * h + 6,
                                        8 * h + 7);
        }
        const __m256i step = _mm256_set1_epi32(16);
        for (; i + 16 <= V && V < 2147483647; i += 16) {
            for (int h = 0; h < 2; h++) {
                const __m256 v = _mm256_loadu_ps(row + i + 8 * h);
                const __m256 gt = _mm256_cmp_ps(v, vmax[h], _CMP_GT_OQ);
                if (with_lp) {
                    const __m256 nmax = _mm256_max_ps(vmax[h], v);
                    vsum[h] = _mm256_mul_ps(vsum[h], exp8(_mm256_sub_ps(vmax[h], nmax)));
                    vsum[h] = _mm256_add_ps(vsum[h], exp8(_mm256_sub_ps(v, nmax)));
                    vmax[h] = nmax;
                } else {
                    vmax[h] = _mm256_blendv_ps(vmax[h], v, gt);
                }
                varg[h] = _mm256_castps_si256(
                    _mm256_blendv_ps(_mm256_castsi256_ps(varg[h]), _mm256_castsi256_ps(vidx[h]), gt));
                vidx[h] = _mm256_add_epi32(vidx[h], step);
            }
        }
        if (i > 0) {
            int32_t larg32[LANES];
            for (int h = 0; h < 2; h++) {
                _mm256_store_ps(lmax + 8 * h, vmax[h]);
                _mm256_store_ps(lsum + 8 * h, vsum[h]);
                _mm256_storeu_si256((__m256i *)(larg32 + 8 * h), varg[h]);
            }
            for (int l = 0; l < LANES; l++) larg[l] = larg32[l];
            combine(lmax, lsum, larg, with_lp, &best, &arg, &sum);
        }
#else
        if (V >= LANES) {
            for (int l = 0; l < LANES; l++) { lmax[l] = -INFINITY; lsum[l] = 0.0f; larg[l] = 0; }
            for (; i + LANES <= V; i += LANES) {
                if (with_lp) {
                    for (int l = 0; l < LANES; l++) {
                        const float v = row[i + l], m = lmax[l];
                        const float nmax = v > m ? v : m;
                        lsum[l] = lsum[l] * exp_neg(m - nmax) + exp_neg(v - nmax);
                        larg[l] = v > m ? i + l : larg[l];
                        lmax[l] = nmax;
                    }
                } else {
                    for (int l = 0; l < LANES; l++) {
                        const float v = row[i + l];
                        larg[l] = v > lmax[l] ? i + l : larg[l];
                        lmax[l] = v > lmax[l] ? v : lmax[l];
                    }
                }
            }
            combine(lmax, lsum, larg, with_lp, &best, &arg, &sum);
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
