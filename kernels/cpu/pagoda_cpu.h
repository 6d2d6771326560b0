/* Shared by the C kernels of the CPU path (one .c file per kernel family, all linked into one library per
   variant): headers, bfloat16 conversions, a scalar exp for softmax terms, and the vector layer.

   A variant is one set of compiler flags (kernels/cpu/build.py). The vector layer gives every kernel one body
   per algorithm, written over VLEN float32 lanes: 16 on the AVX-512 variant, 8 on the AVX2 + FMA variant. It
   is defined only there (VLEN is then set); the portable baseline compiles only the kernels' plain C loops,
   which the compiler vectorises with what the target has. */
#ifndef PAGODA_CPU_H
#define PAGODA_CPU_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Whether this CPU has the AVX512-BF16 dot products (info.c). */
int pagoda_cpu_has_bf16_dot(void);

/* bfloat16 is the top half of a float32: widening is a 16-bit shift. */
static inline float bf16_to_f32(uint16_t x)
{
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

/* float32 -> bfloat16, rounded to nearest even; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f)
{
    union { float f; uint32_t u; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u);
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

/* exp(x) for x <= 0 (softmax terms) by the same method as vexp below, in plain C so the compiler vectorises
   the loops that call it at whatever width the variant has (libm's expf is a call it cannot vectorise):
   2^n * p(r), r = x - n ln2, n rounded by adding and removing 1.5 * 2^23. */
static inline float exp_neg(float x)
{
    x = x > -87.0f ? x : -87.0f; /* NaN (from -inf - -inf) too, as vexp does */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    const float y = (p * r) * r + (r + 1.0f);
    union { uint32_t u; float f; } e;
    e.u = (uint32_t)((int32_t)n + 127) << 23;
    return y * e.f;
}

/* Gemma 2's logit soft-cap of one score: cap * tanh(x / cap), inv = 1 / cap. tanh as Cephes' tanhf: an odd
   polynomial below 0.625, (1 - e) / (1 + e) with e = exp(-2|y|) above (no cancellation there), both computed
   and one selected so loops over scores vectorise (vsoftcap is the same on vector lanes). */
/* The factor that normalises a row's accumulated P.V once its softmax denominator also holds a learned sink
   logit (gpt-oss: one per query head, a column of the softmax with no value): with m the row's running
   maximum and l its sum of exp(score - m), out = acc * c / (l * c + exp(sink - mf)), mf = max(m, sink),
   c = exp(m - mf), which neither overflows nor divides by zero. */
static inline float sink_norm(float m, float l, float sink)
{
    const float mf = m > sink ? m : sink;
    const float c = m == -INFINITY ? 0.0f : expf(m - mf);
    return c / (l * c + expf(sink - mf));
}

static inline float softcap(float x, float cap, float inv)
{
    const float y = x * inv, a = fabsf(y), z = y * y;
    float p = -5.70498872745E-3f;
    p = p * z + 2.06390887954E-2f;
    p = p * z - 5.37397155531E-2f;
    p = p * z + 1.33314422036E-1f;
    p = p * z - 3.33332819422E-1f;
    const float small = p * z * a + a;
    const float e = exp_neg(-2.0f * a);
    const float t = a < 0.625f ? small : (1.0f - e) / (1.0f + e);
    return copysignf(t, y) * cap;
}

/* ---- The vector layer ----------------------------------------------------------------------------------

   vfloat: VLEN float32 lanes; vint: VLEN int32 lanes; vbf16: VLEN bfloat16 lanes (half a vfloat); vmask: one
   flag per lane (an AVX-512 mask register, or an AVX2 vector of all-ones / all-zero lanes).

   The operations that are the same instruction at both widths are written once below through VOP (the
   _mm512_ / _mm256_ intrinsic of the variant's width); what truly differs between the widths (rounding,
   horizontal reductions, lane flags, packing to 16 bits) is a short primitive per width. Lane-wise int32
   logic uses GCC's vector operators, and a cast between two vector types of one size reinterprets the bits. */
#if defined(__AVX512F__)
#define VLEN 16
#define VBITS 512
#elif defined(__AVX2__) && defined(__FMA__)
#define VLEN 8
#define VBITS 256
#endif

#ifdef VLEN
#include <immintrin.h>

#define VCAT3_(a, b, c) a##b##c
#define VCAT3(a, b, c) VCAT3_(a, b, c)
#define VOP(op) VCAT3(_mm, VBITS, _##op) /* VOP(add_ps): _mm512_add_ps or _mm256_add_ps */

typedef VCAT3(__m, VBITS, ) vfloat;
typedef VCAT3(__m, VBITS, i) vint;

#define VINLINE static inline __attribute__((always_inline))

VINLINE vfloat vzero(void) { return VOP(setzero_ps)(); }
VINLINE vfloat vset1(float x) { return VOP(set1_ps)(x); }
VINLINE vfloat vload(const float *p) { return VOP(load_ps)(p); } /* p aligned to the vector */
VINLINE vfloat vloadu(const float *p) { return VOP(loadu_ps)(p); }
VINLINE void vstore(float *p, vfloat v) { VOP(store_ps)(p, v); }
VINLINE void vstoreu(float *p, vfloat v) { VOP(storeu_ps)(p, v); }
VINLINE vfloat vadd(vfloat a, vfloat b) { return VOP(add_ps)(a, b); }
VINLINE vfloat vsub(vfloat a, vfloat b) { return VOP(sub_ps)(a, b); }
VINLINE vfloat vmul(vfloat a, vfloat b) { return VOP(mul_ps)(a, b); }
VINLINE vfloat vdiv(vfloat a, vfloat b) { return VOP(div_ps)(a, b); }
VINLINE vfloat vmin(vfloat a, vfloat b) { return VOP(min_ps)(a, b); }
VINLINE vfloat vmax(vfloat a, vfloat b) { return VOP(max_ps)(a, b); }     /* b where either is NaN */
VINLINE vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return VOP(fmadd_ps)(a, b, c); }   /* a * b + c */
VINLINE vfloat vfnmadd(vfloat a, vfloat b, vfloat c) { return VOP(fnmadd_ps)(a, b, c); } /* c - a * b */
VINLINE vint viset1(int32_t x) { return VOP(set1_epi32)(x); }
VINLINE vint viadd(vint a, vint b) { return VOP(add_epi32)(a, b); }
VINLINE vint vcvt_int(vfloat x) { return VOP(cvtps_epi32)(x); } /* rounded to nearest even */
VINLINE vfloat vcvt_float(vint x) { return VOP(cvtepi32_ps)(x); }

