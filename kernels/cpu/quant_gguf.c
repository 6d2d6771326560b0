/* y = x w^T over a weight kept in GGUF's quantized blocks (engine/quantization/gguf_linear.py binds it):
   Q8_0, Q4_0, Q4_1, Q5_0 (blocks of 32) and Q4_K, Q6_K (super-blocks of 256), each weight row a run of blocks.

   Every weight is decoded to the float32 value the gguf package's dequantize gives (the same float32 products
   and sums, no fused multiply-add there), and the product accumulates float32 activations against it: the
   result is the float32 product with the dequantized weight up to summation order, at a quarter to an eighth
   of the bytes read per weight.

   Up to eight activation rows (decode) the weight is streamed once: each thread takes a contiguous share of
   the weight rows, decodes each block in registers and multiplies every activation row against it. More rows
   (prefill) decode a chunk of weight rows into a per-thread float32 buffer once and run tiles of four
   activation rows by three weight rows over it, so each block is decoded once per call whatever M is; from
   PANEL_ROWS_MIN rows the chunk is decoded k-major instead and run in the outer-product form. */
#include <stdlib.h>

#include "quant_gguf.h"

#define STREAM_ROWS_MAX 8
#if defined(__AVX512F__)
#define CHUNK_N 32 /* weight rows decoded per prefill chunk: one panel of two vectors */
#else
#define CHUNK_N 16
#endif
#define VINLINE_ANY static inline __attribute__((always_inline))

static inline int block_elems(const int T) { return T == T_Q4_K || T == T_Q6_K ? 256 : 32; }

static inline int block_bytes(const int T)
{
    switch (T) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    default: return 210; /* Q6_K */
    }
}

/* The per-block floats a block's values are decoded with: d (and m) for the 32-blocks; for the super-blocks
   the scale (and offset) of each sub-block, computed as gguf's numpy does (d * sc, dmin * m in float32). */
typedef struct {
    float d, m;
    float sc[16], mn[16];
} scales_t;

static inline void block_scales(const uint8_t *b, const int T, scales_t *s)
{
    s->d = s->m = 0.0f;
    if (T == T_Q4_K) {
        const float d = half(b), dmin = half(b + 2);
        const uint8_t *q = b + 4;
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            if (j < 4) {
                sc = q[j] & 63;
                mn = q[j + 4] & 63;
            } else {
                sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
                mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
            }
            s->sc[j] = d * (float)sc;
            s->mn[j] = dmin * (float)mn;
        }
    } else if (T == T_Q6_K) {
        const float d = half(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int j = 0; j < 16; j++) s->sc[j] = d * (float)sc[j];
    } else {
        s->d = half(b);
        s->m = T == T_Q4_1 ? half(b + 2) : 0.0f;
    }
}

/* Element e of a block as a float32 (the scalar decoder: baseline loops and tails). */
static inline float decode1(const uint8_t *b, const scales_t *s, int e, const int T)
{
    switch (T) {
    case T_Q8_0: return (float)(int8_t)b[2 + e] * s->d;
    case T_Q4_0: return s->d * (float)(((b[2 + (e & 15)] >> (e >> 4 << 2)) & 15) - 8);
    case T_Q4_1: return s->d * (float)((b[4 + (e & 15)] >> (e >> 4 << 2)) & 15) + s->m;
    case T_Q5_0: {
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        const int q = ((b[6 + (e & 15)] >> (e >> 4 << 2)) & 15) | (int)((qh >> e) & 1u) << 4;
        return s->d * (float)(q - 16);
    }
    case T_Q4_K: {
        const int g = e >> 6, hi = (e >> 5) & 1, l = e & 31;
        const int q = (b[16 + 32 * g + l] >> (4 * hi)) & 15;
        return s->sc[2 * g + hi] * (float)q - s->mn[2 * g + hi];
    }
    default: { /* Q6_K */
        const int h = e >> 7, p = e & 127;
        const int lo = (b[64 * h + (p & 63)] >> (4 * (p >> 6))) & 15;
        const int hb = (b[128 + 32 * h + (p & 31)] >> (2 * (p >> 5))) & 3;
        return s->sc[e >> 4] * (float)((lo | hb << 4) - 32);
    }
    }
}

