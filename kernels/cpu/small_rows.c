/* y = x w^T for up to 64 rows of x (decode steps) over a float32 or bfloat16 weight [N, K] in its own row-major
   layout (engine/models/cpu_linear.py binds it, engine/models/cpu_linear_choice.py picks it or oneDNN by timing
   both on the host). Three operand kinds, one body:
   - BF 0: float32 x and weight;
   - BF 1: float32 x, bfloat16 weight widened in registers (exact), so it streams half the bytes;
   - BF 2 (AVX-512 build, CPUs with AVX512-BF16): bfloat16 x and weight, multiplied in pairs by vdpbf16ps (each
     product of two bfloat16 values is exact in float32, the sums are float32), the weight read in place.

   Up to eight rows the product is a stream of the weight through memory: each thread reads one contiguous
   share of the weight rows once, and every row of x is multiplied against each weight row while it is in
   registers. From nine rows on it is bound by arithmetic and by how soon the weight arrives: tiles of four x
   rows by three weight rows keep twelve dot products in registers, each thread walks its weight in chunks small
   enough to stay in its L2 while every block of x rows passes over them, and fetches the next chunk into L2
   while it computes this one. */
#include "pagoda_cpu.h"

/* Up to STREAM_ROWS_MAX rows the weight streams past the rows of x, above that it is tiled: at AVX2's 8 lanes the
   stream wins up to 8 rows; at AVX-512's 16 lanes the 4 x 6 tiles win from 4 rows on (one thread, AMD EPYC:
   4 rows 61 against 67 us, 8 rows 107 against 120 through a [960, 576] float32 weight; bfloat16 pairs 68
   against 99 at 8 rows), as the stream's x loads, one per multiply-add, bound it there. */
#if defined(VLEN) && VLEN == 16
#define STREAM_ROWS_MAX 3
#else
#define STREAM_ROWS_MAX 8
#endif
#define ROWS_MAX 64

#ifdef VLEN
#if VLEN == 16
#define HAVE_DP 1
/* acc + the pairwise products of bfloat16 lanes a and b (vdpbf16ps, AVX512-BF16). Written as assembly so the
   AVX-512 build needs no AVX512-BF16 compiler target: BF 2 runs only where the CPU says it has them
   (pagoda_cpu_has_bf16_dot, info.c). Rounding: round to nearest even, and
   denormal inputs and outputs are flushed to zero whatever MXCSR says. */
VINLINE vfloat vdpbf16(vfloat acc, vint a, vint b)
{
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
    return acc;
}
#else
#define HAVE_DP 0
#endif

/* Elements of x (and of the weight) per vector step: VLEN float32 lanes, or VLEN pairs of bfloat16. */
#define KSTEP(BF) ((BF) == 2 ? 2 * VLEN : VLEN)

/* One vector step of x or of a weight row from element k: float32 lanes (a bfloat16 weight widened), or under
   BF 2 the raw bits of 2 * VLEN bfloat16 values, which only vmuladd reads. */
VINLINE vfloat vx_load(const void *x, int64_t k, const int BF)
{
    return BF == 2 ? vloadu((const float *)((const uint16_t *)x + k)) : vloadu((const float *)x + k);
}

VINLINE vfloat vw_load(const void *w, int64_t k, const int BF)
{
    return BF == 2 ? vloadu((const float *)((const uint16_t *)w + k)) : vload_as(w, k, BF);
}

/* acc + x * w lane-wise (one product per lane, or the two of a bfloat16 pair under BF 2). */
VINLINE vfloat vmuladd(vfloat acc, vfloat xv, vfloat wv, const int BF)
{
#if HAVE_DP
    if (BF == 2) return vdpbf16(acc, (vint)xv, (vint)wv);
#else
    (void)BF;
#endif
    return vfmadd(xv, wv, acc);
}
#endif

/* Scalar element k of x or of a weight row (the tails of rows): bfloat16 x only under BF 2, a bfloat16 weight
   under 1 and 2. */
static inline float x_at(const void *x, int64_t k, const int BF) { return load_as(x, k, BF == 2); }
static inline float w_at(const void *w, int64_t k, const int BF) { return load_as(w, k, BF != 0); }
static inline const void *x_row(const void *x, int64_t m, int64_t xs, const int BF)
{
    return (const char *)x + m * xs * (BF == 2 ? 2 : 4);
}

#ifdef VLEN
/* One weight row against M rows of x: up to four rows keep two accumulators each to hide the FMA latency;
   more rows are enough independent chains with one each. YB: y is bfloat16 (rounded once, at the end). */
