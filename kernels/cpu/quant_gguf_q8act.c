/* y = x w^T over Q4_0, Q4_1 and Q8_0 blocks with the activations quantized to int8 (engine/quantization/
   gguf_linear.py's int8 mode, PAGODA_GGUF_ACTIVATIONS=int8): the decode rows' product by integer dot products.

   Why: the exact product (quant_gguf.c) decodes every weight to float32, and that decode arithmetic, not the
   bytes read, bounds it. Here each run of 32 activations becomes one float32 scale dx = amax / 127 and 32 int8
   values xq = round(x / dx) (to nearest even), with their sum; a block of 32 weights d * q + m (q the stored
   code) against it is then

       d * dx * sum(q * xq) + m * dx * sum(xq),

   one integer dot product of 32 byte pairs and two float terms. The vector variants multiply unsigned bytes
   by signed ones: the Q4 nibbles are unsigned already, and Q4_0's 8 is taken out again in the integer sums
   (8 * the activations' sum over each lane's four bytes, kept beside them); Q8_0's signed codes are offset by
   128 under AVX512-VNNI (taken out the same way), and elsewhere multiplied as |q| by xq with q's sign.
   AVX512-VNNI: vpdpbusd, 64 byte pairs (two blocks) per instruction; AVX-512 without it and AVX2: vpmaddubsw
   then vpmaddwd (no pair sum reaches int16's limit: at most 2 * 128 * 127); the baseline: plain C over int32.
   The result is the float32 product of the dequantized weight with the int8-rounded activations, up to
   float32 rounding of the per-block terms and their sum (tests/kernels/test_gguf_q8act.py holds every variant
   to a float64 reference of that math). */
#include <stdlib.h>

#include "quant_gguf.h"

#define Q8_ROWS 4 /* activation rows multiplied per pass over a weight row */
#define QINLINE static inline __attribute__((always_inline))

static inline int q8_block_bytes(const int T) { return T == T_Q4_0 ? 18 : T == T_Q4_1 ? 20 : 34; }

/* The quantized activations of M rows: row m's int8 values at q + m * kq (kq = K rounded up to two blocks,
   the padding zero), its per-block scales dx and dx * sum(xq) at d + m * nbq and s + m * nbq (nbq = blocks
   + 1, the last zero), and minus the sums of each four of its int8 values at ns + m * kq / 4 (what the vector
   variants take out of the dot products of offset codes: minus that sum times the offset). */
typedef struct {
    int8_t *q;
    float *d, *s;
    float *ds; /* dx and dx * sum(xq) of each block side by side, ds + m * 2 * nbq (the vector variants') */
    int32_t *ns;
    int64_t kq, nbq;
} q8act_t;

/* Round to nearest, ties to even, for |v| < 2^22: adding and removing 1.5 * 2^23 leaves the integer (the
   plain C form vectorises on every variant, SSE2 included). */
static inline float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t xs, const q8act_t *a)
{
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++) {
        int8_t *q = a->q + m * a->kq;
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * xs + 32 * b;
            float amax = 0.0f;
            for (int e = 0; e < 32; e++) amax = fmaxf(amax, fabsf(xb[e]));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (int e = 0; e < 32; e++) {
                const int32_t v = (int32_t)round_even(xb[e] * id);
                q[32 * b + e] = (int8_t)v;
                sum += v;
            }
            a->d[m * a->nbq + b] = d;
            a->s[m * a->nbq + b] = d * (float)sum;
            a->ds[2 * (m * a->nbq + b)] = d;
            a->ds[2 * (m * a->nbq + b) + 1] = d * (float)sum;
        }
        for (int64_t e = K; e < a->kq; e++) q[e] = 0;
        for (int64_t j = 0; j < a->kq / 4; j++)
            a->ns[m * a->kq / 4 + j] = -(q[4 * j] + q[4 * j + 1] + q[4 * j + 2] + q[4 * j + 3]);
        for (int64_t b = nb; b < a->nbq; b++) {
            a->d[m * a->nbq + b] = a->s[m * a->nbq + b] = 0.0f;
            a->ds[2 * (m * a->nbq + b)] = a->ds[2 * (m * a->nbq + b) + 1] = 0.0f;
        }
    }
}

/* The float term of one block besides d * dx * dot: Q4_1's m * dx * sum(xq). */
QINLINE float block_term(const uint8_t *b, float s, const int T) { return T == T_Q4_1 ? half(b + 2) * s : 0.0f; }

