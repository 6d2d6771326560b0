"""MXFP4 (OCP microscaling FP4) weights, as gpt-oss checkpoints store their experts: dequantized at load.

Format: every 32 consecutive values of a row share one 8-bit power-of-two scale (E8M0: exponent + 127), and
each value is a 4-bit E2M1 float (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives), two per byte, the low nibble first. A checkpoint holds `<name>_blocks` [..., rows, K / 32, 16]
uint8 and `<name>_scales` [..., rows, K / 32] uint8 for a weight [..., rows, K].

Why dequantized at load and not run natively: the CPU path has no FP4 arithmetic (a kernel would widen every
value to float32 per product anyway, and the weights would be re-read every step), and GPUs before Blackwell
have no FP4 tensor cores either (Hopper's MXFP4 kernels widen to bf16/fp8 in registers, which needs a kernel of
its own). Dequantized, the experts run the same grouped GEMMs as every other MoE model. The price is memory:
4.25 bits per weight on disk (4 bits plus an 8-bit scale per 32) become 16 in bfloat16, 3.8x the experts'
bytes (gpt-oss-20b: 41.8 GB in memory, about 14 GB on disk; gpt-oss-120b: 233.6 GB against about 65 GB; see
docs/models.md, "gpt-oss").
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
# E2M1 code -> value (code bit 3 is the sign)
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., G, 16] uint8 blocks and [..., G] uint8 scales -> [..., G * 32] values in ``dtype`` (exact in
    bfloat16 and float32 for the scales real checkpoints hold: each value is a 3-bit-mantissa float times a
    power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} must be [..., G, 16] over scales {tuple(scales.shape)} [..., G]"
        )
    lut = torch.tensor(_FP4, dtype=torch.float32, device=blocks.device)
    lo = lut[(blocks & 0x0F).long()]
    hi = lut[(blocks >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., G, 32]: low nibble first
    exponent = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponent.unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)
