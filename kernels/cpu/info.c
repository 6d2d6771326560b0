/* What a built library is: its variant's name (set by the build) and the kernels it carries. */
#include "pagoda_cpu.h"

#ifndef PAGODA_VARIANT
#define PAGODA_VARIANT "dev"
#endif

const char *pagoda_cpu_variant(void) { return PAGODA_VARIANT; }

/* Bit 0: the causal prefill kernel is compiled in (it needs AVX-512; elsewhere it returns 2). */
int pagoda_cpu_features(void)
{
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
