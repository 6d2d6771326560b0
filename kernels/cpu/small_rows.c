/* y = x w^T for up to 64 float32 rows of x (decode steps) over a float32 or bfloat16 weight [N, K] in its own
   row-major layout (engine/models/cpu_linear.py binds it). A bfloat16 weight is widened in registers (exact),
   so it streams half the bytes.

   Up to eight rows the product is a stream of the weight through memory: each thread reads one contiguous
   share of the weight rows once, and every row of x is multiplied against each weight row while it is in
   registers. From nine rows on it is bound by arithmetic and by how soon the weight arrives: tiles of four x
   rows by three weight rows keep twelve dot products in registers, each thread walks its weight in chunks small
   enough to stay in its L2 while every block of x rows passes over them, and fetches the next chunk into L2
   while it computes this one. */
#include "pagoda_cpu.h"

#define STREAM_ROWS_MAX 8
#define ROWS_MAX 64

#ifdef VLEN
/* One weight row against M rows of x: up to four rows keep two accumulators each to hide the FMA latency;
   more rows are enough independent chains with one each. */
static inline __attribute__((always_inline)) void row_vec(const float *x, int64_t xs, const void *wr, int64_t K,
                                                           float *y, int64_t ys, const int M, const int BF)
{
    vfloat a0[STREAM_ROWS_MAX], a1[STREAM_ROWS_MAX];
    for (int m = 0; m < M; m++) {
        a0[m] = vzero();
        a1[m] = vzero();
    }
    int64_t k = 0;
    for (; k + 2 * VLEN <= K; k += 2 * VLEN) {
        const vfloat w0 = vload_as(wr, k, BF), w1 = vload_as(wr, k + VLEN, BF);
        for (int m = 0; m < M; m++) {
            a0[m] = vfmadd(w0, vloadu(x + m * xs + k), a0[m]);
            if (M <= 4) a1[m] = vfmadd(w1, vloadu(x + m * xs + k + VLEN), a1[m]);
            else a0[m] = vfmadd(w1, vloadu(x + m * xs + k + VLEN), a0[m]);
        }
    }
    for (int m = 0; m < M; m++) {
        float s = vhsum(M <= 4 ? vadd(a0[m], a1[m]) : a0[m]);
        for (int64_t j = k; j < K; j++) s += load_as(wr, j, BF) * x[m * xs + j];
        y[m * ys] = s;
    }
}

/* A tile of M (<= 4) rows of x by N (<= 3) weight rows, each output a dot product over K: twelve accumulators,
   three weight vectors and one x vector fill AVX2's sixteen registers; per VLEN k, four x loads and three
   weight loads feed twelve fused multiply-adds. */
