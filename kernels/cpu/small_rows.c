/* y = x w^T for a few rows of x (decode steps of one to four sequences) over a float32 weight [N, K] in its own
   row-major layout (engine/models/cpu_linear.py binds it). At these row counts the product is a stream of the
   weight through memory: each thread reads one contiguous share of the weight rows once, and every row of x
   is multiplied against each weight row while it is in registers. */
#include "pagoda_cpu.h"

#define SMALL_ROWS_MAX 4

#if defined(__AVX2__) && defined(__FMA__)
/* One weight row against M rows of x: two accumulators per row of x hide the FMA latency. */
static inline __attribute__((always_inline)) void row_avx2(const float *x, int64_t xs, const float *wr, int64_t K,
                                                           float *y, int64_t ys, const int M)
{
    __m256 a0[SMALL_ROWS_MAX], a1[SMALL_ROWS_MAX];
    for (int m = 0; m < M; m++) {
        a0[m] = _mm256_setzero_ps();
        a1[m] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 w0 = _mm256_loadu_ps(wr + k), w1 = _mm256_loadu_ps(wr + k + 8);
        for (int m = 0; m < M; m++) {
            a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * xs + k), a0[m]);
            a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * xs + k + 8), a1[m]);
        }
    }
    for (int m = 0; m < M; m++) {
        float s = hsum8(_mm256_add_ps(a0[m], a1[m]));
        for (int64_t j = k; j < K; j++) s += wr[j] * x[m * xs + j];
        y[m * ys] = s;
    }
}
#endif

/* x [M, K] (row stride x_stride), w [N, K] (row stride w_stride), y [M, N] (row stride y_stride); 1 = M is not
   a small row count. */
int pagoda_small_rows_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const float *w, int64_t N,
                          int64_t w_stride, float *y, int64_t y_stride, int nthreads)
{
    if (M < 1 || M > SMALL_ROWS_MAX) return 1;
    (void)nthreads;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const float *wr = w + n * w_stride;
#if defined(__AVX2__) && defined(__FMA__)
        switch (M) {
        case 1: row_avx2(x, x_stride, wr, K, y + n, y_stride, 1); break;
        case 2: row_avx2(x, x_stride, wr, K, y + n, y_stride, 2); break;
        case 3: row_avx2(x, x_stride, wr, K, y + n, y_stride, 3); break;
        default: row_avx2(x, x_stride, wr, K, y + n, y_stride, 4); break;
        }
#else
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * x_stride;
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (int64_t k = 0; k < K; k++) s += wr[k] * xm[k];
            y[m * y_stride + n] = s;
        }
#endif
    }
    return 0;
}
