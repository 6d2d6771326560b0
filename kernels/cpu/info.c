/* What a built library is: its variant's name (set by the build) and the kernels it carries. */
#include "pagoda_cpu.h"

#ifndef PAGODA_VARIANT
#define PAGODA_VARIANT "dev"
#endif

const char *pagoda_cpu_variant(void) { return PAGODA_VARIANT; }

/* Whether this CPU has the AVX512-BF16 dot products (vdpbf16ps), asked of the CPU itself. */
int pagoda_cpu_has_bf16_dot(void)
{
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
#else
    return 0;
#endif
}

/* Bit 0: the causal prefill kernel is compiled in (it needs AVX2 + FMA or AVX-512; elsewhere it returns 2).
   Bit 1: the vector small-rows product (pagoda_small_rows_f32 / _bf16w) is compiled in; whether a product
   takes it or oneDNN is measured on the host (engine/models/cpu_linear_choice.py).
   Bit 2: pagoda_small_rows_bf16dp runs here (the AVX-512 build, on a CPU with AVX512-BF16). */
int pagoda_cpu_features(void)
{
    int features = 0;
#ifdef VLEN
    features |= 1 | 2; /* the vector variants (pagoda_cpu.h) */
#if VLEN == 16
    if (pagoda_cpu_has_bf16_dot()) features |= 4;
#endif
#endif
    return features;
}
