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
#ifdef VLEN
        /* the sixteen lanes as LANES / VLEN vectors */
        vfloat vmx[LANES / VLEN], vsum[LANES / VLEN];
        vint varg[LANES / VLEN], vidx[LANES / VLEN];
        for (int h = 0; h < LANES / VLEN; h++) {
            vmx[h] = vset1(-INFINITY);
            vsum[h] = vzero();
            varg[h] = viset1(0);
            vidx[h] = viadd(viota(), viset1(VLEN * h));
        }
        const vint step = viset1(LANES);
        for (; i + LANES <= V && V < 2147483647; i += LANES) {
            for (int h = 0; h < LANES / VLEN; h++) {
                const vfloat v = vloadu(row + i + VLEN * h);
                const vmask gt = vcmpgt(v, vmx[h]);
                if (with_lp) {
                    /* rescale the running sums of the lanes whose maximum grows */
                    const vfloat nmax = vmax(vmx[h], v);
                    vsum[h] = vmul(vsum[h], vexp(vsub(vmx[h], nmax)));
                    vsum[h] = vadd(vsum[h], vexp(vsub(v, nmax)));
                    vmx[h] = nmax;
                } else {
                    vmx[h] = vblend(vmx[h], v, gt);
                }
                varg[h] = viblend(varg[h], vidx[h], gt);
                vidx[h] = viadd(vidx[h], step);
            }
        }
        if (i > 0) {
            int32_t larg32[LANES];
            for (int h = 0; h < LANES / VLEN; h++) {
                vstore(lmax + VLEN * h, vmx[h]);
                vstore(lsum + VLEN * h, vsum[h]);
                vistoreu(larg32 + VLEN * h, varg[h]);
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
