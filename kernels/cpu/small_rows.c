/* y = x w^T for a few float32 rows of x (decode steps of one to eight sequences) over a float32 or bfloat16
   weight [N, K] in its own row-major layout (engine/models/cpu_linear.py binds it). At these row counts the
   product is a stream of the weight through memory: each thread reads one contiguous share of the weight rows
   once, and every row of x is multiplied against each weight row while it is in registers. A bfloat16 weight
   is widened in registers (exact), so it streams half the bytes. */
#include "pagoda_cpu.h"

#define SMALL_ROWS_MAX 8

#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) __m256 w8(const void *w, int64_t k, const int BF)
{
    return BF ? bf16x8((const uint16_t *)w + k) : _mm256_loadu_ps((const float *)w + k);
}

/* One weight row against M rows of x: up to four rows keep two accumulators each to hide the FMA latency;
   more rows are enough independent chains with one each. */
static inline __attribute__((always_inline)) void row_avx2(const float *x, int64_t xs, const void *wr, int64_t K,
                                                           float *y, int64_t ys, const int M, const int BF)
{
    __m256 a0[SMALL_ROWS_MAX], a1[SMALL_ROWS_MAX];
    for (int m = 0; m < M; m++) {
        a0[m] = _mm256_setzero_ps();
        a1[m] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 w0 = w8(wr, k, BF), w1 = w8(wr, k + 8, BF);
        for (int m = 0; m < M; m++) {
            if (M <= 4) {
                a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * xs + k), a0[m]);
                a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * xs + k + 8), a1[m]);
            } else {
                a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * xs + k), a0[m]);
                a0[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * xs + k + 8), a0[m]);
            }
        }
    }
    for (int m = 0; m < M; m++) {
        float s = hsum8(M <= 4 ? _mm256_add_ps(a0[m], a1[m]) : a0[m]);
        for (int64_t j = k; j < K; j++)
            s += (BF ? bf16_to_f32(((const uint16_t *)wr)[j]) : ((const float *)wr)[j]) * x[m * xs + j];
        y[m * ys] = s;
    }
}
#endif

static inline __attribute__((always_inline)) int small_rows(const float *x, int64_t M, int64_t K, int64_t x_stride,
                                                            const void *w, int64_t N, int64_t w_stride, float *y,
                                                            int64_t y_stride, int nthreads, const int BF)
{
    if (M < 1 || M > SMALL_ROWS_MAX) return 1;
    (void)nthreads;
    const int64_t esize = BF ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const void *wr = (const char *)w + n * w_stride * esize;
#if defined(__AVX2__) && defined(__FMA__)
        switch (M) {
        case 1: row_avx2(x, x_stride, wr, K, y + n, y_stride, 1, BF); break;
        case 2: row_avx2(x, x_stride, wr, K, y + n, y_stride, 2, BF); break;
        case 3: row_avx2(x, x_stride, wr, K, y + n, y_stride, 3, BF); break;
        case 4: row_avx2(x, x_stride, wr, K, y + n, y_stride, 4, BF); break;
        case 5: row_avx2(x, x_stride, wr, K, y + n, y_stride, 5, BF); break;
        case 6: row_avx2(x, x_stride, wr, K, y + n, y_stride, 6, BF); break;
        case 7: row_avx2(x, x_stride, wr, K, y + n, y_stride, 7, BF); break;
        default: row_avx2(x, x_stride, wr, K, y + n, y_stride, 8, BF); break;
        }
#else
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * x_stride;
            float s = 0.0f;
            if (BF) {
                const uint16_t *wb = (const uint16_t *)wr;
                #pragma omp simd reduction(+:s)
                for (int64_t k = 0; k < K; k++) s += bf16_to_f32(wb[k]) * xm[k];
            } else {
                const float *wf = (const float *)wr;
                #pragma omp simd reduction(+:s)
                for (int64_t k = 0; k < K; k++) s += wf[k] * xm[k];
            }
            y[m * y_stride + n] = s;
        }
#endif
    }
    return 0;
}

/* x [M, K] (row stride x_stride), w [N, K] (row stride w_stride, in elements), y [M, N] (row stride
   y_stride); 1 = M is not a small row count. */
int pagoda_small_rows_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const float *w, int64_t N,
                          int64_t w_stride, float *y, int64_t y_stride, int nthreads)
{
    return small_rows(x, M, K, x_stride, w, N, w_stride, y, y_stride, nthreads, 0);
}

/* The same over a bfloat16 weight. */
int pagoda_small_rows_bf16w(const float *x, int64_t M, int64_t K, int64_t x_stride, const uint16_t *w, int64_t N,
                            int64_t w_stride, float *y, int64_t y_stride, int nthreads)
{
    return small_rows(x, M, K, x_stride, w, N, w_stride, y, y_stride, nthreads, 1);
}
