"""Mixture-of-experts experts in grouped GEMMs over expert-sorted tokens (the GPU path of the MoE layer).

Each token chooses k experts, so a step has S = T * k (token, expert) slots. The slots are sorted by expert
(stably, with torch ops and no host synchronisation) and cut into tiles of BLOCK_M slots that never straddle
two experts; one program computes a tile's rows against its expert's matrix, so each expert's weights are
read once per tile of its own tokens, and an expert that no token chose costs nothing. The tile table is
sized for the worst case (cdiv(S, BLOCK_M) + E tiles); the tiles past the real ones exit at once, so the
grid depends on the shapes only (CUDA graphs can capture it).

`fused_experts` runs gate/up as one grouped GEMM (gathering each slot's token row), silu-and-mul as the
element-wise kernel, then down as a second grouped GEMM that also scales each row by its routing weight;
the k rows of a token are summed in float32 and rounded once. Twins: `moe_reference.grouped_gemm_ref` and
`moe_reference.fused_experts_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from pagoda.kernels.launch_config import DOT_MIN, SCRATCH_SHARED_MEMORY, DeviceLimits, element_bytes
from pagoda.kernels.runtime import check_launchable, device_limits, dtype_name, interpreting, launch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of the grouped GEMM: slots per tile (M), output columns (N), reduction step (K)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    shared_memory: int = 0


MOE_TILES = ((64, 128, 64), (64, 64, 64), (32, 64, 32), (16, 32, 32), (16, 16, 16))
MOE_STAGES = 2


def fused_moe_config(limits: DeviceLimits, dtype: str) -> MoEConfig:
    """The first tile whose two stages of operands fit the device's shared memory per block (the
    interpreter: tl.dot's least tile, so tests cover several tiles per expert)."""
    if limits.interpreter:
        return MoEConfig(DOT_MIN, DOT_MIN, DOT_MIN, 4, 1)
    elem = element_bytes(dtype)
    for m, n, k in MOE_TILES:
        smem = MOE_STAGES * (m * k + k * n) * elem + SCRATCH_SHARED_MEMORY
        if smem <= limits.shared_memory_per_block:
            return MoEConfig(m, n, k, 4, MOE_STAGES, smem)
    major, minor = limits.compute_capability
    raise ValueError(
        f"no fused MoE tile fits {limits.shared_memory_per_block} B of shared memory per block (compute "
        f"capability {major}.{minor})"
    )


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [rows of A, K]
    a_row_ptr,  # [S] int64: the row of A of each sorted slot (GATHER), else slot i reads row i
    w_ptr,  # [E, N, K]
    out_ptr,  # [S, N]: sorted slot order
    scale_ptr,  # [S] float32 routing weight of each sorted slot (SCALE)
    tile_expert_ptr,  # [tiles] int32: the tile's expert, -1 past the real tiles
    tile_start_ptr,  # [tiles] int32: its first sorted slot
    tile_end_ptr,  # [tiles] int32: one past its expert's last slot
    N,
    K,
    a_stride,
    out_stride,
    w_stride_e,
    w_stride_n,
    GATHER: tl.constexpr,
    SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    slots = start + tl.arange(0, BLOCK_M)
    slot_ok = slots < end
    if GATHER:
        rows = tl.load(a_row_ptr + slots, mask=slot_ok, other=0).to(tl.int64)
    else:
        rows = slots.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    a_rows = a_ptr + rows[:, None] * a_stride
    w_cols = w_ptr + expert.to(tl.int64) * w_stride_e + cols[None, :].to(tl.int64) * w_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        at = tl.load(a_rows + ks[None, :], mask=slot_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [K, N]
        if UPCAST:  # float32 operands (or bfloat16 under the interpreter, where its dot is unreliable)
            acc += tl.dot(at.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(at, wt)
    if SCALE:
        acc *= tl.load(scale_ptr + slots, mask=slot_ok, other=0.0)[:, None]
    out = out_ptr + slots[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=slot_ok[:, None] & col_ok[None, :])


@dataclass
class ExpertTiles:
    """Slots sorted by expert and the tile table over them (see the module docstring)."""

    order: torch.Tensor  # [S] int64: the slot (t * k + j) at each sorted position
    tile_expert: torch.Tensor  # [tiles] int32 (-1: no tile)
    tile_start: torch.Tensor  # [tiles] int32
    tile_end: torch.Tensor  # [tiles] int32


def expert_tiles(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertTiles:
    """Sort the slots of ``ids`` [T, k] by expert and cut each expert's run into tiles of ``block_m``."""
    flat = ids.reshape(-1)
    slots = flat.numel()
    order = torch.argsort(flat, stable=True)
    # not bincount: on CUDA it reads the largest id back to the host, which a captured graph cannot do
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0)
    tiles_of = (counts + block_m - 1) // block_m
    tiles_end = tiles_of.cumsum(0)
    tile = torch.arange(triton.cdiv(slots, block_m) + num_experts, device=flat.device)
    expert = torch.searchsorted(tiles_end, tile, right=True)  # num_experts past the real tiles
    real = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    start = ends[e] - counts[e] + (tile - (tiles_end[e] - tiles_of[e])) * block_m
    return ExpertTiles(
        order,
        torch.where(real, e, -1).to(torch.int32),
        start.to(torch.int32),
        ends[e].to(torch.int32),
    )


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    tiles: ExpertTiles,
    a_rows: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[S, N]: sorted slot i is row ``a_rows[i]`` of ``a`` (row i without a_rows) times its tile's expert's
    ``w`` [E, N, K] transposed, times ``scale[i]`` (float32) where given."""
    check_launchable(a, "a")
    if a.dtype not in DTYPES or w.dtype != a.dtype:
        raise ValueError(f"a is {a.dtype} and w {w.dtype}; the grouped GEMM takes one of {DTYPES} for both")
    if w.dim() != 3 or w.shape[2] != a.shape[1] or w.stride(2) != 1 or a.stride(1) != 1:
        raise ValueError(f"w {tuple(w.shape)} must be [experts, N, {a.shape[1]}] with adjacent K elements")
    slots = tiles.order.numel()
    n, k = w.shape[1], w.shape[2]
    out = torch.empty((slots, n), dtype=out_dtype or a.dtype, device=a.device)
    if slots == 0 or n == 0:
        return out
    config = fused_moe_config(device_limits(a.device), dtype_name(a.dtype))
    launch(
        _moe_gemm_kernel,
        (tiles.tile_expert.numel(), triton.cdiv(n, config.block_n)),
        a,
        a_rows if a_rows is not None else tiles.order,
        w,
        out,
        scale if scale is not None else out,
        tiles.tile_expert,
        tiles.tile_start,
        tiles.tile_end,
        n,
        k,
        a.stride(0),
        out.stride(0),
        w.stride(0),
        w.stride(1),
        GATHER=a_rows is not None,
        SCALE=scale is not None,
        UPCAST=_upcast(a.dtype),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        shared_memory_bound=config.shared_memory,
    )
    return out


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum over a token's k experts of weight * down(silu(gate(x)) * up(x)): x [T, H], w13 [E, 2I, H] (gate
    rows then up rows), w2 [E, H, I], weights [T, k] (float32), ids [T, k] -> [T, H] in x's dtype."""
    from pagoda.kernels.activation import silu_mul

    t, top_k = ids.shape
    if t == 0:
        return torch.zeros_like(x)
    config = fused_moe_config(device_limits(x.device), dtype_name(x.dtype))
    tiles = expert_tiles(ids, w13.shape[0], config.block_m)
    token_of_slot = tiles.order // top_k
    gate_up = grouped_gemm(x, w13, tiles, a_rows=token_of_slot)
    act = silu_mul(gate_up)
    scale = weights.reshape(-1).float()[tiles.order]
    y = grouped_gemm(act, w2, tiles, scale=scale, out_dtype=torch.float32)  # [S, H] in sorted order
    per_slot = torch.empty_like(y)
    per_slot[tiles.order] = y
    return per_slot.view(t, top_k, -1).sum(dim=1).to(x.dtype)
