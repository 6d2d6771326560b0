"""RMSNorm with the residual add fused in: one launch instead of the ~9 torch ops of the residual add and norm.

`add_rms_norm(x, residual, weight, eps)`: residual += x (in place), then RMSNorm of that sum times the
weight (vLLM's fused_add_rms_norm); with no residual, a plain RMSNorm of x. The twin is
`reference.add_rms_norm_ref`: the sum rounded to the activation dtype before the norm reads it, the
normalised row rounded before the weight multiplies it, as the model's torch expressions round.

One program per row walks it twice in BLOCK steps: the sum of squares, then the output. The second walk
reads x and the residual again (from L2) and writes the new residual then, so nothing read is overwritten
before it is read. The row length and strides are kept out of Triton's specialization: they enter as
multiples of ALIGN (16 bytes' worth of elements when they all divide by it, else 1), so loads are
vectorised where rows allow it and a variant depends on the dtype, ALIGN and the launch configuration only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagoda.kernels.launch_config import rms_norm_config
from pagoda.kernels.runtime import check_launchable, device_limits, launch, vector_align

DYNAMIC_ARGS = ["x_stride", "res_stride", "out_stride", "width"]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _rms_norm_kernel(
    x_ptr,
    res_ptr,  # [T, H], updated in place (unused without HAS_RESIDUAL)
    w_ptr,
    out_ptr,
    x_stride,  # row strides and the row's width, in units of ALIGN elements
    res_stride,
    out_stride,
    width,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = width * ALIGN
    x_row = x_ptr + row * (x_stride * ALIGN)
    res_row = res_ptr + row * (res_stride * ALIGN)
    out_row = out_ptr + row * (out_stride * ALIGN)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
            h = (r + h).to(dtype).to(tl.float32)
        acc += h * h
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / n + eps)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        h = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
            s = (r + h).to(dtype)
            tl.store(res_row + offs, s, mask=mask)
            h = s.to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (h * rstd).to(dtype).to(tl.float32) * w
        tl.store(out_row + offs, y.to(dtype), mask=mask)


def add_rms_norm(
    x: torch.Tensor,  # [T, H], unit stride along H
    residual: torch.Tensor | None,  # [T, H] like x, updated in place to residual + x
    weight: torch.Tensor,  # [H]
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm(residual + x) * weight, the residual updated in place; RMSNorm(x) * weight without one."""
    check_launchable(x, "x")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(
            f"x must be [rows, hidden] with adjacent elements, got {tuple(x.shape)} {x.stride()}"
        )
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x {x.dtype} and weight {weight.dtype} must share a dtype among {DTYPES}")
    num_rows, hidden = x.shape
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"weight {tuple(weight.shape)} must be a contiguous [{hidden}]")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1
    ):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must be laid out like x")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be laid out like x")
    if num_rows == 0:
        return out
    res = residual if residual is not None else x
    align = vector_align(x.dtype, hidden, x.stride(0), res.stride(0), out.stride(0))
    config = rms_norm_config(device_limits(x.device))
    launch(
        _rms_norm_kernel,
        (num_rows,),
        x,
        res,
        weight,
        out,
        x.stride(0) // align,
        res.stride(0) // align,
        out.stride(0) // align,
        hidden // align,
        eps,
        HAS_RESIDUAL=residual is not None,
        ALIGN=align,
        BLOCK=config.block,
        num_warps=config.num_warps,
        shared_memory_bound=config.shared_memory,
    )
    return out