static inline __attribute__((always_inline)) void tile_vec(const float *x, int64_t xs, const void *w, int64_t ws,
                                                            int64_t K, float *y, int64_t ys, const int M,
                                                            const int N, const int BF)
{
    const int64_t esize = BF ? 2 : 4;
    const char *wr[3];
    for (int j = 0; j < N; j++) wr[j] = (const char *)w + j * ws * esize;
    vfloat acc[4][3];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < N; j++) acc[m][j] = vzero();
    int64_t k = 0;
    for (; k + VLEN <= K; k += VLEN) {
        vfloat wv[3];
        for (int j = 0; j < N; j++) wv[j] = vload_as(wr[j], k, BF);
        for (int m = 0; m < M; m++) {
            const vfloat xv = vloadu(x + m * xs + k);
            for (int j = 0; j < N; j++) acc[m][j] = vfmadd(xv, wv[j], acc[m][j]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < N; j++) {
            float s = vhsum(acc[m][j]);
            for (int64_t t = k; t < K; t++) s += load_as(wr[j], t, BF) * x[m * xs + t];
            y[m * ys + j] = s;
        }
}

#define TILE_N 3
#define CHUNK_N 12 /* weight rows per chunk: four tiles wide */

static inline __attribute__((always_inline)) void tiles_vec(const float *x, int64_t M, int64_t K, int64_t xs,
                                                             const void *w, int64_t n0, int64_t n1, int64_t ws,
                                                             float *y, int64_t ys, int64_t n_end, const int BF)
{
    const int64_t esize = BF ? 2 : 4;
    /* the next chunk's weight rows (the same thread's, under the static schedule) are fetched into L2 a slice
       per tile while this chunk computes */
    const int64_t next = (n_end - n1 < CHUNK_N ? n_end - n1 : CHUNK_N);
    const char *pf = (const char *)w + n1 * ws * esize;
    const int64_t pf_lines = next > 0 ? (next * ws * esize + 63) / 64 : 0;
    const int64_t tiles = ((M + 3) / 4) * ((n1 - n0 + TILE_N - 1) / TILE_N);
    const int64_t per_tile = (pf_lines + tiles - 1) / tiles;
    int64_t pf_done = 0;
    for (int64_t m = 0; m < M; m += 4) {
        const int mr = M - m < 4 ? (int)(M - m) : 4;
        const float *xm = x + m * xs;
        for (int64_t n = n0; n < n1; n += TILE_N) {
            const int nr = n1 - n < TILE_N ? (int)(n1 - n) : TILE_N;
            const void *wn = (const char *)w + n * ws * esize;
            float *yt = y + m * ys + n;
            for (int64_t i = 0; i < per_tile && pf_done < pf_lines; i++, pf_done++)
                _mm_prefetch(pf + pf_done * 64, _MM_HINT_T1);
#define T(MR, NR) tile_vec(xm, xs, wn, ws, K, yt, ys, MR, NR, BF)
#define BY_ROWS(NR) \
    switch (mr) { case 4: T(4, NR); break; case 3: T(3, NR); break; case 2: T(2, NR); break; default: T(1, NR); }
            if (nr == 3) BY_ROWS(3)
            else if (nr == 2) BY_ROWS(2)
            else BY_ROWS(1)
#undef BY_ROWS
#undef T
        }
    }
}

static int tiled_rows(const float *x, int64_t M, int64_t K, int64_t xs, const void *w, int64_t N, int64_t ws,
                       float *y, int64_t ys, int nthreads, const int BF)
{
    const int64_t chunks = (N + CHUNK_N - 1) / CHUNK_N;
    (void)nthreads;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * CHUNK_N, n1 = n0 + CHUNK_N < N ? n0 + CHUNK_N : N;
        if (BF) tiles_vec(x, M, K, xs, w, n0, n1, ws, y, ys, N, 1);
        else tiles_vec(x, M, K, xs, w, n0, n1, ws, y, ys, N, 0);
    }
    return 0;
}
#endif

static inline __attribute__((always_inline)) int small_rows(const float *x, int64_t M, int64_t K, int64_t x_stride,
                                                            const void *w, int64_t N, int64_t w_stride, float *y,
                                                            int64_t y_stride, int nthreads, const int BF)
{
    if (M < 1 || M > ROWS_MAX) return 1;
#ifdef VLEN
    if (M > STREAM_ROWS_MAX) return tiled_rows(x, M, K, x_stride, w, N, w_stride, y, y_stride, nthreads, BF);
#endif
    (void)nthreads;
    const int64_t esize = BF ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const void *wr = (const char *)w + n * w_stride * esize;
#ifdef VLEN
        switch (M) {
        case 1: row_vec(x, x_stride, wr, K, y + n, y_stride, 1, BF); break;
        case 2: row_vec(x, x_stride, wr, K, y + n, y_stride, 2, BF); break;
        case 3: row_vec(x, x_stride, wr, K, y + n, y_stride, 3, BF); break;
        case 4: row_vec(x, x_stride, wr, K, y + n, y_stride, 4, BF); break;
        case 5: row_vec(x, x_stride, wr, K, y + n, y_stride, 5, BF); break;
        case 6: row_vec(x, x_stride, wr, K, y + n, y_stride, 6, BF); break;
        case 7: row_vec(x, x_stride, wr, K, y + n, y_stride, 7, BF); break;
        default: row_vec(x, x_stride, wr, K, y + n, y_stride, 8, BF); break;
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
   y_stride); 1 = M is outside 1..64. */
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