static inline void decode_block_scalar(const uint8_t *b, float *out, const int T)
{
    scales_t s;
    block_scales(b, T, &s);
    for (int e = 0; e < block_elems(T); e++) out[e] = decode1(b, &s, e, T);
}

#ifdef VLEN
/* VLEN bytes, zero- or sign-extended to int32 lanes */
VINLINE vint vbytes_u(const uint8_t *p)
{
    __m128i b = _mm_setzero_si128();
    memcpy(&b, p, VLEN);
    return VOP(cvtepu8_epi32)(b);
}

VINLINE vint vbytes_s(const uint8_t *p)
{
    __m128i b = _mm_setzero_si128();
    memcpy(&b, p, VLEN);
    return VOP(cvtepi8_epi32)(b);
}

VINLINE vint vsrl(vint a, int n) { return VOP(srl_epi32)(a, _mm_cvtsi32_si128(n)); }
VINLINE vint visub(vint a, int32_t b) { return VOP(sub_epi32)(a, viset1(b)); } /* int32 lanes (vint's operators are 64-bit) */

/* Elements [VLEN v, VLEN v + VLEN) of a block as float32 lanes, the same values as decode1. */
VINLINE vfloat decode_vec(const uint8_t *b, const scales_t *s, int v, const int T)
{
    const int e = v * VLEN;
    switch (T) {
    case T_Q8_0: return vmul(vcvt_float(vbytes_s(b + 2 + e)), vset1(s->d));
    case T_Q4_0: {
        const vint q = vsrl(vbytes_u(b + 2 + (e & 15)), e >> 4 << 2) & viset1(15);
        return vmul(vset1(s->d), vcvt_float(visub(q, 8)));
    }
    case T_Q4_1: {
        const vint q = vsrl(vbytes_u(b + 4 + (e & 15)), e >> 4 << 2) & viset1(15);
        return vadd(vmul(vset1(s->d), vcvt_float(q)), vset1(s->m));
    }
    case T_Q5_0: {
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        const vint hb = VOP(srlv_epi32)(viset1((int32_t)qh), viadd(viota(), viset1(e))) & viset1(1);
        const vint q = (vsrl(vbytes_u(b + 6 + (e & 15)), e >> 4 << 2) & viset1(15)) | VOP(slli_epi32)(hb, 4);
        return vmul(vset1(s->d), vcvt_float(visub(q, 16)));
    }
    case T_Q4_K: {
        const int g = e >> 6, hi = (e >> 5) & 1, l = e & 31;
        const vint q = vsrl(vbytes_u(b + 16 + 32 * g + l), 4 * hi) & viset1(15);
        return vsub(vmul(vset1(s->sc[2 * g + hi]), vcvt_float(q)), vset1(s->mn[2 * g + hi]));
    }
    default: { /* Q6_K */
        const int h = e >> 7, p = e & 127;
        const vint lo = vsrl(vbytes_u(b + 64 * h + (p & 63)), 4 * (p >> 6)) & viset1(15);
        const vint hb = vsrl(vbytes_u(b + 128 + 32 * h + (p & 31)), 2 * (p >> 5)) & viset1(3);
        return vmul(vset1(s->sc[e >> 4]), vcvt_float(visub(lo | VOP(slli_epi32)(hb, 4), 32)));
    }
    }
}

/* One weight row (nb blocks) against M activation rows, decoded in registers; M <= 2 keeps two accumulators
   per row to hide the latency of the fused multiply-adds. */
