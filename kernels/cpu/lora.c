/* LoRA on the CPU for a batch that mixes adapters (engine/lora/layers.py binds it): per segment of rows that
   use one adapter slot, h = x @ A[slot] (every slice's rank columns side by side), then for each slice i
   y[:, off_i : off_i + size_i] += h[:, i*rank : (i+1)*rank] @ B_i[slot]. One call covers every segment and
   slice of one fused linear, and each task (a segment's tile of up to TILE rows) reads its adapter's
   matrices once for all its rows: with a few decode rows per adapter the cost is reading the adapters'
   weights, which is as little as it can be. Sums in float32; bfloat16 tensors are widened on load and y is
   rounded once, to nearest even. Twins: kernels/reference.py (lora_shrink_ref, lora_expand_ref). */
#include <stdlib.h>

#include "pagoda_cpu.h"

#define TILE 8  /* rows of one task: its adapter's matrices are read once for all of them */

#define LD_F32(p) (p)
#define LD_BF16(p) bf16_to_f32(p)
#define ST_F32(v) (v)
#define ST_BF16(v) f32_to_bf16(v)

/* VW floats in one vector: an AVX register where the variant has AVX, else an SSE register. */
#if defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint16_t vu16 __attribute__((vector_size(VW * 2)));
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));

static inline vf ldv_f32(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf ldv_bf16(const uint16_t *p)
{
    vu16 h;
    memcpy(&h, p, sizeof h);
    vu32 w = __builtin_convertvector(h, vu32) << 16;
    vf v;
    memcpy(&v, &w, sizeof v);
    return v;
}

#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
static inline vf vmadd(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
static inline float smadd(float a, float b, float c) { return fmaf(a, b, c); }
#else
static inline vf vmadd(vf a, vf b, vf c) { return a * b + c; }
static inline float smadd(float a, float b, float c) { return a * b + c; }
#endif

/* A register tile: O[MR rows, VW * NV columns from n0] = X[MR rows, K] @ W[K, those columns]; each W row is
   loaded once for the MR rows. */
#define TILE_FN(NAME, T, LDV, MR, NV)                                                                         \
    static inline void NAME(const float *X, int64_t xs, const T *W, int64_t ws, float *O, int64_t os,       \
                            int64_t K, int64_t n0)                                                            \
    {                                                                                                         \
        vf acc[MR][NV];                                                                                       \
        for (int i = 0; i < MR; i++)                                                                          \
            for (int v = 0; v < NV; v++) acc[i][v] = (vf){0};                                                 \
        for (int64_t k = 0; k < K; k++) {                                                                     \
            vf w[NV];                                                                                         \
            for (int v = 0; v < NV; v++) w[v] = LDV(W + k * ws + n0 + VW * v);                                \
            for (int i = 0; i < MR; i++) {                                                                    \
                const float xv = X[i * xs + k];                                                               \
                const vf xb = xv - (vf){0}; /* broadcast */                                                   \
                for (int v = 0; v < NV; v++) acc[i][v] = vmadd(xb, w[v], acc[i][v]);                          \
            }                                                                                                 \
        }                                                                                                     \
        for (int i = 0; i < MR; i++)                                                                          \
            for (int v = 0; v < NV; v++) memcpy(O + i * os + n0 + VW * v, &acc[i][v], sizeof(vf));            \
    }

/* O[rows, N] = X[rows, K] @ W[K, N] (float X and O, W of element type T, row strides given): tiles of 4 rows x
   2 vectors, then 1-vector and single-row tiles for the edges, plain loops for the last N % VW columns. */
#define SMALL_MM(NAME, T, LD, LDV)                                                                            \
    TILE_FN(NAME##_4x2, T, LDV, 4, 2)                                                                         \
    TILE_FN(NAME##_1x2, T, LDV, 1, 2)                                                                         \
    TILE_FN(NAME##_4x1, T, LDV, 4, 1)                                                                         \
    TILE_FN(NAME##_1x1, T, LDV, 1, 1)                                                                         \
    static void NAME(const float *X, int64_t xs, const T *W, int64_t ws, float *O, int64_t os, int rows,    \
                     int64_t K, int64_t N)                                                                    \
    {                                                                                                         \
        int64_t n0 = 0;                                                                                       \
        for (; n0 + 2 * VW <= N; n0 += 2 * VW) {                                                              \
            int l = 0;                                                                                        \
            for (; l + 4 <= rows; l += 4) NAME##_4x2(X + l * xs, xs, W, ws, O + l * os, os, K, n0);           \
            for (; l < rows; l++) NAME##_1x2(X + l * xs, xs, W, ws, O + l * os, os, K, n0);                   \
        }                                                                                                     \
        for (; n0 + VW <= N; n0 += VW) {                                                                      \
            int l = 0;                                                                                        \
            for (; l + 4 <= rows; l += 4) NAME##_4x1(X + l * xs, xs, W, ws, O + l * os, os, K, n0);           \
            for (; l < rows; l++) NAME##_1x1(X + l * xs, xs, W, ws, O + l * os, os, K, n0);                   \
        }                                                                                                     \
        if (n0 == N) return;                                                                                  \
        for (int l = 0; l < rows; l++) {                                                                      \
            float acc[VW] = {0.0f};                                                                           \
            for (int64_t k = 0; k < K; k++) {                                                                 \
                const float xv = X[l * xs + k];                                                               \
                for (int64_t n = n0; n < N; n++) acc[n - n0] = smadd(xv, LD(W[k * ws + n]), acc[n - n0]);     \
            }                                                                                                 \
            for (int64_t n = n0; n < N; n++) O[l * os + n] = acc[n - n0];                                     \
        }                                                                                                     \
    }

SMALL_MM(small_mm_f32, float, LD_F32, ldv_f32)
SMALL_MM(small_mm_bf16, uint16_t, LD_BF16, ldv_bf16)

/* T: element type of x, y, a, b; LD widens an element to float, ST narrows a float to an element. Scratch
   per thread: the tile's x rows as float (bfloat16 only), h, and one slice's product. */
#define LORA_BODY(T, LD, ST, MM)                                                                              \
    int64_t ntasks = 0, max_size = 0;                                                                         \
    for (int s = 0; s < nseg; s++) ntasks += (seg_lens[s] + TILE - 1) / TILE;                                 \
    for (int i = 0; i < nslices; i++) max_size = slice_sizes[i] > max_size ? slice_sizes[i] : max_size;       \
    _Pragma("omp parallel num_threads(nthreads) if (ntasks > 1)")                                             \
    {                                                                                                         \
        float *xf = (float *)malloc(sizeof(float) * TILE * in_features);                                      \
        float *h = (float *)malloc(sizeof(float) * TILE * width);                                             \
        float *d = (float *)malloc(sizeof(float) * TILE * max_size);                                          \
        _Pragma("omp for schedule(dynamic, 1)")                                                               \
        for (int64_t task = 0; task < ntasks; task++) {                                                       \
            int s = 0;                                                                                        \
            int64_t t = task;                                                                                 \
            while (t >= (seg_lens[s] + TILE - 1) / TILE) t -= (seg_lens[s++] + TILE - 1) / TILE;              \
            const int64_t row0 = (int64_t)seg_starts[s] + t * TILE;                                           \
            const int64_t end = (int64_t)seg_starts[s] + seg_lens[s];                                         \
            const int rows = (int)(end - row0 < TILE ? end - row0 : TILE);                                    \
            const int64_t slot = seg_slots[s];                                                                \
            for (int l = 0; l < rows; l++)                                                                    \
                for (int64_t k = 0; k < in_features; k++)                                                     \
                    xf[l * in_features + k] = LD(x[(row0 + l) * x_stride + k]);                               \
            MM(xf, in_features, a + slot * in_features * width, width, h, width, rows, in_features, width);   \
            for (int i = 0; i < nslices; i++) {                                                              \
                const int64_t size = slice_sizes[i];                                                          \
                const T *bs = (const T *)(intptr_t)b_ptrs[i] + slot * rank * size;                            \
                MM(h + (int64_t)i * rank, width, bs, size, d, size, rows, rank, size);                        \
                for (int l = 0; l < rows; l++) {                                                              \
                    T *yl = y + (row0 + l) * y_stride + slice_offsets[i];                                     \
                    const float *dl = d + (int64_t)l * size;                                                  \
                    for (int64_t c = 0; c < size; c++) yl[c] = ST(LD(yl[c]) + dl[c]);                         \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        free(xf);                                                                                             \
        free(h);                                                                                              \
        free(d);                                                                                              \
    }

/* x [rows, in_features] (row stride x_stride), y [rows, *] (row stride y_stride), a [slots, in_features,
   width] contiguous, b_ptrs[i] -> B_i [slots, rank, slice_sizes[i]] contiguous, width = nslices * rank;
   segments (seg_starts, seg_lens, seg_slots) of nseg; rows in no segment are left alone. */
void pagoda_lora_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, const float *a,
                     int64_t in_features, int64_t width, const int64_t *b_ptrs, const int64_t *slice_offsets,
                     const int64_t *slice_sizes, int nslices, int64_t rank, const int32_t *seg_starts,
                     const int32_t *seg_lens, const int32_t *seg_slots, int nseg, int nthreads)
{
    LORA_BODY(float, LD_F32, ST_F32, small_mm_f32)
}

void pagoda_lora_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const uint16_t *a,
                      int64_t in_features, int64_t width, const int64_t *b_ptrs, const int64_t *slice_offsets,
                      const int64_t *slice_sizes, int nslices, int64_t rank, const int32_t *seg_starts,
                      const int32_t *seg_lens, const int32_t *seg_slots, int nseg, int nthreads)
{
    LORA_BODY(uint16_t, LD_BF16, ST_BF16, small_mm_bf16)
}
