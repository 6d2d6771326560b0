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
    """2-D CPU tensors of one dtype, float32 or bfloat16, whose rows are contiguous (a plain loop: every
    decoder layer asks several times per step)."""
    dtype = tensors[0].dtype
    if dtype is not torch.float32 and dtype is not torch.bfloat16:
        return False
    for t in tensors:
        if t.dtype is not dtype or not t.is_cpu or t.dim() != 2 or t.stride(1) != 1:
            return False
    return True


def _vector_ok(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """A norm's weight as `_rows_ok` takes its [1, -1] view: a CPU tensor of ``dtype`` with unit stride (without
    making the view for the usual 1-D weight)."""
    if weight.dim() != 1 or weight.shape[0] <= 1:
        weight = weight.view(1, -1)
    return weight.dtype is dtype and weight.is_cpu and weight.stride(-1) == 1


_fns: dict[tuple[ctypes.CDLL, str, torch.dtype], ctypes._CFuncPtr] = {}


def _fn(lib: ctypes.CDLL, name: str, dtype: torch.dtype):
    """The kernel of ``name`` for ``dtype`` (the bfloat16 one carries a suffix), looked up once per library."""
    key = (lib, name, dtype)
    fn = _fns.get(key)
    if fn is None:
        fn = _fns[key] = getattr(lib, name + ("_bf16" if dtype == torch.bfloat16 else ""))
    return fn


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """RMSNorm(x) or, with a residual, residual += x in place and RMSNorm(residual); None = not handled."""
    lib = library()
    if lib is None or not _rows_ok(x) or not _vector_ok(weight, x.dtype):
        return None
    shape, dtype = x.shape, x.dtype
    if residual is not None and (
        not _rows_ok(residual) or residual.shape != shape or residual.dtype is not dtype
    ):
        return None
    if dtype is torch.bfloat16 and shape[1] > 8192:
        return None  # the bfloat16 kernel keeps one row in a float32 buffer of 8192
    out = torch.empty(shape[0], shape[1], dtype=dtype)  # (ints: a torch.Size argument costs more)
    _fn(lib, "pagoda_add_rms_norm", dtype)(
        out.data_ptr(),
        None if residual is None else residual.data_ptr(),
        x.data_ptr(),
        weight.data_ptr(),
        shape[0],
        shape[1],
        x.stride(0),
        shape[1],  # out's row stride: a new contiguous tensor
        0 if residual is None else residual.stride(0),
        eps,
        torch.get_num_threads(),
    )
    return out


_tables_seen: list = [None]  # the last (cos, sin, dtype, rows, head_dim) that passed `_tables_ok`


def _tables_ok(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, rows: int, head_dim: int) -> bool:
    """cos and sin as `rotary_` reads them: contiguous CPU [rows, head_dim] tensors of ``dtype``. Every layer of a
    step passes the same two tensors, so the last pair that passed is remembered (by identity; the entry keeps
    them alive, so an identity is never another tensor's)."""
    seen = _tables_seen[0]
    if (
        seen is not None
        and seen[0] is cos
        and seen[1] is sin
        and seen[2] is dtype
        and seen[3] == rows
        and seen[4] == head_dim
    ):
        return True
    ok = (
        cos.dtype is dtype
        and _rows_ok(cos, sin)
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == (rows, head_dim)
        and sin.shape == cos.shape
    )
    if ok:
        _tables_seen[0] = (cos, sin, dtype, rows, head_dim)
    return ok


def rotary_(x: torch.Tensor, nheads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate the first ``nheads`` heads of each row of ``x`` [T, >= nheads * head_dim] in place with the
    tokens' cos/sin rows [T, head_dim]; False = not handled, x untouched."""
    lib = library()
    if (
        lib is None
        or head_dim % 2
        or not _rows_ok(x)
        or not _tables_ok(cos, sin, x.dtype, x.shape[0], head_dim)
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
    out = torch.empty(t, inter, dtype=gate_up.dtype)
    _fn(lib, "pagoda_silu_mul", gate_up.dtype)(
        out.data_ptr(),
        gate_up.data_ptr(),
        t,
        inter,
        gate_up.stride(0),
        inter,  # out's row stride: a new contiguous tensor
        torch.get_num_threads(),
    )
    return out
