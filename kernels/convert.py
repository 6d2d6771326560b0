"""Element conversions the attention kernels share."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def widen(x, dtype: tl.constexpr):
    """A K or V tile in the compute dtype. FP8 goes through float32: Ada (compute capability 8.9) has FP8
    but converts it to bfloat16 only through a float16 step its ptxas lacks (`cvt.bf16.f16` is sm_90+),
    which `pagoda kernels warm` found compiling for the L4."""
    if x.dtype.is_fp8():
        x = x.to(tl.float32)
    return x.to(dtype)
