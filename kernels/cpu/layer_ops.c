/* Fused element-wise ops of the decoder layer: add + RMSNorm, rotary, silu * mul (engine/models/cpu_ops.py binds them). */
#include "pagoda_cpu.h"

#define PAR_MIN_ELEMS 65536  /* below this, one thread: a parallel region costs more than it saves */

/* out[t] = w * (r * 1/sqrt(mean(r^2) + eps)) with r = x[t] + residual[t] (written back to residual) when
   residual is given, else r = x[t]. */
void pagoda_add_rms_norm(float *out, float *residual, const float *x, const float *w, int64_t T, int64_t n,
                         int64_t x_stride, int64_t out_stride, int64_t res_stride, float eps, int nthreads)
{
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T * n >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * x_stride;
        float *o = out + t * out_stride;
        const float *r = xt;
        if (residual) {
            float *rt = residual + t * res_stride;
            for (int64_t i = 0; i < n; i++) rt[i] = xt[i] + rt[i];
            r = rt;
        }
        float ss = 0.0f;
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            __m512 v = _mm512_loadu_ps(r + i);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
        }
        ss = _mm512_reduce_add_ps(acc);
        for (; i < n; i++) ss += r[i] * r[i];
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(r + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        ss = hsum8(acc);
        for (; i < n; i++) ss += r[i] * r[i];
#else
        for (int64_t i = 0; i < n; i++) ss += r[i] * r[i];
#endif
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (r[i] * inv);
    }
}

/* In place, heads [0, nheads) of every token of x (token stride x_stride, head stride D):
   x = x * cos + rotate_half(x) * sin, with the token's cos/sin rows ([T, D], contiguous). */
void pagoda_rotary(float *x, int64_t T, int64_t x_stride, int nheads, int D, const float *cos_t,
                   const float *sin_t, int nthreads)
{
    const int half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T * nheads * D >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + t * D, *s = sin_t + t * D;
        for (int h = 0; h < nheads; h++) {
            float *v = x + t * x_stride + (int64_t)h * D;
            for (int i = 0; i < half; i++) {
                const float x1 = v[i], x2 = v[i + half];
                v[i] = x1 * c[i] + (-x2) * s[i];
                v[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i], silu(g) = g / (1 + exp(-g)). */
void pagoda_silu_mul(float *out, const float *gu, int64_t T, int64_t I, int64_t gu_stride, int64_t out_stride,
                     int nthreads)
{
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T * I >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * gu_stride, *u = g + I;
        float *o = out + t * out_stride;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= I; i += 16) {
            __m512 gv = _mm512_loadu_ps(g + i);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(sv, _mm512_loadu_ps(u + i)));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(sv, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
}

/* ---- bfloat16 tensors: the same ops computed in float32, each output rounded once (to nearest even) ---- */

void pagoda_add_rms_norm_bf16(uint16_t *out, uint16_t *residual, const uint16_t *x, const uint16_t *w, int64_t T,
                              int64_t n, int64_t x_stride, int64_t out_stride, int64_t res_stride, float eps,
                              int nthreads)
{
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T * n >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xt = x + t * x_stride;
        uint16_t *o = out + t * out_stride;
        uint16_t *rt = residual ? residual + t * res_stride : 0;
        float r[8192] __attribute__((aligned(64)));
        float ss = 0.0f;
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= n; i += 16) {
            __m512 v = bf16x16(xt + i);
            if (rt) { /* the residual stream is bfloat16: the sum is rounded where it is stored */
                const __m256i sum = f32x16_to_bf16(_mm512_add_ps(v, bf16x16(rt + i)));
                _mm256_storeu_si256((__m256i *)(rt + i), sum);
                v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(sum), 16));
            }
            _mm512_store_ps(r + i, v);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
#endif
        for (; i < n; i++) {
            float v = bf16_to_f32(xt[i]);
            if (rt) {
                rt[i] = f32_to_bf16(v + bf16_to_f32(rt[i]));
                v = bf16_to_f32(rt[i]);
            }
            r[i] = v;
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        i = 0;
#if defined(__AVX512F__)
        const __m512 iv = _mm512_set1_ps(inv);
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(o + i),
                                f32x16_to_bf16(_mm512_mul_ps(bf16x16(w + i), _mm512_mul_ps(_mm512_load_ps(r + i), iv))));
#endif
        for (; i < n; i++) o[i] = f32_to_bf16(bf16_to_f32(w[i]) * (r[i] * inv));
    }
}

void pagoda_rotary_bf16(uint16_t *x, int64_t T, int64_t x_stride, int nheads, int D, const uint16_t *cos_t,
                        const uint16_t *sin_t, int nthreads)
{
    const int half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T * nheads * D >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos_t + t * D, *s = sin_t + t * D;
        for (int h = 0; h < nheads; h++) {
            uint16_t *v = x + t * x_stride + (int64_t)h * D;
            int i = 0;
#if defined(__AVX512F__)
            for (; i + 16 <= half; i += 16) {
                const __m512 x1 = bf16x16(v + i), x2 = bf16x16(v + i + half);
                const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(x1, bf16x16(c + i)), _mm512_mul_ps(x2, bf16x16(s + i)));
                const __m512 hi = _mm512_add_ps(_mm512_mul_ps(x2, bf16x16(c + i + half)),
                                                _mm512_mul_ps(x1, bf16x16(s + i + half)));
                _mm256_storeu_si256((__m256i *)(v + i), f32x16_to_bf16(lo));
                _mm256_storeu_si256((__m256i *)(v + i + half), f32x16_to_bf16(hi));
            }
#endif
            for (; i < half; i++) {
                const float x1 = bf16_to_f32(v[i]), x2 = bf16_to_f32(v[i + half]);
                v[i] = f32_to_bf16(x1 * bf16_to_f32(c[i]) - x2 * bf16_to_f32(s[i]));
                v[i + half] = f32_to_bf16(x2 * bf16_to_f32(c[i + half]) + x1 * bf16_to_f32(s[i + half]));
            }
        }
    }
}

void pagoda_silu_mul_bf16(uint16_t *out, const uint16_t *gu, int64_t T, int64_t I, int64_t gu_stride,
                          int64_t out_stride, int nthreads)
{
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T * I >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gu + t * gu_stride, *u = g + I;
        uint16_t *o = out + t * out_stride;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= I; i += 16) {
            __m512 gv = bf16x16(g + i);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            _mm256_storeu_si256((__m256i *)(o + i), f32x16_to_bf16(_mm512_mul_ps(sv, bf16x16(u + i))));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= I; i += 8) {
            __m256 gv = bf16x8(g + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm_storeu_si128((__m128i *)(o + i), f32x8_to_bf16(_mm256_mul_ps(sv, bf16x8(u + i))));
        }
#endif
        for (; i < I; i++) {
            const float gv = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16((gv / (1.0f + expf(-gv))) * bf16_to_f32(u[i]));
        }
    }
}
