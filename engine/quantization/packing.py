"""The canonical in-memory layouts of quantized weights (rows = output features), packed, unpacked and
dequantized in torch.

- INT4: ``qweight`` uint8 [N, K // 2], low nibble = column 2j, high nibble = column 2j + 1 (values 0..15);
  ``scales`` [N, K // g]; ``zeros`` uint8 [N, K // g] (8 everywhere for a symmetric checkpoint);
  w[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g]; per output channel g = K.
- FP8: ``weight`` float8_e4m3fn [N, K]; ``weight_scale`` float32 [N] (per channel, or per tensor expanded to
  the rows of each fused part) or [ceil(N / bn), ceil(K / bk)] block-wise; where fused parts cut the
  checkpoint's bn-row blocks the scales are held per row, [N, ceil(K / bk)] with block (1, bk).

Dequantizing computes in float32 and rounds once to the target dtype, as the GPU kernels' twins do.
"""

from __future__ import annotations

import torch


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 (K even) -> uint8 [N, K // 2] in the canonical nibble order."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> uint8 [N, K] values 0..15."""
    return torch.stack([qweight & 0xF, qweight >> 4], dim=2).reshape(qweight.shape[0], -1)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[N, K] in ``dtype``; the group size is K over the scales' columns."""
    n, groups = scales.shape
    q = unpack_int4(qweight).view(n, groups, -1).float()
    w = (q - zeros.float().unsqueeze(2)).mul_(scales.float().unsqueeze(2))
    return w.view(n, -1).to(dtype)


def dequantize_fp8(
    weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """[N, K] in ``dtype``: per-row scales [N] ([1]: one for all) or block-wise ones."""
    w = weight.float()
    s = weight_scale.float()
    if block is not None:
        bn, bk = block
        n, k = w.shape
        s = s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
        return (w * s).to(dtype)
    return (w * s.reshape(-1, 1)).to(dtype)