/* ---- The baseline: plain C ---------------------------------------------------------------------------- */
QINLINE int32_t dot_c(const uint8_t *b, const int8_t *xq, const int T)
{
    int32_t acc = 0;
    if (T == T_Q8_0) {
        for (int e = 0; e < 32; e++) acc += (int32_t)(int8_t)b[2 + e] * xq[e];
    } else {
        const uint8_t *qs = b + (T == T_Q4_1 ? 4 : 2);
        const int32_t off = T == T_Q4_0 ? 8 : 0;
        for (int e = 0; e < 16; e++) acc += ((qs[e] & 15) - off) * xq[e] + ((qs[e] >> 4) - off) * xq[16 + e];
    }
    return acc;
}

QINLINE void row_c(const uint8_t *w, int64_t nb, const q8act_t *a, int M, float *y, int64_t ys, const int T)
{
    const int BB = q8_block_bytes(T);
    for (int m = 0; m < M; m++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + b * BB;
            const float d = half(blk);
            acc += d * a->d[m * a->nbq + b] * (float)dot_c(blk, a->q + m * a->kq + 32 * b, T);
            acc += block_term(blk, a->s[m * a->nbq + b], T);
        }
        y[m * ys] = acc;
    }
}

#ifdef VLEN
#if VLEN == 16
/* ---- AVX-512: two blocks per 64-byte step --------------------------------------------------------------- */

/* acc + the sums of four products of unsigned bytes u by signed bytes s (vpdpbusd, AVX512-VNNI). Assembly,
   as small_rows.c's vdpbf16ps: the build needs no VNNI target, and it runs only where the CPU has it. */
QINLINE __m512i dpbusd(__m512i acc, __m512i u, __m512i s)
{
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "vm"(s));
    return acc;
}

/* The codes of blocks b0 and b1 (b1 NULL: zeros) as 64 bytes in element order: the nibbles unsigned, Q8_0's
   signed codes as they are. */
QINLINE __m512i codes2(const uint8_t *b0, const uint8_t *b1, const int T)
{
    if (T == T_Q8_0) {
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(b0 + 2));
        const __m256i hi = b1 ? _mm256_loadu_si256((const __m256i *)(b1 + 2)) : _mm256_setzero_si256();
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    const int at = T == T_Q4_1 ? 4 : 2;
    const __m128i q0 = _mm_loadu_si128((const __m128i *)(b0 + at));
    const __m128i q1 = b1 ? _mm_loadu_si128((const __m128i *)(b1 + at)) : _mm_setzero_si128();
    const __m256i t = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1); /* [q0, q1] */
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1);
    z = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)); /* [q0, q0 >> 4, q1, q1 >> 4] */
    return _mm512_and_si512(z, _mm512_set1_epi8(15));
}

/* Blocks b and b + 1 (TWO 0: b only, the row's last) of one weight row against M activation rows. */
QINLINE void pair_v(const uint8_t *b0, int64_t b, const q8act_t *a, const int M, __m512 *acc, __m128 *term,
                    const int T, const int VNNI, const int TWO)
{
    const int SH = T == T_Q4_0 ? 3 : (T == T_Q8_0 && VNNI) ? 7 : 0; /* the codes' offset: 1 << SH, or none */
    const uint8_t *b1 = TWO ? b0 + q8_block_bytes(T) : NULL;
    __m512i c = codes2(b0, b1, T);
    __mmask64 neg = 0;
    if (T == T_Q8_0) {
        if (VNNI) {
            c = _mm512_xor_si512(c, _mm512_set1_epi8((char)0x80)); /* q + 128 */
        } else {
            neg = _mm512_movepi8_mask(c);
            c = _mm512_abs_epi8(c);
        }
    }
    /* both blocks' first four bytes as float16 -> [d0, m0, d1, m1] (m: Q4_1's offset, else unused) */
    uint32_t h0, h1 = 0;
    memcpy(&h0, b0, 4);
    if (TWO) memcpy(&h1, b1, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)h0), (int)h1, 1));
    const __m512i lanes = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i ones = _mm512_set1_epi16(1);
    for (int m = 0; m < M; m++) {
        __m512i xq = _mm512_loadu_si512(a->q + m * a->kq + 32 * b);
        if (T == T_Q8_0 && !VNNI) xq = _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq);
        /* minus the offset times each lane's four activations, exact in int32 */
        const __m512i off = SH ? _mm512_slli_epi32(_mm512_loadu_si512(a->ns + m * a->kq / 4 + 8 * b), SH)
                               : _mm512_setzero_si512();
        const __m512i p = VNNI ? dpbusd(off, c, xq)
                               : _mm512_add_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(c, xq), ones), off);
        /* [d0 dx0, m0 sx0, d1 dx1, m1 sx1] (sx = dx * sum(xq)) */
        const __m128 prod = _mm_mul_ps(dm, _mm_loadu_ps(a->ds + 2 * (m * a->nbq + b)));
        const __m512 sc = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(prod));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[m]);
        if (T == T_Q4_1) term[m] = _mm_add_ps(term[m], prod); /* lanes 1 and 3 are Q4_1's terms */
    }
}