VINLINE void row_vec(const void *x, int64_t xs, const void *wr, int64_t K, void *y, int64_t yi, int64_t ys,
                     const int M, const int BF, const int YB)
{
    const int S = KSTEP(BF);
    vfloat a0[STREAM_ROWS_MAX], a1[STREAM_ROWS_MAX];
    for (int m = 0; m < M; m++) {
        a0[m] = vzero();
        a1[m] = vzero();
    }
    int64_t k = 0;
    for (; k + 2 * S <= K; k += 2 * S) {
        const vfloat w0 = vw_load(wr, k, BF), w1 = vw_load(wr, k + S, BF);
        for (int m = 0; m < M; m++) {
            const void *xm = x_row(x, m, xs, BF);
            a0[m] = vmuladd(a0[m], vx_load(xm, k, BF), w0, BF);
            if (M <= 4) a1[m] = vmuladd(a1[m], vx_load(xm, k + S, BF), w1, BF);
            else a0[m] = vmuladd(a0[m], vx_load(xm, k + S, BF), w1, BF);
        }
    }
    for (int m = 0; m < M; m++) {
        const void *xm = x_row(x, m, xs, BF);
        float s = vhsum(M <= 4 ? vadd(a0[m], a1[m]) : a0[m]);
        for (int64_t j = k; j < K; j++) s += w_at(wr, j, BF) * x_at(xm, j, BF);
        store_as(y, yi + m * ys, s, YB);
    }
}

/* Weight rows per tile: AVX2's sixteen registers hold a tile of 4 x 3 (twelve accumulators, three weight vectors
   and one x vector); AVX-512's thirty-two hold 4 x 6 (measured faster there than 4 x 3 from 16 rows on). */
#if VLEN == 16
#define TILE_N 6
#else
#define TILE_N 3
#endif
#define CHUNK_N 12 /* weight rows per chunk: four tiles of three, or two of six */

/* A tile of M (<= 4) rows of x by N (<= TILE_N) weight rows, each output a dot product over K; per step of k,
   four x loads and N weight loads feed 4 N fused multiply-adds (or pairwise bfloat16 dot products). */
VINLINE void tile_vec(const void *x, int64_t xs, const void *w, int64_t ws, int64_t K, void *y, int64_t yi,
                      int64_t ys, const int M, const int N, const int BF, const int YB)
{
    const int S = KSTEP(BF);
    const int64_t esize = BF ? 2 : 4;
    const char *wr[TILE_N];
    for (int j = 0; j < N; j++) wr[j] = (const char *)w + j * ws * esize;
    vfloat acc[4][TILE_N];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < N; j++) acc[m][j] = vzero();
    int64_t k = 0;
    for (; k + S <= K; k += S) {
        vfloat wv[TILE_N];
        for (int j = 0; j < N; j++) wv[j] = vw_load(wr[j], k, BF);
        for (int m = 0; m < M; m++) {
            const vfloat xv = vx_load(x_row(x, m, xs, BF), k, BF);
            for (int j = 0; j < N; j++) acc[m][j] = vmuladd(acc[m][j], xv, wv[j], BF);
        }
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < N; j++) {
            const void *xm = x_row(x, m, xs, BF);
            float s = vhsum(acc[m][j]);
            for (int64_t t = k; t < K; t++) s += w_at(wr[j], t, BF) * x_at(xm, t, BF);
            store_as(y, yi + m * ys + j, s, YB);
        }
}


VINLINE void tiles_vec(const void *x, int64_t M, int64_t K, int64_t xs, const void *w, int64_t n0, int64_t n1,
                       int64_t ws, void *y, int64_t ys, int64_t n_end, const int BF, const int YB)
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
        const void *xm = x_row(x, m, xs, BF);
        for (int64_t n = n0; n < n1; n += TILE_N) {
            const int nr = n1 - n < TILE_N ? (int)(n1 - n) : TILE_N;
            const void *wn = (const char *)w + n * ws * esize;
            const int64_t yt = m * ys + n;
            for (int64_t i = 0; i < per_tile && pf_done < pf_lines; i++, pf_done++)
                _mm_prefetch(pf + pf_done * 64, _MM_HINT_T1);
#define T(MR, NR) tile_vec(xm, xs, wn, ws, K, y, yt, ys, MR, NR, BF, YB)
#define BY_ROWS(NR) \
    switch (mr) { case 4: T(4, NR); break; case 3: T(3, NR); break; case 2: T(2, NR); break; default: T(1, NR); }
            switch (nr) {
#if TILE_N == 6
            case 6: BY_ROWS(6) break;
            case 5: BY_ROWS(5) break;
            case 4: BY_ROWS(4) break;
#endif
            case 3: BY_ROWS(3) break;
            case 2: BY_ROWS(2) break;
            default: BY_ROWS(1)
            }
#undef BY_ROWS
#undef T
        }
    }
}

