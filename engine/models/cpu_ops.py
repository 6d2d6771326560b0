"""Fused element-wise ops of the decoder layer for float32 on the CPU: one pass over memory instead of five.

- `add_rms_norm`: residual += x, then RMSNorm of the sum (vLLM's fused_add_rms_norm); the torch version reads
  and writes the hidden state ~6 times (add, pow, mean, rsqrt, two muls).
- `rotary_`: rotate-half rotary embedding applied in place to the query and key heads of the fused QKV output
  (the torch version builds the rotated copy with a neg and a cat, then three more passes).
- `silu_mul`: silu(gate) * up from the fused gate/up output, without the intermediate silu tensor.

Rounding: built with no implicit FMA contraction and the same operation order as the torch expressions in
`layers.py`, the residual add and rotary are bit-identical to them; RMSNorm differs only in the summation order
of the mean of squares, and silu in its exp (both about an ulp). Each returns None (or False) where it does not
apply (other dtypes or devices, odd layouts, no kernels library), and the caller runs its torch
expression. C source: kernels/cpu/layer_ops.c.
"""

from __future__ import annotations

import ctypes

import torch
from pagoda.kernels.cpu.loader import library


def _rows_ok(*tensors: torch.Tensor) -> bool:
    """2-D CPU tensors of one dtype, float32 or bfloat16, whose rows are contiguous."""
    dtype = tensors[0].dtype
    return dtype in (torch.float32, torch.bfloat16) and all(
        t.device.type == "cpu" and t.dtype == dtype and t.dim() == 2 and t.stride(1) == 1 for t in tensors
    )


def _fn(lib: ctypes.CDLL, name: str, dtype: torch.dtype):
    return getattr(lib, name + ("_bf16" if dtype == torch.bfloat16 else ""))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """RMSNorm(x) or, with a residual, residual += x in place and RMSNorm(residual); None = not handled."""
    lib = library()
    if (
        lib is None
        or not _rows_ok(x, weight.view(1, -1))
        or (residual is not None and not _rows_ok(residual))
    ):
        return None
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return None
    if x.dtype == torch.bfloat16 and x.shape[1] > 8192:
        return None  # the bfloat16 kernel keeps one row in a float32 buffer of 8192
    out = torch.empty(x.shape, dtype=x.dtype)
    _fn(lib, "pagoda_add_rms_norm", x.dtype)(
        out.data_ptr(),
        None if residual is None else residual.data_ptr(),
        x.data_ptr(),
        weight.data_ptr(),
        x.shape[0],
        x.shape[1],
        x.stride(0),
        out.stride(0),
        0 if residual is None else residual.stride(0),
        eps,
        torch.get_num_threads(),
    )
    return out


def rotary_(x: torch.Tensor, nheads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate the first ``nheads`` heads of each row of ``x`` [T, >= nheads * head_dim] in place with the
    tokens' cos/sin rows [T, head_dim]; False = not handled, x untouched."""
    lib = library()
    if (
        lib is None
        or head_dim % 2
        or not _rows_ok(x, cos, sin)
        or not (cos.is_contiguous() and sin.is_contiguous())
        or cos.shape != (x.shape[0], head_dim)
        or sin.shape != cos.shape
        or x.shape[1] < nheads * head_dim
    ):
        return False
    _fn(lib, "pagoda_rotary", x.dtype)(
        x.data_ptr(),
        x.shape[0],
        x.stride(0),
        nheads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        torch.get_num_threads(),
    )
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of a [T, 2I] gate/up output; None = not handled."""
    lib = library()
    if lib is None or not _rows_ok(gate_up) or gate_up.shape[1] % 2:
        return None
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype)
    _fn(lib, "pagoda_silu_mul", gate_up.dtype)(
        out.data_ptr(),
        gate_up.data_ptr(),
        t,
        inter,
        gate_up.stride(0),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out