/* One weight row (nb blocks) against M activation rows. */
QINLINE void row_v(const uint8_t *w, int64_t nb, const q8act_t *a, const int M, float *y, int64_t ys, const int T,
                   const int VNNI)
{
    const int BB = q8_block_bytes(T);
    __m512 acc[Q8_ROWS];
    __m128 term[Q8_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps(), term[m] = _mm_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) pair_v(w + b * BB, b, a, M, acc, term, T, VNNI, 1);
    if (b < nb) pair_v(w + b * BB, b, a, M, acc, term, T, VNNI, 0);
    for (int m = 0; m < M; m++) {
        float t[4];
        _mm_storeu_ps(t, term[m]);
        y[m * ys] = _mm512_reduce_add_ps(acc[m]) + (T == T_Q4_1 ? t[1] + t[3] : 0.0f);
    }
}
#else
/* ---- AVX2: one block per 32-byte step ------------------------------------------------------------------- */
QINLINE void row_v(const uint8_t *w, int64_t nb, const q8act_t *a, const int M, float *y, int64_t ys, const int T,
                   const int VNNI)
{
    (void)VNNI;
    const int BB = q8_block_bytes(T);
    __m256 acc[Q8_ROWS];
    __m128 term[Q8_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps(), term[m] = _mm_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * BB;
        __m256i c, sgn = _mm256_setzero_si256();
        if (T == T_Q8_0) {
            sgn = _mm256_loadu_si256((const __m256i *)(blk + 2));
            c = _mm256_abs_epi8(sgn);
        } else {
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + (T == T_Q4_1 ? 4 : 2)));
            c = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1),
                                 _mm256_set1_epi8(15));
        }
        uint32_t h;
        memcpy(&h, blk, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)h)); /* [d, m, 0, 0] (m: Q4_1's, else unused) */
        for (int m = 0; m < M; m++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(a->q + m * a->kq + 32 * b));
            if (T == T_Q8_0) xq = _mm256_sign_epi8(xq, sgn);
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(c, xq), ones);
            if (T == T_Q4_0) { /* minus 8 times each lane's four activations */
                const __m256i ns = _mm256_loadu_si256((const __m256i *)(a->ns + m * a->kq / 4 + 8 * b));
                p = _mm256_add_epi32(p, _mm256_slli_epi32(ns, 3));
            }
            const __m128 prod = _mm_mul_ps(dm, _mm_loadu_ps(a->ds + 2 * (m * a->nbq + b))); /* [d dx, m sx, ..] */
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcastss_ps(prod), acc[m]);
            if (T == T_Q4_1) term[m] = _mm_add_ps(term[m], prod);
        }
    }
    for (int m = 0; m < M; m++) {
        float t[4];
        _mm_storeu_ps(t, term[m]);
        y[m * ys] = vhsum(acc[m]) + (T == T_Q4_1 ? t[1] : 0.0f);
    }
}
#endif
#endif /* VLEN */

static int vnni_state = -1; /* -1: not asked yet; else whether the AVX-512 variant takes vpdpbusd */

static int cpu_has_vnni(void)
{
#if defined(VLEN) && VLEN == 16 && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
#else
    return 0;
#endif
}

/* Whether the int8 product takes AVX512-VNNI here; want 0 turns it off (the AVX-512 bytes path then, as on a
   CPU without it: tests run both), 1 on where the CPU has it, -1 only asks. */
int pagoda_gguf_q8_vnni(int want)
{
    if (want >= 0 || vnni_state < 0) vnni_state = want != 0 && cpu_has_vnni();
    return vnni_state;
}

/* Up to Q8_ROWS activation rows against one weight row. */
QINLINE void rows_any(const uint8_t *wr, int64_t nb, const q8act_t *a, int M, float *y, int64_t ys, const int T,
                      int vnni)
{
#ifdef VLEN
#define R_(MM) (vnni ? row_v(wr, nb, a, MM, y, ys, T, 1) : row_v(wr, nb, a, MM, y, ys, T, 0))
    switch (M) {
    case 1: R_(1); break;
    case 2: R_(2); break;
    case 3: R_(3); break;
    default: R_(4); break;
    }
#undef R_
#else
    (void)vnni;
    row_c(wr, nb, a, M, y, ys, T);
#endif
}