VINLINE int tiled_rows(const void *x, int64_t M, int64_t K, int64_t xs, const void *w, int64_t N, int64_t ws,
                       void *y, int64_t ys, int nthreads, const int BF, const int YB)
{
    const int64_t chunks = (N + CHUNK_N - 1) / CHUNK_N;
    (void)nthreads;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * CHUNK_N, n1 = n0 + CHUNK_N < N ? n0 + CHUNK_N : N;
        tiles_vec(x, M, K, xs, w, n0, n1, ws, y, ys, N, BF, YB);
    }
    return 0;
}
#endif

/* BF, YB: see the top of the file and row_vec. */
static inline __attribute__((always_inline)) int small_rows(const void *x, int64_t M, int64_t K, int64_t x_stride, const void *w, int64_t N,
                         int64_t w_stride, void *y, int64_t y_stride, int nthreads, const int BF, const int YB)
{
    if (M < 1 || M > ROWS_MAX) return 1;
#ifdef VLEN
    if (M > STREAM_ROWS_MAX) return tiled_rows(x, M, K, x_stride, w, N, w_stride, y, y_stride, nthreads, BF, YB);
#endif
    (void)nthreads;
    const int64_t esize = BF ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const void *wr = (const char *)w + n * w_stride * esize;
#ifdef VLEN
#define R(MR) row_vec(x, x_stride, wr, K, y, n, y_stride, MR, BF, YB)
        switch (M) {
        case 1: R(1); break;
        case 2: R(2); break;
#if STREAM_ROWS_MAX == 8
        case 3: R(3); break;
        case 4: R(4); break;
        case 5: R(5); break;
        case 6: R(6); break;
        case 7: R(7); break;
        default: R(8); break;
#else
        default: R(3); break;
#endif
        }
#undef R
#else
        for (int64_t m = 0; m < M; m++) {
            const void *xm = x_row(x, m, x_stride, BF);
            float s = 0.0f;
            if (BF) {
                const uint16_t *wb = (const uint16_t *)wr;
                #pragma omp simd reduction(+:s)
                for (int64_t k = 0; k < K; k++) s += bf16_to_f32(wb[k]) * x_at(xm, k, BF);
            } else {
                const float *wf = (const float *)wr, *xf = (const float *)xm;
                #pragma omp simd reduction(+:s)
                for (int64_t k = 0; k < K; k++) s += wf[k] * xf[k];
            }
            store_as(y, m * y_stride + n, s, YB);
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
    return small_rows(x, M, K, x_stride, w, N, w_stride, y, y_stride, nthreads, 0, 0);
}

/* The same over a bfloat16 weight. */
int pagoda_small_rows_bf16w(const float *x, int64_t M, int64_t K, int64_t x_stride, const uint16_t *w, int64_t N,
                            int64_t w_stride, float *y, int64_t y_stride, int nthreads)
{
    return small_rows(x, M, K, x_stride, w, N, w_stride, y, y_stride, nthreads, 1, 0);
}

/* bfloat16 x and weight by AVX512-BF16 dot products, y float32 (y_bf16 = 0) or bfloat16 (rounded once from the
   float32 sum); 1 = M is outside 1..64, 2 = this build has no such path (only the AVX-512 one does) or the CPU
   lacks AVX512-BF16. */
int pagoda_small_rows_bf16dp(const uint16_t *x, int64_t M, int64_t K, int64_t x_stride, const uint16_t *w,
                             int64_t N, int64_t w_stride, void *y, int64_t y_stride, int y_bf16, int nthreads)
{
#if defined(VLEN) && HAVE_DP
    if (!pagoda_cpu_has_bf16_dot()) return 2;
    return y_bf16 ? small_rows(x, M, K, x_stride, w, N, w_stride, y, y_stride, nthreads, 2, 1)
                  : small_rows(x, M, K, x_stride, w, N, w_stride, y, y_stride, nthreads, 2, 0);
#else
    (void)x, (void)M, (void)K, (void)x_stride, (void)w, (void)N, (void)w_stride, (void)y, (void)y_stride;
    (void)y_bf16, (void)nthreads;
    return 2;
#endif
}
