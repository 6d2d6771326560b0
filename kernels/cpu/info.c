/* What a built library is: its variant's name (set by the build) and the kernels it carries. */
#include "pagoda_cpu.h"

#ifndef PAGODA_VARIANT
#define PAGODA_VARIANT "dev"
#endif

const char *pagoda_cpu_variant(void) { return PAGODA_VARIANT; }

/* Bit 0: the causal prefill kernel is compiled in (it needs AVX2 + FMA or AVX-512; elsewhere it returns 2).
   Bit 1: products of up to 64 rows should take pagoda_small_rows_f32 rather than oneDNN: the AVX2 build, where
   it was measured faster (docs/benchmarks.md); AVX-512 hosts keep oneDNN, which was measured there. */
int pagoda_cpu_features(void)
{
    int features = 0;
#ifdef VLEN
    features |= 1; /* the vector variants (pagoda_cpu.h) */
#if VLEN == 8
    features |= 2; /* the AVX2 variant */
#endif
#endif
    return features;
}
