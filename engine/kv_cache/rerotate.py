"""Re-rotating cached keys after an attention-sink eviction (the device side of RotateBlock ops).

Keys are stored already rotated by rotary embeddings at the cache position they were written at. When the
blocks between the sinks and the window are freed, every window block moves down the cache by the evicted
token count; rotating its keys by the same (negative) count makes each key carry its new cache position
exactly, because rotations compose: R(p) then R(d) is R(p + d). Queries then simply use cache positions,
which never exceed sinks + window, and relative distances inside the window are what they were.
"""

from __future__ import annotations

import torch
from pagoda.kernels.reference import is_fp8, quantize_int8, quantize_to_cache_dtype


def rotate_keys_(
    kv: torch.Tensor,
    scales: torch.Tensor | None,
    block_ids: list[int],
    deltas: list[int],
    inv_freq: torch.Tensor,
) -> None:
    """Rotate K of ``block_ids`` in place by ``deltas`` positions (rotate-half layout, like the model).

    kv: [2, num_blocks, block_size, heads, head_dim] of one layer; scales: INT8 caches' per-token scales
    [2, num_blocks, block_size, heads] (keys are dequantized, rotated and quantized again), else None.
    """
    if not block_ids:
        return
    dev = kv.device
    ids = torch.tensor(block_ids, device=dev)
    angle = torch.tensor(deltas, device=dev, dtype=torch.float32)[:, None] * inv_freq.to(dev).float()[None, :]
    cos = torch.cat((angle.cos(), angle.cos()), -1)[:, None, None, :]  # [n, 1, 1, D]
    sin = torch.cat((angle.sin(), angle.sin()), -1)[:, None, None, :]
    fp8 = is_fp8(kv.dtype)
    # FP8 has no CPU index_select/index_copy_: move its bytes through a uint8 view.
    keys = kv[0].view(torch.uint8) if fp8 else kv[0]
    picked = keys.index_select(0, ids)
    k = (picked.view(kv.dtype) if fp8 else picked).float()  # [n, bs, H, D]
    if scales is not None:
        k = k * scales[0].index_select(0, ids).unsqueeze(-1)
    half = k.shape[-1] // 2
    rotated = k * cos + torch.cat((-k[..., half:], k[..., :half]), -1) * sin
    if scales is None:
        # FP8 caches hold values already divided by the layer's scale: store them back saturated (a plain
        # cast turns a rotated component past the format's range into NaN).
        out = quantize_to_cache_dtype(rotated, kv.dtype, 1.0)
        keys.index_copy_(0, ids, out.view(torch.uint8) if fp8 else out)
        return
    q, new_scales = quantize_int8(rotated)  # the cache write's own rounding
    kv[0].index_copy_(0, ids, q)
    scales[0].index_copy_(0, ids, new_scales.to(scales.dtype))
