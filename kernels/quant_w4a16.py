"""W4A16: a linear layer whose weight is stored as 4-bit integers, dequantized in the tile (the GPU path).

Each program computes a tile of the output [M, N] for x [M, K] (16-bit activations; float32 too, for the
interpreter tests) against the canonical INT4 layout (kernels/quant_reference.py): per reduction step of
BLOCK_K columns it loads the weight's [BLOCK_K / 2, BLOCK_N] bytes once (adjacent in memory along K, so
the loads vectorise), splits each into its low nibble (an even column of K) and high nibble (the odd
column), subtracts the group's zero point, multiplies by the group's scale in float32, rounds to the
activations' dtype and feeds two tl.dot (x's even columns times the low nibbles, odd times high; x's tile
is loaded whole and split in registers) with float32 accumulation: no interleaving of the nibbles. A step inside one
group (GROUP_TILES: the group is a multiple of BLOCK_K, or per channel) reads one scale and zero per column;
otherwise each element reads its own group's. Nothing is dequantized to memory: the weight is read as
half a byte per element, which is what makes a decode step (M of a few rows) cheaper than 16-bit.
Twin: `quant_reference.w4a16_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagoda.kernels.launch_config import DOT_MIN, quant_linear_config
from pagoda.kernels.quant_reference import group_count
from pagoda.kernels.runtime import check_launchable, device_limits, dtype_name, interpreting, launch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DYNAMIC_ARGS = ["M"]  # the step's rows; every other size is the layer's


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:  # float32 operands (or bfloat16 under the interpreter, where its dot is unreliable)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _dequantize(q, zero, scale, S_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr):
    """(q - zero) * scale in float32, rounded to the scales' dtype (as the twin holds the weight), then to x's."""
    return ((q.to(tl.float32) - zero) * scale).to(S_DTYPE).to(X_DTYPE)


@triton.jit(do_not_specialize=DYNAMIC_ARGS)
def _w4a16_kernel(
    x_ptr,  # [M, K]
    qw_ptr,  # uint8 [N, ceil(K / 2)]
    s_ptr,  # [N, groups] scales
    z_ptr,  # uint8 [N, groups] zero points
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    group_size,
    x_stride,
    qw_stride,
    s_stride,
    out_stride,
    HAS_BIAS: tl.constexpr,
    GROUP_TILES: tl.constexpr,
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
    qw_cols = qw_ptr + cols[None, :].to(tl.int64) * qw_stride
    s_cols = s_ptr + cols[None, :].to(tl.int64) * s_stride
    z_cols = z_ptr + cols[None, :].to(tl.int64) * s_stride
    s_dtype = s_ptr.dtype.element_ty
    x_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # a step's bytes [BLOCK_K / 2, BLOCK_N], read once: low nibbles are the even columns of K, high
        # nibbles the odd ones, each multiplied by x's even or odd columns (two dots, no interleaving)
        pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        even = 2 * pairs
        odd = even + 1
        even_ok = even < K
        odd_ok = odd < K
        ks = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(xt, (BLOCK_M, BLOCK_K // 2, 2)))  # columns 2j and 2j + 1
        byte_ok = even_ok[:, None] & col_ok[None, :]
        packed = tl.load(qw_cols + pairs[:, None], mask=byte_ok, other=0).to(tl.int32)
        if GROUP_TILES:  # the whole step lies in one group
            g = k0 // group_size
            scale = tl.load(s_cols + g, mask=col_ok[None, :], other=0.0).to(tl.float32)
            zero = tl.load(z_cols + g, mask=col_ok[None, :], other=0).to(tl.float32)
            w_even = _dequantize(packed & 0xF, zero, scale, s_dtype, x_dtype)
            w_odd = _dequantize(packed >> 4, zero, scale, s_dtype, x_dtype)
        else:  # each element reads its own group's scale and zero point
            odd_w_ok = odd_ok[:, None] & col_ok[None, :]
            g_even = (even // group_size)[:, None]
            g_odd = (odd // group_size)[:, None]
            scale = tl.load(s_cols + g_even, mask=byte_ok, other=0.0).to(tl.float32)
            zero = tl.load(z_cols + g_even, mask=byte_ok, other=0).to(tl.float32)
            w_even = _dequantize(packed & 0xF, zero, scale, s_dtype, x_dtype)
            scale = tl.load(s_cols + g_odd, mask=odd_w_ok, other=0.0).to(tl.float32)
            zero = tl.load(z_cols + g_odd, mask=odd_w_ok, other=0).to(tl.float32)
            w_odd = _dequantize(packed >> 4, zero, scale, s_dtype, x_dtype)
        acc += _dot(x_even, w_even, UPCAST)
        acc += _dot(x_odd, w_odd, UPCAST)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def reduction_step(block_k: int, group_size: int, in_features: int) -> tuple[int, bool]:
    """(BLOCK_K, GROUP_TILES): a group that is a power of two below the configured step (and at least
    2 x 16 columns: each step's two dots take half of it) shortens the step to one group, so each step reads
    one scale per column."""
    block_k = max(block_k, 2 * DOT_MIN)
    if group_size >= in_features or group_size % block_k == 0:
        return block_k, True
    if group_size >= 2 * DOT_MIN and group_size & (group_size - 1) == 0 and group_size < block_k:
        return group_size, True
    return block_k, False


def check_int4(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> int:
    """Shapes and dtypes of the canonical INT4 layout against x; returns the group size (K when per channel)."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be [M, K] of {DTYPES}, got {tuple(x.shape)} {x.dtype}")
    k = x.shape[1]
    g = k if group_size <= 0 else group_size
    n = qweight.shape[0]
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != (n, (k + 1) // 2):
        raise ValueError(
            f"qweight must be uint8 [N, {(k + 1) // 2}], got {tuple(qweight.shape)} {qweight.dtype}"
        )
    groups = group_count(k, g)
    if tuple(scales.shape) != (n, groups) or tuple(zeros.shape) != (n, groups) or zeros.dtype != torch.uint8:
        raise ValueError(
            f"scales and zeros must be [{n}, {groups}] (zeros uint8) for K {k} in groups of {g}, got "
            f"{tuple(scales.shape)} and {tuple(zeros.shape)} {zeros.dtype}"
        )
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise ValueError("qweight, scales and zeros must be contiguous")
    return g


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, N] in x's dtype, W in the canonical INT4 layout (group_size <= 0: per
    output channel)."""
    check_launchable(qweight, "qweight")
    g = check_int4(x, qweight, scales, zeros, group_size)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    config = quant_linear_config(device_limits(x.device), dtype_name(x.dtype), "w4a16", m)
    block_k, group_tiles = reduction_step(config.block_k, g, k)
    launch(
        _w4a16_kernel,
        (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n)),
        x,
        qweight,
        scales,
        zeros,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        g,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        GROUP_TILES=group_tiles,
        UPCAST=_upcast(x.dtype),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        shared_memory_bound=config.shared_memory,
    )
    return out
