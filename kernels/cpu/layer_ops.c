/* Fused element-wise ops of the decoder layer: add + RMSNorm, rotary, silu * mul (engine/models/cpu_ops.py binds them).

   Each op is one body over float32 or bfloat16 tensors (BF, a constant where it is inlined): bfloat16 values
   are computed in float32 and each output rounded once (to nearest even). */
#include "pagoda_cpu.h"

#define PAR_MIN_ELEMS 65536  /* below this, one thread: a parallel region costs more than it saves */
#define BF16_ROW_MAX 8192    /* elements of a bfloat16 row the norm keeps in float32 while it sums */

/* out[t] = w * (r * 1/sqrt(mean(r^2) + eps)) with r = x[t] + residual[t] (written back to residual) when
   residual is given, else r = x[t]. A bfloat16 residual stream is rounded where it is stored, and r is what
   was stored. */
static inline __attribute__((always_inline)) void add_rms_norm(
    void *out, void *residual, const void *x, const void *w, int64_t T, int64_t n, int64_t x_stride,
    int64_t out_stride, int64_t res_stride, float eps, int nthreads, const int BF)
{
    const int64_t esize = BF ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T * n >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const char *xt = (const char *)x + t * x_stride * esize;
        char *o = (char *)out + t * out_stride * esize;
        char *rt = residual ? (char *)residual + t * res_stride * esize : 0;
        float rbf[BF16_ROW_MAX] __attribute__((aligned(64))); /* bfloat16: r widened */
        float ss = 0.0f;
        int64_t i = 0;
#ifdef VLEN
        vfloat acc = vzero();
        for (; i + VLEN <= n; i += VLEN) {
            vfloat v = vload_as(xt, i, BF);
            if (rt) {
                vstore_as(rt, i, vadd(v, vload_as(rt, i, BF)), BF);
                v = vload_as(rt, i, BF);
            }
            if (BF) vstore(rbf + i, v);
            acc = vfmadd(v, v, acc);
        }
        ss = vhsum(acc);
#endif
        for (; i < n; i++) {
            float v = load_as(xt, i, BF);
            if (rt) {
                store_as(rt, i, v + load_as(rt, i, BF), BF);
                v = load_as(rt, i, BF);
            }
            if (BF) rbf[i] = v;
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        const float *r = BF ? rbf : rt ? (const float *)rt : (const float *)xt;
        i = 0;
#ifdef VLEN
        const vfloat iv = vset1(inv);
        for (; i + VLEN <= n; i += VLEN) vstore_as(o, i, vmul(vload_as(w, i, BF), vmul(vloadu(r + i), iv)), BF);
#endif
        for (; i < n; i++) store_as(o, i, load_as(w, i, BF) * (r[i] * inv), BF);
    }
}

/* One head of float32 rotary: a plain loop, which the compiler vectorises at the variant's width (measured
   faster than the vector layer on AVX-512, where a head of 64 is two vectors). */
static inline void rotary_f32(float *v, const float *c, const float *s, int half)
{
    for (int i = 0; i < half; i++) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] + (-x2) * s[i];
        v[i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
}

/* One head of bfloat16 rotary, computed in float32 and rounded once. */
static inline void rotary_bf16(uint16_t *v, const uint16_t *c, const uint16_t *s, int half)
{
    int i = 0;
#ifdef VLEN
    for (; i + VLEN <= half; i += VLEN) {
        const vfloat x1 = vload_bf16(v + i), x2 = vload_bf16(v + i + half);
        const vfloat lo = vsub(vmul(x1, vload_bf16(c + i)), vmul(x2, vload_bf16(s + i)));
        const vfloat hi = vadd(vmul(x2, vload_bf16(c + i + half)), vmul(x1, vload_bf16(s + i + half)));
        vstore_bf16(v + i, lo); /* after every load: the stores may alias cos and sin */
        vstore_bf16(v + i + half, hi);
    }
#endif
    for (; i < half; i++) {
        const float x1 = bf16_to_f32(v[i]), x2 = bf16_to_f32(v[i + half]);
        v[i] = f32_to_bf16(x1 * bf16_to_f32(c[i]) - x2 * bf16_to_f32(s[i]));
        v[i + half] = f32_to_bf16(x2 * bf16_to_f32(c[i + half]) + x1 * bf16_to_f32(s[i + half]));
    }
}