VINLINE void row_vec(const uint8_t *w, int64_t nb, const float *x, int64_t xs, float *y, int64_t ys, const int M,
                     const int T)
{
    const int QK = block_elems(T), BB = block_bytes(T), NV = QK / VLEN;
    vfloat a[STREAM_ROWS_MAX][2];
    for (int m = 0; m < M; m++) a[m][0] = a[m][1] = vzero();
    for (int64_t blk = 0; blk < nb; blk++) {
        const uint8_t *b = w + blk * BB;
        const float *xb = x + blk * QK;
        scales_t s;
        block_scales(b, T, &s);
        for (int v = 0; v < NV; v++) {
            const vfloat wv = decode_vec(b, &s, v, T);
            for (int m = 0; m < M; m++) {
                const int j = M <= 2 ? (v & 1) : 0;
                a[m][j] = vfmadd(wv, vloadu(xb + m * xs + v * VLEN), a[m][j]);
            }
        }
    }
    for (int m = 0; m < M; m++) y[m * ys] = vhsum(M <= 2 ? vadd(a[m][0], a[m][1]) : a[m][0]);
}

VINLINE_ANY void decode_row(const uint8_t *w, int64_t nb, float *out, const int T)
{
    const int QK = block_elems(T), BB = block_bytes(T), NV = QK / VLEN;
    for (int64_t blk = 0; blk < nb; blk++) {
        const uint8_t *b = w + blk * BB;
        scales_t s;
        block_scales(b, T, &s);
        for (int v = 0; v < NV; v++) vstoreu(out + blk * QK + v * VLEN, decode_vec(b, &s, v, T));
    }
}

/* MR (<= 4) activation rows by NR (<= 3) decoded weight rows over K (a multiple of VLEN): twelve
   accumulators. */
