/* What the two GGUF products share (quant_gguf.c: float32 activations; quant_gguf_q8act.c: int8 ones): ggml's
   type numbers and the float16 scales of the blocks. */
#ifndef PAGODA_QUANT_GGUF_H
#define PAGODA_QUANT_GGUF_H

#include "pagoda_cpu.h"
#ifdef __F16C__
#include <immintrin.h>
#endif

/* ggml's type numbers (gguf.GGMLQuantizationType) */
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q6_K 14

/* IEEE half -> float, exact (subnormals by one multiply that rebiases the exponent). */
static inline float half(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h); /* one instruction on the vector variants (F16C is part of x86-64-v3) */
#endif
    union { uint32_t u; float f; } c;
    const uint32_t em = h & 0x7fffu;
    if (em >= 0x7c00u) {
        c.u = 0x7f800000u | (em & 0x3ffu) << 13;
    } else {
        c.u = em << 13;
        c.f *= 0x1p112f;
    }
    c.u |= (uint32_t)(h & 0x8000u) << 16;
    return c.f;
}

#endif /* PAGODA_QUANT_GGUF_H */
