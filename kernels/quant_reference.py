"""Pure-torch twins of the quantized linear kernels (kernels/quant_w4a16.py, kernels/quant_fp8.py).

Layouts are the canonical in-memory ones every loader converts to (rows = output features):

- INT4: ``qweight`` uint8 [N, ceil(K / 2)], the low nibble holds column 2j and the high nibble column 2j+1
  (values 0..15); ``scales`` [N, ceil(K / g)] in the compute dtype; ``zeros`` uint8 [N, ceil(K / g)]
  (values 0..15; 8 everywhere for a symmetric checkpoint); w[n, k] = (q[n, k] - zeros[n, k // g]) *
  scales[n, k // g]; per output channel g = K.
- FP8: ``weight`` float8_e4m3fn [N, K]; ``weight_scale`` float32 [N] (per-channel, or per-tensor expanded
  per row at load; [1] is taken too) or [ceil(N / bn), ceil(K / bk)] with ``block`` = (bn, bk).

The twins compute as the kernels do (a weight dequantized in float32, rounded to the activations' dtype,
products summed in float32 and rounded once), so kernel and twin agree to float32 summation order.
Activations are quantized per token (or per token and ``bk``-column group when block-wise) to FP8 with
scale = amax / 448, rounded to nearest even and saturated at +-448.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_AMAX = 1e-12  # an all-zero row's amax: its scale stays positive (its values quantize to 0)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> uint8 [N, ceil(K / 2)] in the canonical nibble order (a zero nibble pads odd K)."""
    q = q.to(torch.uint8)
    if q.shape[1] % 2:
        q = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 [N, ceil(K / 2)] -> int16 [N, K] values 0..15."""
    lo = (qweight & 0xF).to(torch.int16)
    hi = (qweight >> 4).to(torch.int16)
    return torch.stack([lo, hi], dim=2).reshape(qweight.shape[0], -1)[:, :in_features]


def group_count(in_features: int, group_size: int) -> int:
    """Groups along K (group_size -1 or 0: per output channel, one group)."""
    g = in_features if group_size <= 0 else group_size
    return -(-in_features // g)


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    in_features: int | None = None,
) -> torch.Tensor:
    """[N, K] in the scales' dtype: (q - zero) * scale computed in float32 and rounded once.
    ``in_features`` defaults to 2 * qweight's columns (say it for odd K); group_size <= 0 is per channel."""
    k = in_features if in_features is not None else 2 * qweight.shape[1]
    g = k if group_size <= 0 else group_size
    q = unpack_int4(qweight, k).float()
    col_group = torch.arange(k, device=qweight.device) // g
    z = zeros.float()[:, col_group]
    s = scales.float()[:, col_group]
    return ((q - z) * s).to(scales.dtype)


def w4a16_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequantize_int4(...).T (+ bias), summed in float32, in x's dtype."""
    w = dequantize_int4(qweight, scales, zeros, group_size, x.shape[1]).to(x.dtype)
    out = x.float() @ w.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def expand_fp8_scale(
    weight_scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] | None = None
) -> torch.Tensor:
    """float32 [N, K]: each weight element's scale (per tensor [1], per row [N], or block-wise)."""
    n, k = shape
    s = weight_scale.float()
    if block is not None:
        bn, bk = block
        rows = torch.arange(n, device=s.device) // bn
        cols = torch.arange(k, device=s.device) // bk
        return s[rows][:, cols]
    return s.reshape(-1, 1).expand(n, k)


def dequantize_fp8(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[N, K]: the FP8 weight times its scale in float32, rounded to ``dtype``."""
    scale = expand_fp8_scale(weight_scale, tuple(weight.shape), block)
    return (weight.float() * scale).to(dtype)


def quantize_fp8_per_token(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)]): each row (or each row's ``group``-column
    slice) divided by amax / 448, rounded to nearest even; group None is the whole row."""
    m, k = x.shape
    g = max(k if group is None else group, 1)
    groups = -(-k // g) if k else 0
    xf = x.float()
    padded = torch.nn.functional.pad(xf, (0, groups * g - k)).reshape(m, groups, g)
    amax = padded.abs().amax(dim=2)
    scale = amax.clamp(min=MIN_AMAX) / FP8_MAX
    cols = torch.arange(k, device=x.device) // g
    q = (xf / scale[:, cols]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
    act_quant: bool = False,
) -> torch.Tensor:
    """x [M, K] times the FP8 weight [N, K] (+ bias) in x's dtype. ``act_quant`` False: the weight
    dequantized to x's dtype (weight-only). True: x quantized per token (block-wise: per token and bk-column
    group) and FP8 x FP8 products summed in float32, scaled per row and column (per K block when
    block-wise) after each sum."""
    n, k = weight.shape
    if not act_quant:
        w = dequantize_fp8(weight, weight_scale, block, x.dtype)
        out = x.float() @ w.float().T
    elif block is None:
        xq, xs = quantize_fp8_per_token(x)
        ws = weight_scale.float().reshape(-1).expand(n)
        out = (xq.float() @ weight.float().T) * xs * ws[None, :]
    else:
        bn, bk = block
        xq, xs = quantize_fp8_per_token(x, bk)
        ws = weight_scale.float()[torch.arange(n, device=x.device) // bn]  # [N, K blocks]
        out = torch.zeros((x.shape[0], n), dtype=torch.float32, device=x.device)
        for j, k0 in enumerate(range(0, k, bk)):
            part = xq[:, k0 : k0 + bk].float() @ weight[:, k0 : k0 + bk].float().T
            out += part * xs[:, j : j + 1] * ws[None, :, j]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