VINLINE void tile_vec(const float *x, int64_t xs, const float *w, int64_t K, float *y, int64_t ys, const int MR,
                      const int NR)
{
    vfloat acc[4][3];
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < NR; j++) acc[m][j] = vzero();
    for (int64_t k = 0; k < K; k += VLEN) {
        vfloat wv[3];
        for (int j = 0; j < NR; j++) wv[j] = vloadu(w + j * K + k);
        for (int m = 0; m < MR; m++) {
            const vfloat xv = vloadu(x + m * xs + k);
            for (int j = 0; j < NR; j++) acc[m][j] = vfmadd(xv, wv[j], acc[m][j]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < NR; j++) y[m * ys + j] = vhsum(acc[m][j]);
}

static void tiles(const float *x, int64_t M, int64_t K, int64_t xs, const float *w, int64_t nr, float *y,
                  int64_t ys)
{
    for (int64_t m = 0; m < M; m += 4) {
        const int mr = M - m < 4 ? (int)(M - m) : 4;
        for (int64_t n = 0; n < nr; n += 3) {
            const int r = nr - n < 3 ? (int)(nr - n) : 3;
            const float *wn = w + n * K;
            float *yt = y + m * ys + n;
            const float *xm = x + m * xs;
#define T_(MR, NR) tile_vec(xm, xs, wn, K, yt, ys, MR, NR)
#define BY_ROWS(NR) \
    switch (mr) { case 4: T_(4, NR); break; case 3: T_(3, NR); break; case 2: T_(2, NR); break; default: T_(1, NR); }
            if (r == 3) BY_ROWS(3)
            else if (r == 2) BY_ROWS(2)
            else BY_ROWS(1)
#undef BY_ROWS
#undef T_
        }
    }
}
/* Prefill's product over a panel of PANEL weight rows decoded k-major (panel[k][j]): MR activation rows by
   two vectors of weight rows, each activation broadcast once per k against both (the outer-product form: 12
   accumulators, 2 weight loads and MR broadcasts per 2 MR fused multiply-adds, which fits AVX2's 16
   registers). Each output is one chain over k. */
#define PANEL (2 * VLEN)
#define MR_MAX 6
/* From this many activation rows a chunk is decoded k-major and run in the outer-product form: at 256 rows
   1.3-1.6x faster than the dot-product tiles, below about 100 slower (its scattered decode costs more than the
   products it speeds up; AVX-512 host, one thread, Q4_1 [3,072 x 576] and [576 x 1,536]) */
#define PANEL_ROWS_MIN 128

VINLINE void panel_rows(const float *x, int64_t xs, const float *panel, int64_t K, float *y, int64_t ys, int nr,
                        const int MR)
{
    vfloat acc[MR_MAX][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = vzero();
    for (int64_t k = 0; k < K; k++) {
        const vfloat w0 = vload(panel + k * PANEL), w1 = vload(panel + k * PANEL + VLEN);
        for (int r = 0; r < MR; r++) {
            const vfloat xb = vbroadcast(x + r * xs + k);
            acc[r][0] = vfmadd(xb, w0, acc[r][0]);
            acc[r][1] = vfmadd(xb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < MR; r++) {
        if (nr == PANEL) {
            vstoreu(y + r * ys, acc[r][0]);
            vstoreu(y + r * ys + VLEN, acc[r][1]);
        } else {
            float out[PANEL] __attribute__((aligned(64)));
            vstore(out, acc[r][0]);
            vstore(out + VLEN, acc[r][1]);
            for (int j = 0; j < nr; j++) y[r * ys + j] = out[j];
        }
    }
}

/* Weight rows [n0, n0 + nr) (nr <= PANEL) decoded into panel [K][PANEL], block by block so that the panel's
   rows being written stay in L1; rows past nr are zero. */
VINLINE_ANY void decode_panel(const uint8_t *w, int64_t ws, int64_t nr, int64_t nb, float *panel, const int T)
{
    const int QK = block_elems(T), BB = block_bytes(T);
    float tmp[256] __attribute__((aligned(64)));
    for (int64_t blk = 0; blk < nb; blk++) {
        float *dst = panel + blk * QK * PANEL;
        for (int j = 0; j < PANEL; j++) {
            if (j < nr) {
                const uint8_t *b = w + j * ws + blk * BB;
                scales_t s;
                block_scales(b, T, &s);
                for (int v = 0; v < QK / VLEN; v++) vstore(tmp + v * VLEN, decode_vec(b, &s, v, T));
            } else {
                for (int e = 0; e < QK; e++) tmp[e] = 0.0f;
            }
            for (int e = 0; e < QK; e++) dst[e * PANEL + j] = tmp[e];
        }
    }
}

static void panel_product(const float *x, int64_t M, int64_t K, int64_t xs, const float *panel, int64_t nr,
                          float *y, int64_t ys)
{
    for (int64_t m = 0; m < M; m += MR_MAX) {
        const float *xm = x + m * xs;
        float *ym = y + m * ys;
        switch (M - m < MR_MAX ? (int)(M - m) : MR_MAX) {
        case 1: panel_rows(xm, xs, panel, K, ym, ys, (int)nr, 1); break;
        case 2: panel_rows(xm, xs, panel, K, ym, ys, (int)nr, 2); break;
        case 3: panel_rows(xm, xs, panel, K, ym, ys, (int)nr, 3); break;
        case 4: panel_rows(xm, xs, panel, K, ym, ys, (int)nr, 4); break;
        case 5: panel_rows(xm, xs, panel, K, ym, ys, (int)nr, 5); break;
        default: panel_rows(xm, xs, panel, K, ym, ys, (int)nr, 6); break;
        }
    }
}

/* One chunk of prefill: decode, then every activation row over it. buf: K * CHUNK_N floats, 64-byte aligned. */
VINLINE_ANY void chunk_product(const float *x, int64_t M, int64_t K, int64_t xs, const uint8_t *w, int64_t ws,
                               int64_t nr, int64_t nb, float *buf, float *y, int64_t ys, const int T)
{
    if (M >= PANEL_ROWS_MIN) {
        decode_panel(w, ws, nr, nb, buf, T);
        panel_product(x, M, K, xs, buf, nr, y, ys);
    } else {
        for (int64_t r = 0; r < nr; r++) decode_row(w + r * ws, nb, buf + r * K, T);
        tiles(x, M, K, xs, buf, nr, y, ys);
    }
}
#else
VINLINE_ANY void decode_row(const uint8_t *w, int64_t nb, float *out, const int T)
{
    for (int64_t blk = 0; blk < nb; blk++) decode_block_scalar(w + blk * block_bytes(T), out + blk * block_elems(T), T);
}

static void tiles(const float *x, int64_t M, int64_t K, int64_t xs, const float *w, int64_t nr, float *y,
                  int64_t ys)
{
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < nr; n++) {
            const float *wn = w + n * K, *xm = x + m * xs;
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (int64_t k = 0; k < K; k++) s += wn[k] * xm[k];
            y[m * ys + n] = s;
        }
}

VINLINE_ANY void chunk_product(const float *x, int64_t M, int64_t K, int64_t xs, const uint8_t *w, int64_t ws,
                               int64_t nr, int64_t nb, float *buf, float *y, int64_t ys, const int T)
{
    for (int64_t r = 0; r < nr; r++) decode_row(w + r * ws, nb, buf + r * K, T);
    tiles(x, M, K, xs, buf, nr, y, ys);
}
#endif

/* One weight row against M (<= 8) activation rows: in registers on the vector variants, through a decoded
   block on the baseline. */
VINLINE_ANY void stream_row(const uint8_t *wr, int64_t nb, const float *x, int64_t M, int64_t xs, float *y,
                            int64_t ys, const int T)
{
#ifdef VLEN
    switch (M) {
    case 1: row_vec(wr, nb, x, xs, y, ys, 1, T); break;
    case 2: row_vec(wr, nb, x, xs, y, ys, 2, T); break;
    case 3: row_vec(wr, nb, x, xs, y, ys, 3, T); break;
    case 4: row_vec(wr, nb, x, xs, y, ys, 4, T); break;
    case 5: row_vec(wr, nb, x, xs, y, ys, 5, T); break;
    case 6: row_vec(wr, nb, x, xs, y, ys, 6, T); break;
    case 7: row_vec(wr, nb, x, xs, y, ys, 7, T); break;
    default: row_vec(wr, nb, x, xs, y, ys, 8, T); break;
    }
#else
    float acc[STREAM_ROWS_MAX] = {0}, buf[256];
    const int QK = block_elems(T);
    for (int64_t blk = 0; blk < nb; blk++) {
        decode_block_scalar(wr + blk * block_bytes(T), buf, T);
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * xs + blk * QK;
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (int e = 0; e < QK; e++) s += buf[e] * xm[e];
            acc[m] += s;
        }
    }
    for (int64_t m = 0; m < M; m++) y[m * ys] = acc[m];
#endif
}

/* The three parallel loops, one function per type: OpenMP outlines a loop body before inlining, so the type
   must be a literal inside it for its decoder to be specialised. Decode streams the weight rows (M <= 8);
   prefill decodes chunks of CHUNK_N weight rows once into a per-thread buffer and runs every activation row
   over them; dequantize writes the decoded rows. */
#define GGUF_LOOPS(SUFFIX, TT)                                                                                   \
    static void stream_##SUFFIX(const float *x, int64_t M, int64_t K, int64_t xs, const uint8_t *w, int64_t N, \
                                int64_t ws, float *y, int64_t ys, int nthreads)                                \
    {                                                                                                          \
        const int64_t nb = K / block_elems(TT);                                                                \
        (void)nthreads;                                                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                                     \
        for (int64_t n = 0; n < N; n++) stream_row(w + n * ws, nb, x, M, xs, y + n, ys, TT);                   \
    }                                                                                                          \
    static int chunked_##SUFFIX(const float *x, int64_t M, int64_t K, int64_t xs, const uint8_t *w, int64_t N, \
                                int64_t ws, float *y, int64_t ys, int nthreads)                                \
    {                                                                                                          \
        const int64_t nb = K / block_elems(TT), chunks = (N + CHUNK_N - 1) / CHUNK_N;                          \
        int failed = 0;                                                                                        \
        (void)nthreads;                                                                                        \
        _Pragma("omp parallel num_threads(nthreads) reduction(|:failed)")                                      \
        {                                                                                                      \
            float *buf = aligned_alloc(64, (size_t)((CHUNK_N * K * 4 + 63) / 64 * 64));                        \
            if (buf == NULL) failed = 1;                                                                       \
            _Pragma("omp for schedule(static)")                                                                \
            for (int64_t c = 0; c < chunks; c++) {                                                             \
                if (buf == NULL) continue;                                                                     \
                const int64_t n0 = c * CHUNK_N, nr = N - n0 < CHUNK_N ? N - n0 : CHUNK_N;                      \
                chunk_product(x, M, K, xs, w + n0 * ws, ws, nr, nb, buf, y + n0, ys, TT);                      \
            }                                                                                                  \
            free(buf);                                                                                         \
        }                                                                                                      \
        return failed ? 3 : 0;                                                                                 \
    }                                                                                                          \
    static void dequantize_##SUFFIX(const uint8_t *w, int64_t N, int64_t K, int64_t ws, float *out,           \
                                    int64_t os, int nthreads)                                                  \
    {                                                                                                          \
        const int64_t nb = K / block_elems(TT);                                                                \
        (void)nthreads;                                                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (N * K >= 65536)")                 \
        for (int64_t n = 0; n < N; n++) decode_row(w + n * ws, nb, out + n * os, TT);                          \
    }

GGUF_LOOPS(q8_0, T_Q8_0)
GGUF_LOOPS(q4_0, T_Q4_0)
GGUF_LOOPS(q4_1, T_Q4_1)
GGUF_LOOPS(q5_0, T_Q5_0)
GGUF_LOOPS(q4_k, T_Q4_K)
GGUF_LOOPS(q6_k, T_Q6_K)

static int known_type(int type)
{
    return type == T_Q8_0 || type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q4_K || type == T_Q6_K;
}

#define BY_TYPE(type, CALL) \
    switch (type) { \
    case T_Q8_0: CALL(q8_0); break; case T_Q4_0: CALL(q4_0); break; case T_Q4_1: CALL(q4_1); break; \
    case T_Q5_0: CALL(q5_0); break; case T_Q4_K: CALL(q4_k); break; default: CALL(q6_k); break; }

/* x [M, K] float32 (row stride x_stride), w [N] rows of K / block-elements blocks of ggml type `type` (row
   stride w_stride bytes), y [M, N] float32 (row stride y_stride). 0 = done; 1 = a type this library does not
   run; 2 = K is not a whole number of blocks, or a row stride is shorter than a row; 3 = out of memory. */
int pagoda_gguf_linear(const float *x, int64_t M, int64_t K, int64_t x_stride, const uint8_t *w, int64_t N,
                       int64_t w_stride, int type, float *y, int64_t y_stride, int nthreads)
{
    if (!known_type(type)) return 1;
    if (M < 1 || N < 1) return 0;
    if (K % block_elems(type) != 0 || w_stride < K / block_elems(type) * block_bytes(type) || x_stride < K)
        return 2;
    int rc = 0;
#define STREAM(S) stream_##S(x, M, K, x_stride, w, N, w_stride, y, y_stride, nthreads)
#define CHUNKED(S) rc = chunked_##S(x, M, K, x_stride, w, N, w_stride, y, y_stride, nthreads)
    if (M <= STREAM_ROWS_MAX) BY_TYPE(type, STREAM)
    else BY_TYPE(type, CHUNKED)
#undef STREAM
#undef CHUNKED
    return rc;
}

/* w [N] rows of blocks -> float32 out [N, K] (row stride out_stride): the same values the product uses (the
   dequantized model's weights, the embeddings' rows). Return codes as pagoda_gguf_linear. */
int pagoda_gguf_dequantize(const uint8_t *w, int64_t N, int64_t K, int64_t w_stride, int type, float *out,
                           int64_t out_stride, int nthreads)
{
    if (!known_type(type)) return 1;
    if (K % block_elems(type) != 0 || w_stride < K / block_elems(type) * block_bytes(type)) return 2;
#define DEQ(S) dequantize_##S(w, N, K, w_stride, out, out_stride, nthreads)
    BY_TYPE(type, DEQ)
#undef DEQ
    return 0;
}