/* One function per type (OpenMP outlines the loop before inlining: the type must be a literal inside). */
#define Q8_LOOP(SUFFIX, TT)                                                                                      \
    static void q8_##SUFFIX(const q8act_t *a, int64_t M, int64_t nb, const uint8_t *w, int64_t N, int64_t ws,  \
                            float *y, int64_t ys, int vnni, int nthreads)                                      \
    {                                                                                                          \
        (void)nthreads;                                                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                                     \
        for (int64_t n = 0; n < N; n++)                                                                        \
            for (int64_t m = 0; m < M; m += Q8_ROWS) {                                                         \
                const q8act_t sub = {a->q + m * a->kq, a->d + m * a->nbq, a->s + m * a->nbq,                   \
                                     a->ds + 2 * m * a->nbq, a->ns + m * a->kq / 4, a->kq, a->nbq};             \
                const int mr = M - m < Q8_ROWS ? (int)(M - m) : Q8_ROWS;                                       \
                rows_any(w + n * ws, nb, &sub, mr, y + m * ys + n, ys, TT, vnni);                              \
            }                                                                                                  \
    }

Q8_LOOP(q4_0, T_Q4_0)
Q8_LOOP(q4_1, T_Q4_1)
Q8_LOOP(q8_0, T_Q8_0)

/* Scratch for M rows of K quantized activations (one allocation; NULL when out of memory). */
static void *q8act_alloc(int64_t M, int64_t K, q8act_t *a)
{
    a->nbq = K / 32 + 1;
    a->kq = (K / 32 + 1) / 2 * 64 + 64; /* whole pairs of blocks, and a pair past the end */
    const size_t qbytes = (size_t)(M * a->kq + 63) / 64 * 64, fbytes = (size_t)(M * a->nbq) * 4;
    uint8_t *buf = aligned_alloc(64, (qbytes + 4 * fbytes + (size_t)M * (size_t)a->kq + 63) / 64 * 64);
    if (buf == NULL) return NULL;
    a->q = (int8_t *)buf;
    a->d = (float *)(buf + qbytes);
    a->s = a->d + M * a->nbq;
    a->ds = a->s + M * a->nbq;
    a->ns = (int32_t *)(a->ds + 2 * M * a->nbq);
    return buf;
}

/* x [M, K] float32 (row stride x_stride), w [N] rows of K / 32 blocks of Q4_0, Q4_1 or Q8_0 (row stride
   w_stride bytes), y [M, N] float32 (row stride y_stride), with x quantized to int8 per 32 values. Return codes
   as pagoda_gguf_linear: 1 = a type this product does not run, 2 = K not whole blocks or a stride too short,
   3 = out of memory. */
int pagoda_gguf_linear_q8(const float *x, int64_t M, int64_t K, int64_t x_stride, const uint8_t *w, int64_t N,
                          int64_t w_stride, int type, float *y, int64_t y_stride, int nthreads)
{
    if (type != T_Q4_0 && type != T_Q4_1 && type != T_Q8_0) return 1;
    if (M < 1 || N < 1) return 0;
    if (K % 32 != 0 || w_stride < K / 32 * q8_block_bytes(type) || x_stride < K) return 2;
    q8act_t a;
    void *buf = q8act_alloc(M, K, &a);
    if (buf == NULL) return 3;
    quantize_rows(x, M, K, x_stride, &a);
    const int vnni = pagoda_gguf_q8_vnni(-1);
    switch (type) {
    case T_Q4_0: q8_q4_0(&a, M, K / 32, w, N, w_stride, y, y_stride, vnni, nthreads); break;
    case T_Q4_1: q8_q4_1(&a, M, K / 32, w, N, w_stride, y, y_stride, vnni, nthreads); break;
    default: q8_q8_0(&a, M, K / 32, w, N, w_stride, y, y_stride, vnni, nthreads); break;
    }
    free(buf);
    return 0;
}

/* The int8 activations the product uses: x [M, K] -> q [M, K] int8 and d [M, K / 32] float32 scales (tests
   hold them to their reference). 2 when K is not whole blocks, 3 out of memory. */
int pagoda_gguf_quantize_q8(const float *x, int64_t M, int64_t K, int64_t x_stride, int8_t *q, float *d)
{
    if (K % 32 != 0 || x_stride < K) return 2;
    if (M < 1) return 0;
    q8act_t a;
    void *buf = q8act_alloc(M, K, &a);
    if (buf == NULL) return 3;
    quantize_rows(x, M, K, x_stride, &a);
    for (int64_t m = 0; m < M; m++) {
        memcpy(q + m * K, a.q + m * a.kq, (size_t)K);
        memcpy(d + m * (K / 32), a.d + m * a.nbq, (size_t)(K / 32) * 4);
    }
    free(buf);
    return 0;
}
