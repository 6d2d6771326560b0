"""The W4A16 kernel (Triton, under the interpreter here) against its torch twin on fresh random inputs:
every group size (32, 64, 128, per channel, and one that no tile divides), symmetric and asymmetric zero
points, decode (M = 1) to prefill rows, N and K that no tile divides (K odd too), an empty step."""

from __future__ import annotations

import pytest
import torch
from pagoda.kernels.launch_config import QuantLinearConfig
from pagoda.kernels.quant_reference import pack_int4, w4a16_reference
from pagoda.kernels.quant_w4a16 import reduction_step, w4a16_linear


def _case(m, n, k, group, dtype, symmetric, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    gs = k if group <= 0 else group
    groups = -(-k // gs)
    q = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.full((n, groups), 8) if symmetric else torch.randint(0, 16, (n, groups), generator=g)
    scale_dtype = torch.float16 if dtype == torch.float32 else dtype  # the compute dtype of a checkpoint
    scales = (torch.rand(n, groups, generator=g) * 0.05 + 0.002).to(scale_dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, pack_int4(q), scales, zeros.to(torch.uint8), b


def _tol(dtype, out):
    scale = max(out.abs().max().item(), 1.0)
    if dtype == torch.float32:
        return {"atol": 1e-5 * scale, "rtol": 1e-5}
    return {"atol": (8e-3 if dtype == torch.bfloat16 else 2e-3) * scale, "rtol": 1e-2}


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "dtype", "symmetric"),
    [
        (1, 48, 128, 32, torch.float32, False),  # a decode row
        (1, 33, 256, 128, torch.float16, True),
        (5, 40, 192, 64, torch.bfloat16, False),
        (17, 35, 130, 64, torch.float32, False),  # K: a partial group at the end
        (3, 19, 69, -1, torch.float16, False),  # odd K, per channel
        (9, 24, 96, 24, torch.float32, False),  # a group no tile divides: each element reads its own
        (4, 20, 64, 16, torch.float16, False),  # a group shorter than the least step (two dots of 16)
        (40, 50, 160, 32, torch.float16, True),  # several row tiles (prefill)
    ],
)
def test_w4a16_matches_twin(m, n, k, group, dtype, symmetric):
    x, qweight, scales, zeros, bias = _case(m, n, k, group, dtype, symmetric, seed=m * 1000 + n + k)
    got = w4a16_linear(x, qweight, scales, zeros, group, bias)
    want = w4a16_reference(x, qweight, scales, zeros, group, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype, want))
    # the zero points and scales are read: other zero points give another answer
    shifted = w4a16_linear(x, qweight, scales, (zeros + 1) % 16, group, bias)
    assert (shifted.float() - want.float()).abs().max() > 1e-2


def test_no_bias_and_no_rows():
    x, qweight, scales, zeros, _ = _case(6, 20, 64, 32, torch.float32, False, seed=1, bias=False)
    torch.testing.assert_close(
        w4a16_linear(x, qweight, scales, zeros, 32),
        w4a16_reference(x, qweight, scales, zeros, 32),
        atol=1e-5,
        rtol=1e-5,
    )
    assert w4a16_linear(x[:0], qweight, scales, zeros, 32).shape == (0, 20)


def test_the_gpu_tiles_match_too(monkeypatch):
    """A prefill's largest GPU tile (128 rows x 128 columns, K steps of 64 cut to the group of 32), wider than
    N here: masks and the shortened step only."""
    from pagoda.kernels import quant_w4a16

    monkeypatch.setattr(
        quant_w4a16,
        "quant_linear_config",
        lambda limits, dtype, kind, m: QuantLinearConfig(128, 128, 64, 8, 1),
    )
    x, qweight, scales, zeros, bias = _case(130, 72, 200, 32, torch.float32, False, seed=7)
    torch.testing.assert_close(
        w4a16_linear(x, qweight, scales, zeros, 32, bias),
        w4a16_reference(x, qweight, scales, zeros, 32, bias),
        atol=1e-4,
        rtol=1e-5,
    )


def test_reduction_step_keeps_one_group_per_step():
    assert reduction_step(64, 128, 4096) == (64, True)
    assert reduction_step(128, 32, 4096) == (32, True)  # shortened to the group
    assert reduction_step(256, 4096, 4096) == (256, True)  # per channel
    assert reduction_step(256, 11008, 11008) == (256, True)  # per channel, K no multiple of the step
    assert reduction_step(16, 24, 96) == (32, False)  # two dots of at least 16 columns each
    assert reduction_step(64, 16, 4096) == (64, False)


def test_layouts_that_are_not_canonical_are_refused():
    x, qweight, scales, zeros, _ = _case(2, 16, 64, 32, torch.float16, True, seed=2)
    with pytest.raises(ValueError, match="qweight must be uint8"):
        w4a16_linear(x, qweight.to(torch.int32), scales, zeros, 32)
    with pytest.raises(ValueError, match="scales and zeros must be"):
        w4a16_linear(x, qweight, scales, zeros, 64)
    with pytest.raises(ValueError, match="qweight must be uint8"):
        w4a16_linear(x[:, :32], qweight, scales, zeros, 32)
