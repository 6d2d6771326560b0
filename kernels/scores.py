"""What the attention kernels share about scores and heads: the logit soft-cap of Gemma 2, padded head lanes."""

from __future__ import annotations

import math

import triton
import triton.language as tl

NEG_TWO_LOG2E = tl.constexpr(-2.0 * math.log2(math.e))


@triton.jit
def tanh(x):
    """tanh from exp2 (Triton's core language has no tanh; libdevice's is CUDA-only): the exponent of
    -2|x| lies in (0, 1], so nothing overflows for any score."""
    t = tl.exp2(tl.abs(x) * NEG_TWO_LOG2E)
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


def softcap_scales(scale: float, logit_softcap: float | None) -> tuple[float, float]:
    """(qk_scale, softcap_log2) for a launch: without a cap, (scale * log2(e), 0) and the kernel's score
    is q.k * qk_scale; with a cap c, (scale / c, c * log2(e)) and the score is tanh(q.k * qk_scale) *
    softcap_log2, which is c * tanh(scale * q.k / c) in the log2 domain of the kernels' exp2 softmax."""
    if not logit_softcap:
        return scale * math.log2(math.e), 0.0
    return scale / logit_softcap, logit_softcap * math.log2(math.e)


@triton.jit
def head_lanes(HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """The lanes of one head (`tl.arange` wants a power of two: Phi-3's head_dim 96 runs on 128) and which of
    them are real; a constant all-true mask when none is padding, which the compiler folds away."""
    d = tl.arange(0, HEAD_DIM_PAD)
    if HEAD_DIM_PAD == HEAD_DIM:
        ok = tl.full([HEAD_DIM_PAD], 1, tl.int1)
    else:
        ok = d < HEAD_DIM
    return d, ok