/* In place, heads [0, nheads) of every token of x (token stride x_stride, head stride D):
   x = x * cos + rotate_half(x) * sin, with the token's cos/sin rows ([T, D], contiguous). */
static inline __attribute__((always_inline)) void rotary(void *x, int64_t T, int64_t x_stride, int nheads, int D,
                                                         const void *cos_t, const void *sin_t, int nthreads,
                                                         const int BF)
{
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T * nheads * D >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++)
        for (int h = 0; h < nheads; h++) {
            const int64_t at = t * x_stride + (int64_t)h * D;
            if (BF)
                rotary_bf16((uint16_t *)x + at, (const uint16_t *)cos_t + t * D, (const uint16_t *)sin_t + t * D,
                            D / 2);
            else
                rotary_f32((float *)x + at, (const float *)cos_t + t * D, (const float *)sin_t + t * D, D / 2);
        }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i], silu(g) = g / (1 + exp(-g)). */
static inline __attribute__((always_inline)) void silu_mul(void *out, const void *gu, int64_t T, int64_t I,
                                                           int64_t gu_stride, int64_t out_stride, int nthreads,
                                                           const int BF)
{
    const int64_t esize = BF ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T * I >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const char *g = (const char *)gu + t * gu_stride * esize, *u = g + I * esize;
        char *o = (char *)out + t * out_stride * esize;
        int64_t i = 0;
#ifdef VLEN
        for (; i + VLEN <= I; i += VLEN) {
            const vfloat gv = vload_as(g, i, BF);
            const vfloat sv = vdiv(gv, vadd(vset1(1.0f), vexp(vsub(vzero(), gv))));
            vstore_as(o, i, vmul(sv, vload_as(u, i, BF)), BF);
        }
#endif
        for (; i < I; i++) {
            const float gv = load_as(g, i, BF);
            store_as(o, i, (gv / (1.0f + expf(-gv))) * load_as(u, i, BF), BF);
        }
    }
}

void pagoda_add_rms_norm(float *out, float *residual, const float *x, const float *w, int64_t T, int64_t n,
                         int64_t x_stride, int64_t out_stride, int64_t res_stride, float eps, int nthreads)
{
    add_rms_norm(out, residual, x, w, T, n, x_stride, out_stride, res_stride, eps, nthreads, 0);
}

void pagoda_rotary(float *x, int64_t T, int64_t x_stride, int nheads, int D, const float *cos_t,
                   const float *sin_t, int nthreads)
{
    rotary(x, T, x_stride, nheads, D, cos_t, sin_t, nthreads, 0);
}

void pagoda_silu_mul(float *out, const float *gu, int64_t T, int64_t I, int64_t gu_stride, int64_t out_stride,
                     int nthreads)
{
    silu_mul(out, gu, T, I, gu_stride, out_stride, nthreads, 0);
}

/* ---- bfloat16 tensors: the same ops computed in float32, each output rounded once (to nearest even) ---- */

void pagoda_add_rms_norm_bf16(uint16_t *out, uint16_t *residual, const uint16_t *x, const uint16_t *w, int64_t T,
                              int64_t n, int64_t x_stride, int64_t out_stride, int64_t res_stride, float eps,
                              int nthreads)
{
    add_rms_norm(out, residual, x, w, T, n, x_stride, out_stride, res_stride, eps, nthreads, 1);
}

void pagoda_rotary_bf16(uint16_t *x, int64_t T, int64_t x_stride, int nheads, int D, const uint16_t *cos_t,
                        const uint16_t *sin_t, int nthreads)
{
    rotary(x, T, x_stride, nheads, D, cos_t, sin_t, nthreads, 1);
}

void pagoda_silu_mul_bf16(uint16_t *out, const uint16_t *gu, int64_t T, int64_t I, int64_t gu_stride,
                          int64_t out_stride, int nthreads)
{
    silu_mul(out, gu, T, I, gu_stride, out_stride, nthreads, 1);
}
