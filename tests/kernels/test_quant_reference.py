"""The quantized linears' torch twins (kernels/quant_reference.py) against float64 computed directly from
the integers and FP8 values they were built from, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from pagoda.kernels.quant_reference import (
    FP8_MAX,
    dequantize_fp8,
    dequantize_int4,
    fp8_reference,
    pack_int4,
    quantize_fp8_per_token,
    unpack_int4,
    w4a16_reference,
)


def _int4_case(n: int, k: int, group: int, symmetric: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    gs = k if group <= 0 else group
    groups = -(-k // gs)
    q = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.full((n, groups), 8) if symmetric else torch.randint(0, 16, (n, groups), generator=g)
    scales = torch.rand(n, groups, generator=g) * 0.05 + 0.001
    return q, zeros.to(torch.uint8), scales


def _int4_float64(q, zeros, scales, group):
    """w[n, k] = (q - zero) * scale, element by element in float64."""
    n, k = q.shape
    gs = k if group <= 0 else group
    w = torch.empty((n, k), dtype=torch.float64)
    for col in range(k):
        w[:, col] = (q[:, col].double() - zeros[:, col // gs].double()) * scales[:, col // gs].double()
    return w


@pytest.mark.parametrize("k", [1, 2, 7, 64, 129])
def test_pack_int4_puts_even_columns_in_the_low_nibble(k):
    q = torch.randint(0, 16, (5, k), generator=torch.Generator().manual_seed(k))
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, (k + 1) // 2)
    assert torch.equal(packed[:, 0] & 0xF, q[:, 0].to(torch.uint8))
    if k > 1:
        assert torch.equal(packed[:, 0] >> 4, q[:, 1].to(torch.uint8))
    assert torch.equal(unpack_int4(packed, k), q.to(torch.int16))


@pytest.mark.parametrize(
    ("n", "k", "group", "symmetric"),
    [(8, 128, 32, True), (13, 192, 64, False), (7, 256, 128, False), (9, 96, -1, True), (5, 70, 32, False),
     (6, 69, 24, False)],
)  # fmt: skip
def test_dequantize_int4_matches_float64(n, k, group, symmetric):
    q, zeros, scales = _int4_case(n, k, group, symmetric, seed=n * k)
    got = dequantize_int4(pack_int4(q), scales, zeros, group, in_features=k)
    want = _int4_float64(q, zeros, scales, group)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    torch.testing.assert_close(got.double(), want, atol=1e-7, rtol=1e-6)
    # the zero point counts: symmetric weights are centred, asymmetric ones are not
    if symmetric:
        assert (want.mean() / want.abs().mean()).abs() < 0.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_w4a16_reference_matches_float64(dtype):
    n, k, group, m = 24, 160, 32, 9
    q, zeros, scales = _int4_case(n, k, group, False, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    got = w4a16_reference(x, pack_int4(q), scales.to(dtype), zeros, group, bias)
    w = _int4_float64(q, zeros, scales.to(dtype).float(), group)
    want = x.double() @ w.T + bias.double()
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else (2e-2 if dtype == torch.bfloat16 else 4e-3)
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=tol)


def _fp8_case(n: int, k: int, kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    if kind == "tensor":
        return w, torch.rand(1, generator=g) * 0.01 + 1e-3, None
    if kind == "channel":
        return w, torch.rand(n, generator=g) * 0.01 + 1e-3, None
    block = (128, 128)
    return w, torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.01 + 1e-3, block


def _scale64(scale, n, k, block):
    if block is None:
        return scale.double().reshape(-1, 1).expand(n, k)
    rows = torch.arange(n) // block[0]
    cols = torch.arange(k) // block[1]
    return scale.double()[rows][:, cols]


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_dequantize_fp8_matches_float64(kind):
    n, k = 200, 300  # neither a multiple of the 128 x 128 blocks
    w, scale, block = _fp8_case(n, k, kind, seed=11)
    got = dequantize_fp8(w, scale, block)
    torch.testing.assert_close(got.double(), w.double() * _scale64(scale, n, k, block), atol=0, rtol=1e-7)


@pytest.mark.parametrize("group", [None, 128, 48])
def test_per_token_quantization_keeps_each_value_within_half_an_fp8_step(group):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 200, generator=g) * torch.tensor([1e-3, 1, 30, 1, 1, 1])[:, None]
    x[3] = 0.0  # an all-zero row quantizes to zeros with a positive scale
    q, scale = quantize_fp8_per_token(x, group)
    gs = 200 if group is None else group
    cols = torch.arange(200) // gs
    padded = torch.nn.functional.pad(x, (0, scale.shape[1] * gs - 200)).reshape(6, -1, gs)
    amax = padded.abs().amax(dim=2).double()
    torch.testing.assert_close(scale.double()[[0, 1, 2, 4, 5]], amax[[0, 1, 2, 4, 5]] / FP8_MAX)
    assert (scale[3] > 0).all() and (q[3].float() == 0).all()
    v = x.double() / scale.double()[:, cols]
    # e4m3: 3 mantissa bits, so a normal value is off by at most 1/16 of itself; subnormals by 2**-10
    err = (q.double() - v).abs()
    assert (err <= torch.maximum(v.abs() / 16, torch.full_like(v, 2.0**-10))).all()
    assert q.float().abs().max() == FP8_MAX  # each group's largest value lands on 448


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_reference_matches_float64(kind, dtype):
    n, k, m = 150, 260, 7
    w, scale, block = _fp8_case(n, k, kind, seed=21)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    w64 = w.double() * _scale64(scale, n, k, block)
    exact = x.double() @ w64.T + bias.double()
    weight_only = fp8_reference(x, w, scale, block, bias, act_quant=False)
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    if dtype == torch.float32:
        torch.testing.assert_close(weight_only.double(), exact, atol=rel * exact.abs().max().item(), rtol=rel)
    else:  # the weight rounded to bfloat16 first, as the kernel does
        w16 = w64.to(dtype).double()
        torch.testing.assert_close(
            weight_only.double(), x.double() @ w16.T + bias.double(), atol=0.1, rtol=rel
        )
    # FP8 x FP8: exactly the product of the dequantized activations and weight, up to float32 sums
    act = fp8_reference(x, w, scale, block, bias, act_quant=True)
    xq, xs = quantize_fp8_per_token(x, block[1] if block else None)
    cols = torch.arange(k) // (block[1] if block else k)
    x64 = xq.double() * xs.double()[:, cols]
    dequantized = x64 @ w64.T + bias.double()
    atol = (1e-5 if dtype == torch.float32 else 3e-2) * dequantized.abs().max().item()
    torch.testing.assert_close(act.double(), dequantized, atol=atol, rtol=rel)
    # ... which differs from the exact product by FP8's rounding of the activations, and no more
    err = (act.double() - exact).norm() / exact.norm()
    assert 1e-4 < err < 0.05, err
