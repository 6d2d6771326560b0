"""FP8 linear layers (the GPU path): FP8 x FP8 with per-token activation scales, or FP8 weight-only.

The weight is float8_e4m3fn [N, K] with float32 scales per row (per-channel, or per-tensor expanded per
row at load) or per (bn x bk) block (kernels/quant_reference.py). Which product runs is decided by one
function, `fp8_act_quant`, from the device: compute capability 8.9 and up (Ada, Hopper, Blackwell) has
FP8 tensor cores, so

- FP8 x FP8: a small kernel quantizes the activations per token (block-wise: per token and bk-column
  group, DeepSeek's scheme) to FP8 with scale = amax / 448, then the GEMM feeds both FP8 tiles to tl.dot
  with float32 accumulation and scales each sum by its row's and column's scales (block-wise: after each
  K block, which also keeps the FP8 accumulator's partial sums short);
- weight-only (below 8.9): the GEMM reads the weight's bytes (Triton has no FP8 type there), decodes
  each to float32 in integer arithmetic, multiplies by its scales, rounds to the activations' dtype and runs
  a 16-bit tl.dot.

The activation quantizer rounds in float32 integer arithmetic to the nearest-even FP8 value (saturated at
+-448) before the cast, so the cast itself is exact: Triton's interpreter converts float32 to FP8 without
carrying a rounded-up mantissa into the exponent (125.3 became 64), compiled code rounds to nearest even;
with the value already representable both give torch's FP8. The interpreter's tl.dot takes FP8 operands
(it widens them; FP8 products are exact in float32), so both paths run there unchanged.
Twins: `quant_reference.fp8_reference` (act_quant True / False) and `quantize_fp8_per_token`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagoda.kernels.launch_config import DOT_MIN, fp8_act_quant_config, quant_linear_config
from pagoda.kernels.quant_reference import FP8_MAX, MIN_AMAX
from pagoda.kernels.runtime import (
    COMPILING,
    check_launchable,
    device_limits,
    dtype_name,
    interpreting,
    launch,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DOT_CAPABILITY = (8, 9)
DYNAMIC_ARGS = ["M"]
# the scale's rows per weight row: the checkpoint's bn, or 1 where the loader holds block scales per row
# (fused parts that cut bn-row blocks, engine/quantization/linear.py); one compiled variant serves both
LINEAR_DYNAMIC_ARGS = ["M", "scale_block_n"]
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


def fp8_act_quant(device: torch.device) -> bool:
    """True where FP8 x FP8 runs: a CUDA device (or a target compiled for ahead) of compute capability 8.9
    or more. The interpreter runs weight-only unless a test asks (fp8_linear's act_quant)."""
    if COMPILING.get() is None and device.type != "cuda":
        return False
    return device_limits(device).compute_capability >= FP8_DOT_CAPABILITY


@triton.jit
def _exact_fp8(v):
    """float32 ``v`` rounded to the nearest-even float8_e4m3fn value, saturated at +-448, still in float32
    (see the module docstring): normals keep 3 mantissa bits, subnormals (below 2**-6) are multiples of
    2**-9."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = ((v * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # 1.5 * 2**23 rounds to integers
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _fp8_bits_to_float(bits):
    """float8_e4m3fn bit patterns (uint8) to float32 in integer arithmetic: Triton has no FP8 type below
    compute capability 8.9, where the weight-only path runs. Value = (8 * [e > 0] + m) * 2**(max(e, 1) - 10);
    the NaN pattern (never in a checkpoint) reads as 480."""
    b = bits.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    mantissa = tl.where(e > 0, m + 8, m).to(tl.float32)
    power = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)  # 2**(max(e, 1) - 10)
    value = mantissa * power
    return tl.where((b & 0x80) != 0, -value, value)


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _quantize_fp8_kernel(
    x_ptr,  # [M, K]
    xq_ptr,  # float8 [M, K]
    xs_ptr,  # float32 [M, groups]
    M,
    K,
    group,
    x_stride,
    groups,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * group
    end = tl.minimum(start + group, K)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(start, end, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * x_stride + cols, mask=cols < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), _MIN_AMAX), _FP8_MAX)
    tl.store(xs_ptr + row * groups + g, scale)
    for c0 in range(start, end, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < end
        v = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
        q = _exact_fp8(tl.math.div_rn(v, scale))
        tl.store(xq_ptr + row * K + cols, q.to(xq_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=LINEAR_DYNAMIC_ARGS)
def _fp8_linear_kernel(
    x_ptr,  # [M, K]: float8 (ACT_QUANT) or the activations
    xs_ptr,  # float32 [M, groups] activation scales (ACT_QUANT)
    w_ptr,  # float8 [N, K] (ACT_QUANT), else its bytes: uint8 [N, K]
    ws_ptr,  # float32 [N] or [ceil(N / bn), ceil(K / bk)] (BLOCKWISE; bn = 1: block scales per row)
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    x_stride,
    xs_stride,
    w_stride,
    ws_stride,
    out_stride,
    scale_block_n,
    scale_block_k,
    ACT_QUANT: tl.constexpr,
    BLOCKWISE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * x_stride
    w_cols = w_ptr + cols[None, :].to(tl.int64) * w_stride
    if BLOCKWISE:  # BLOCK_K divides bk: one scale per column per step
        ws_cols = ws_ptr + (cols // scale_block_n).to(tl.int64) * ws_stride
    else:
        col_scale = tl.load(ws_ptr + cols, mask=col_ok, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [K, N]
        if BLOCKWISE:
            kb = k0 // scale_block_k
            step_scale = tl.load(ws_cols + kb, mask=col_ok, other=0.0)
        if ACT_QUANT:
            # FP8 x FP8 in float32; Hopper's FP8 MMA sums with fewer bits, so promote after every step
            part = tl.dot(xt, wt, max_num_imprecise_acc=BLOCK_K)
            if BLOCKWISE:
                row_scale = tl.load(xs_ptr + rows.to(tl.int64) * xs_stride + kb, mask=row_ok, other=0.0)
                acc += part * row_scale[:, None] * step_scale[None, :]
            else:
                acc += part
        else:
            if BLOCKWISE:
                w = _fp8_bits_to_float(wt) * step_scale[None, :]
            else:
                w = _fp8_bits_to_float(wt) * col_scale[None, :]
            w = w.to(x_ptr.dtype.element_ty)
            if UPCAST:  # float32 operands (or bfloat16 under the interpreter, where its dot is unreliable)
                acc += tl.dot(xt.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xt, w)
    if ACT_QUANT and not BLOCKWISE:
        row_scale = tl.load(xs_ptr + rows.to(tl.int64) * xs_stride, mask=row_ok, other=0.0)
        acc = acc * row_scale[:, None] * col_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def quantize_fp8(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [M, K], float32 [M, ceil(K / group)]): x quantized per token (per token and ``group``
    columns) on the device; the twin is quant_reference.quantize_fp8_per_token."""
    check_launchable(x, "x")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    g = k if group is None else group
    groups = -(-k // g) if g else 0
    xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    xs = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0 or groups == 0:
        return xq, xs
    config = fp8_act_quant_config(device_limits(x.device), g)
    launch(
        _quantize_fp8_kernel,
        (m, groups),
        x,
        xq,
        xs,
        m,
        k,
        g,
        x.stride(0),
        groups,
        BLOCK=config.block,
        num_warps=config.num_warps,
        shared_memory_bound=config.shared_memory,
    )
    return xq, xs


def _check_fp8(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """Shapes and dtypes against the canonical FP8 layout; returns the scales as the kernel reads them."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be [M, K] of {DTYPES}, got {tuple(x.shape)} {x.dtype}")
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or k != x.shape[1] or not weight.is_contiguous():
        raise ValueError(
            f"weight must be a contiguous float8_e4m3fn [N, {x.shape[1]}], got {tuple(weight.shape)} "
            f"{weight.dtype}"
        )
    scale = weight_scale.float()
    if block is not None:
        bn, bk = block
        want = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) != want or bk < DOT_MIN or bk & (bk - 1):
            raise ValueError(
                f"block-wise weight_scale must be [{want[0]}, {want[1]}] for {block} blocks (bk a power of "
                f"two >= {DOT_MIN}), got {tuple(scale.shape)}"
            )
        return scale.contiguous()
    if scale.numel() == 1:  # per tensor, not yet expanded per row by the loader
        return scale.reshape(1).expand(n).contiguous()
    if scale.numel() != n:
        raise ValueError(f"weight_scale must be [1], [{n}] or block-wise, got {tuple(weight_scale.shape)}")
    return scale.reshape(n).contiguous()


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
    act_quant: bool | None = None,
) -> torch.Tensor:
    """x [M, K] @ (weight * scale).T (+ bias) -> [M, N] in x's dtype. ``act_quant`` None: as
    `fp8_act_quant` says for x's device (FP8 x FP8 from compute capability 8.9); True or False forces a
    path (True on a CUDA device below 8.9 is refused)."""
    check_launchable(weight, "weight")
    scale = _check_fp8(x, weight, weight_scale, block)
    if act_quant is None:
        act_quant = fp8_act_quant(x.device)
    elif act_quant and x.device.type == "cuda" and not fp8_act_quant(x.device):
        major, minor = device_limits(x.device).compute_capability
        raise ValueError(f"FP8 x FP8 needs compute capability 8.9 or more; this GPU has {major}.{minor}")
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    limits = device_limits(x.device)
    config = quant_linear_config(limits, dtype_name(x.dtype), "fp8" if act_quant else "fp8_weight_only", m)
    block_k = config.block_k
    if block is not None:
        block_k = min(block_k, block[1])  # one scale per column per step
    if act_quant:
        xq, xs = quantize_fp8(x, block[1] if block is not None else None)
    else:
        xq, xs = (x if x.stride(1) == 1 else x.contiguous()), scale
    bn, bk = block if block is not None else (1, 1)
    launch(
        _fp8_linear_kernel,
        (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n)),
        xq,
        xs,
        weight if act_quant else weight.view(torch.uint8),
        scale,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        xq.stride(0),
        xs.stride(0),
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        bn,
        bk,
        ACT_QUANT=act_quant,
        BLOCKWISE=block is not None,
        HAS_BIAS=bias is not None,
        UPCAST=not act_quant and _upcast(x.dtype),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        shared_memory_bound=config.shared_memory,
    )
    return out


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())
