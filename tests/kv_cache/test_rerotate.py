"""Rotating attention-sink keys: the keys of a block written at position p, rotated by d into another block,
equal the keys written at p + d, in float32 and, within quantization error, in an INT8 cache with per-token
scales; the written block and every value stay as they are."""

from __future__ import annotations

import pytest
import torch
from pagoda.engine.kv_cache.rerotate import rotate_keys_
from pagoda.engine.models.layers import RotaryEmbedding, apply_rotary

BS, HEADS, DIM = 4, 2, 16


def _rotated(raw: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
    cos, sin = rope.cos_sin(positions, int(positions.max()), torch.float32)
    return apply_rotary(raw, cos, sin)


@pytest.mark.parametrize("rotary_dim", [DIM, 12])  # 12: partial rotary, the last 4 dims of a head stay
def test_rotating_by_d_equals_writing_d_positions_later(rotary_dim):
    torch.manual_seed(0)
    rope = RotaryEmbedding(rotary_dim, 10000.0, None, 512, torch.device("cpu"))
    raw = torch.randn(2 * BS, HEADS, DIM)  # two blocks of keys
    start, d = 10, 48
    kv = torch.zeros(2, 5, BS, HEADS, DIM)
    kv[0, [1, 3]] = _rotated(raw, torch.arange(start, start + 2 * BS), rope).view(2, BS, HEADS, DIM)
    kv[1] = torch.randn(5, BS, HEADS, DIM)
    before = kv.clone()
    rotate_keys_(kv, None, [1, 3], [4, 2], [d, d], rope.inv_freq)
    want = _rotated(raw, torch.arange(start + d, start + d + 2 * BS), rope).view(2, BS, HEADS, DIM)
    torch.testing.assert_close(kv[0, [4, 2]], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv[1], before[1])  # values are never rotated
    assert torch.equal(kv[0, [0, 1, 3]], before[0, [0, 1, 3]])  # the written keys and other blocks stay


def test_int8_keys_are_requantized_with_fresh_scales():
    torch.manual_seed(1)
    rope = RotaryEmbedding(DIM, 10000.0, None, 512, torch.device("cpu"))
    keys = _rotated(torch.randn(BS, HEADS, DIM), torch.arange(60, 60 + BS), rope)
    scales = torch.zeros(2, 3, BS, HEADS)
    scales[0, 2] = keys.abs().amax(-1) / 127
    kv = torch.zeros(2, 3, BS, HEADS, DIM, dtype=torch.int8)
    kv[0, 2] = (keys / scales[0, 2].unsqueeze(-1)).round().to(torch.int8)
    rotate_keys_(kv, scales, [2], [1], [32], rope.inv_freq)
    got = kv[0, 1].float() * scales[0, 1].unsqueeze(-1)
    want = apply_rotary(keys, *[t[:BS] for t in _cos_sin(rope, 32)])
    err = (got - want).abs().amax(-1) / want.abs().amax(-1)
    assert float(err.max()) < 2 / 127  # quantized twice: within two steps of the scale
    assert torch.all(scales[0, 1] > 0)


def _cos_sin(rope: RotaryEmbedding, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
    angle = delta * rope.inv_freq
    emb = torch.cat((angle, angle))
    return emb.cos().expand(BS, 1, DIM), emb.sin().expand(BS, 1, DIM)


def test_int8_requantization_rounds_like_the_cache_write():
    """Rotating by 0 re-quantizes through the cache write's own rounding: the bits come back unchanged."""
    from pagoda.kernels.reference import quantize_int8

    torch.manual_seed(2)
    q, s = quantize_int8(torch.randn(BS, HEADS, DIM) * 3)
    kv = torch.zeros(2, 1, BS, HEADS, DIM, dtype=torch.int8)
    scales = torch.zeros(2, 1, BS, HEADS)
    kv[0, 0], scales[0, 0] = q, s
    rotate_keys_(kv, scales, [0], [0], [0], torch.ones(DIM // 2))
    assert torch.equal(kv[0, 0], q)
    assert torch.equal(scales[0, 0], s)


def test_fp8_keys_near_the_top_of_the_range_saturate_instead_of_turning_nan():
    dtype = torch.float8_e4m3fn
    top = torch.finfo(dtype).max
    kv = torch.zeros(2, 1, BS, HEADS, DIM, dtype=dtype)
    kv[0, 0] = torch.full((BS, HEADS, DIM), top).to(dtype)  # rotating mixes pairs: |x| grows to sqrt(2) x
    rotate_keys_(kv, None, [0], [0], [7], torch.ones(DIM // 2))
    got = kv[0, 0].float()
    assert not torch.isnan(got).any()
    assert float(got.abs().max()) <= top
