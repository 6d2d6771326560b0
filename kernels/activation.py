"""silu(gate) * up of the fused gate/up projection in one launch, without the intermediate silu tensor.

The twin is `reference.silu_mul_ref`: float32 math, rounded once to the activation dtype. One program per
(row, BLOCK columns of the intermediate size); the width and row strides enter as multiples of ALIGN (see
`pagoda.kernels.runtime.vector_align`), so a variant depends on the dtype, ALIGN and the launch
configuration only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagoda.kernels.launch_config import silu_mul_config
from pagoda.kernels.runtime import check_launchable, device_limits, launch, vector_align

DYNAMIC_ARGS = ["in_stride", "out_stride", "width"]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _silu_mul_kernel(
    in_ptr,  # [T, 2 * I]: gate then up
    out_ptr,  # [T, I]
    in_stride,  # in units of ALIGN elements, as is the width I
    out_stride,
    width,
    ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = width * ALIGN
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate_row = in_ptr + row * (in_stride * ALIGN)
    gate = tl.load(gate_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_row + n + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * (out_stride * ALIGN) + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of ``gate_up`` [T, 2I] (gate columns first) -> [T, I]."""
    check_launchable(gate_up, "gate_up")
    if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2:
        raise ValueError(
            f"gate_up must be [rows, 2 * intermediate] with adjacent elements, got {gate_up.shape}"
        )
    if gate_up.dtype not in DTYPES:
        raise ValueError(f"gate_up is {gate_up.dtype}; the silu-and-mul kernel takes {DTYPES}")
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (num_rows, inter) or out.dtype != gate_up.dtype or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be [{num_rows}, {inter}] {gate_up.dtype}")
    if num_rows == 0 or inter == 0:
        return out
    align = vector_align(gate_up.dtype, inter, gate_up.stride(0), out.stride(0))
    config = silu_mul_config(device_limits(gate_up.device))
    launch(
        _silu_mul_kernel,
        (num_rows, triton.cdiv(inter, config.block)),
        gate_up,
        out,
        gate_up.stride(0) // align,
        out.stride(0) // align,
        inter // align,
        ALIGN=align,
        BLOCK=config.block,
        num_warps=config.num_warps,
        shared_memory_bound=config.shared_memory,
    )
    return out