VINLINE vint viota(void) /* 0, 1, ..., VLEN - 1 */
{
    static const int32_t lanes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vint v;
    memcpy(&v, lanes, sizeof v);
    return v;
}

VINLINE void vistoreu(int32_t *p, vint v) { memcpy(p, &v, sizeof v); }

#if VLEN == 16
typedef __mmask16 vmask;
typedef __m256i vbf16;

VINLINE vfloat vround(vfloat x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
VINLINE float vhsum(vfloat v) { return _mm512_reduce_add_ps(v); }
VINLINE float vhmax(vfloat v) { return _mm512_reduce_max_ps(v); }
VINLINE vmask vcmpgt(vfloat a, vfloat b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
VINLINE vmask visnan(vfloat a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
VINLINE vmask vmask_first(int n) { return (vmask)((1u << n) - 1u); } /* lanes [0, n), 0 <= n <= VLEN */
/* lanes where lo <= k <= hi */
VINLINE vmask vmask_range(vint k, int lo, int hi)
{
    return _mm512_cmp_epi32_mask(k, viset1(hi), _MM_CMPINT_LE) & _mm512_cmp_epi32_mask(k, viset1(lo), _MM_CMPINT_NLT);
}
VINLINE vfloat vblend(vfloat a, vfloat b, vmask m) { return _mm512_mask_blend_ps(m, a, b); } /* m ? b : a */
VINLINE vint viblend(vint a, vint b, vmask m) { return _mm512_mask_blend_epi32(m, a, b); }
VINLINE vfloat vmaskz(vmask m, vfloat a) { return _mm512_maskz_mov_ps(m, a); } /* m ? a : 0 */
VINLINE vbf16 vpack16(vint v) { return _mm512_cvtepi32_epi16(v); } /* the low 16 bits of each lane */
/* r, or where nan is set u with its quiet bit set (one masked instruction: measured faster than a blend) */
VINLINE vint vquiet_nan(vint r, vint u, vmask nan) { return _mm512_mask_or_epi32(r, nan, u, viset1(0x400000)); }
VINLINE vfloat vbroadcast(const float *p) { return _mm512_set1_ps(*p); } /* *p on every lane */
VINLINE void vstore16(uint16_t *p, vbf16 h) { _mm256_storeu_si256((__m256i *)p, h); }

#else
typedef vfloat vmask;
typedef __m128i vbf16;

VINLINE vfloat vround(vfloat x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
VINLINE float vhsum(vfloat v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
VINLINE float vhmax(vfloat v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
VINLINE vmask vcmpgt(vfloat a, vfloat b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
VINLINE vmask visnan(vfloat a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
VINLINE vmask vmask_first(int n) { return (vmask)_mm256_cmpgt_epi32(viset1(n), viota()); }
VINLINE vmask vmask_range(vint k, int lo, int hi)
{
    return (vmask)~(_mm256_cmpgt_epi32(k, viset1(hi)) | _mm256_cmpgt_epi32(viset1(lo), k));
}
VINLINE vfloat vblend(vfloat a, vfloat b, vmask m) { return _mm256_blendv_ps(a, b, m); }
VINLINE vint viblend(vint a, vint b, vmask m) { return (vint)_mm256_blendv_ps((vfloat)a, (vfloat)b, m); }
VINLINE vfloat vmaskz(vmask m, vfloat a) { return _mm256_and_ps(m, a); }
VINLINE vbf16 vpack16(vint v) { return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)); }
VINLINE vint vquiet_nan(vint r, vint u, vmask nan) { return viblend(r, u | viset1(0x400000), nan); }
/* a load that broadcasts, which GCC keeps in the loop rather than hoisting a spilled register per value (the
   prefill tile's 12 rows x 8 keys: 7% slower that way) */
VINLINE vfloat vbroadcast(const float *p) { return _mm256_broadcast_ss(p); }
VINLINE void vstore16(uint16_t *p, vbf16 h) { _mm_storeu_si128((__m128i *)p, h); }
#endif

/* exp on every lane: 2^n * p(r), r = x - n ln2, Cephes' minimax polynomial (about 1 ulp on the range used). */
VINLINE vfloat vexp(vfloat x)
{
    x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
    const vfloat n = vround(vmul(x, vset1(1.44269504088896341f)));
    vfloat r = vfnmadd(n, vset1(0.693359375f), x);
    r = vfnmadd(n, vset1(-2.12194440e-4f), r);
    vfloat p = vset1(1.9875691500E-4f);
    p = vfmadd(p, r, vset1(1.3981999507E-3f));
    p = vfmadd(p, r, vset1(8.3334519073E-3f));
    p = vfmadd(p, r, vset1(4.1665795894E-2f));
    p = vfmadd(p, r, vset1(1.6666665459E-1f));
    p = vfmadd(p, r, vset1(5.0000001201E-1f));
    const vfloat y = vfmadd(vmul(p, r), r, vadd(r, vset1(1.0f)));
    const vint e = VOP(slli_epi32)(viadd(vcvt_int(n), viset1(127)), 23);
    return vmul(y, (vfloat)e);
}

/* softcap on every lane (see the scalar softcap above). */
VINLINE vfloat vsoftcap(vfloat x, vfloat cap, vfloat inv)
{
    const vfloat y = vmul(x, inv), sign = vset1(-0.0f);
    const vfloat a = VOP(andnot_ps)(sign, y), z = vmul(y, y);
    vfloat p = vset1(-5.70498872745E-3f);
    p = vfmadd(p, z, vset1(2.06390887954E-2f));
    p = vfmadd(p, z, vset1(-5.37397155531E-2f));
    p = vfmadd(p, z, vset1(1.33314422036E-1f));
    p = vfmadd(p, z, vset1(-3.33332819422E-1f));
    const vfloat small = vfmadd(vmul(p, z), a, a);
    const vfloat e = vexp(vmul(a, vset1(-2.0f)));
    const vfloat big = vdiv(vsub(vset1(1.0f), e), vadd(vset1(1.0f), e));
    const vfloat t = vblend(small, big, vcmpgt(a, vset1(0.625f))); /* a > 0.625 ? big : small */
    return vmul(VOP(or_ps)(t, VOP(and_ps)(sign, y)), cap);
}

/* bfloat16 lanes <-> float32 lanes: widening is exact; narrowing rounds to nearest even, NaN stays NaN (as
   f32_to_bf16). */
VINLINE vfloat vfrom_bf16(vbf16 h) { return (vfloat)VOP(slli_epi32)(VOP(cvtepu16_epi32)(h), 16); }

VINLINE vbf16 vto_bf16(vfloat v)
{
    const vint u = (vint)v;
    const vint lsb = VOP(srli_epi32)(u, 16) & viset1(1);
    const vint r = vquiet_nan(viadd(u, viadd(lsb, viset1(0x7fff))), u, visnan(v));
    return vpack16(VOP(srli_epi32)(r, 16));
}

VINLINE vfloat vload_bf16(const uint16_t *p)
{
    vbf16 h;
    memcpy(&h, p, sizeof h);
    return vfrom_bf16(h);
}

VINLINE void vstore_bf16(uint16_t *p, vfloat v) { vstore16(p, vto_bf16(v)); }

/* VLEN int8 -> float32 (an INT8 cache's values, before their scale). */
VINLINE vfloat vload_i8(const int8_t *p)
{
    __m128i b = _mm_setzero_si128();
    memcpy(&b, p, VLEN);
    return vcvt_float(VOP(cvtepi8_epi32)(b));
}

/* A float32 row or a bfloat16 one (BF, a constant where it is inlined), from element k. */
VINLINE vfloat vload_as(const void *p, int64_t k, const int BF)
{
    return BF ? vload_bf16((const uint16_t *)p + k) : vloadu((const float *)p + k);
}

VINLINE void vstore_as(void *p, int64_t k, vfloat v, const int BF)
{
    if (BF) vstore_bf16((uint16_t *)p + k, v);
    else vstoreu((float *)p + k, v);
}
#endif /* VLEN */

/* The scalar twins of vload_as / vstore_as, for the tails of rows. */
static inline float load_as(const void *p, int64_t k, const int BF)
{
    return BF ? bf16_to_f32(((const uint16_t *)p)[k]) : ((const float *)p)[k];
}

static inline void store_as(void *p, int64_t k, float v, const int BF)
{
    if (BF) ((uint16_t *)p)[k] = f32_to_bf16(v);
    else ((float *)p)[k] = v;
}

#endif /* PAGODA_CPU_H */
