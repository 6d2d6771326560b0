"""Rotating attention-sink keys to follow the window (the device side of RotateBlock ops).

Keys are stored already rotated by rotary embeddings at the position they were written at, and positions
go on counting past evicted tokens, so the window's keys never change. The sinks must look as far from the
window as they were when written: after ``d`` evicted tokens their keys are those of position ``p + d``.
Rotations compose (R(p) then R(d) is R(p + d)), so each eviction writes R(d) applied to the sinks' *written*
keys into the copies the block table uses: one rotation and one rounding to the cache dtype per key,
whatever the number of evictions (rotating the previous copy again would compound the rounding).
"""

from __future__ import annotations

import math

import torch
from pagoda.kernels.reference import is_fp8, quantize_int8, quantize_to_cache_dtype


def rotate_keys_(
    kv: torch.Tensor,
    scales: torch.Tensor | None,
    src_ids: list[int],
    dst_ids: list[int],
    deltas: list[int],
    inv_freq: torch.Tensor,
) -> None:
    """Write into K of ``dst_ids`` the K of ``src_ids`` rotated by ``deltas`` positions (rotate-half layout,
    like the model); V is not touched.

    kv: [2, num_blocks, block_size, heads, head_dim] of one layer; scales: INT8 caches' per-token scales
    [2, num_blocks, block_size, heads] (keys are dequantized, rotated and quantized again), else None.
    """
    if not dst_ids:
        return
    dev = kv.device
    src = torch.tensor(src_ids, device=dev)
    dst = torch.tensor(dst_ids, device=dev)
    # Angles in float64 and reduced modulo 2 pi: a delta of a long stream times the fastest frequency would
    # lose its fraction in float32.
    angle = torch.tensor(deltas, dtype=torch.float64)[:, None] * inv_freq.double().cpu()[None, :]
    angle = torch.remainder(angle, 2 * math.pi).to(device=dev, dtype=torch.float32)
    cos = torch.cat((angle.cos(), angle.cos()), -1)[:, None, None, :]  # [n, 1, 1, D]
    sin = torch.cat((angle.sin(), angle.sin()), -1)[:, None, None, :]
    fp8 = is_fp8(kv.dtype)
    # FP8 has no CPU index_select/index_copy_: move its bytes through a uint8 view.
    keys = kv[0].view(torch.uint8) if fp8 else kv[0]
    picked = keys.index_select(0, src)
    k = (picked.view(kv.dtype) if fp8 else picked).float()  # [n, bs, H, D]
    if scales is not None:
        k = k * scales[0].index_select(0, src).unsqueeze(-1)
    rot = 2 * inv_freq.numel()  # the rotated dims: partial rotary (Phi-4-mini) leaves the rest of a head
    half = rot // 2
    r = k[..., :rot]
    rotated = r * cos + torch.cat((-r[..., half:], r[..., :half]), -1) * sin
    if rot < k.shape[-1]:
        rotated = torch.cat((rotated, k[..., rot:]), -1)
    if scales is None:
        # FP8 caches hold values already divided by the layer's scale: store them back saturated (a plain
        # cast turns a rotated component past the format's range into NaN).
        out = quantize_to_cache_dtype(rotated, kv.dtype, 1.0)
        keys.index_copy_(0, dst, out.view(torch.uint8) if fp8 else out)
        return
    q, new_scales = quantize_int8(rotated)  # the cache write's own rounding
    kv[0].index_copy_(0, dst, q)
    scales[0].index_copy_(0, dst, new_scales.to(scales.dtype))
