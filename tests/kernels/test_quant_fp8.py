"""The FP8 linear kernels (Triton, under the interpreter here) against their torch twins on fresh random
inputs: per-tensor, per-channel, 128 x 128 block-wise and 1 x 128 (block scales held per row: fused parts
that cut the checkpoint's blocks) weight scales, both paths (FP8 x FP8 with per-token
activation scales, and weight-only), decode to prefill rows, N and K that no tile or block divides."""

from __future__ import annotations

import os

import pytest
import torch
from pagoda.kernels.aot import recording_for
from pagoda.kernels.launch_config import DeviceLimits, QuantLinearConfig
from pagoda.kernels.quant_fp8 import fp8_act_quant, fp8_linear, quantize_fp8
from pagoda.kernels.quant_reference import fp8_reference, quantize_fp8_per_token


def _needs_fp8_dot(act_quant: bool) -> None:
    """Compiled on a GPU (PAGODA_KERNEL_TESTS=cuda), FP8 x FP8 needs compute capability 8.9: Triton has no
    FP8 type below it (the interpreter runs both paths anywhere)."""
    if act_quant and os.environ.get("PAGODA_KERNEL_TESTS", "").strip().lower() == "cuda":
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("FP8 x FP8 needs a GPU of compute capability 8.9 or more")


def _case(m, n, k, kind, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 80).clamp(-448, 448).to(torch.float8_e4m3fn)
    block = {"block": (128, 128), "rows": (1, 128)}.get(kind)
    if kind == "tensor":
        scale = torch.rand(1, generator=g) * 0.01 + 1e-3
    elif kind == "channel":
        scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    else:
        scale = torch.rand(-(-n // block[0]), -(-k // 128), generator=g) * 0.01 + 1e-3
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, scale, block, b


def _tol(dtype, out):
    scale = max(out.abs().max().item(), 1.0)
    if dtype == torch.float32:
        return {"atol": 1e-5 * scale, "rtol": 1e-5}
    return {"atol": (8e-3 if dtype == torch.bfloat16 else 2e-3) * scale, "rtol": 1e-2}


@pytest.mark.parametrize("act_quant", [False, True], ids=["weight_only", "fp8xfp8"])
@pytest.mark.parametrize(
    ("m", "n", "k", "kind", "dtype"),
    [
        (1, 48, 96, "tensor", torch.float32),  # a decode row
        (1, 40, 144, "channel", torch.bfloat16),
        (6, 33, 130, "channel", torch.float16),
        (3, 150, 272, "block", torch.float32),  # N and K cut partial 128 x 128 blocks
        (20, 130, 256, "block", torch.bfloat16),  # several row tiles
        (3, 150, 272, "rows", torch.float32),  # block scales per row
        (20, 130, 256, "rows", torch.bfloat16),
    ],
)
def test_fp8_linear_matches_twin(m, n, k, kind, dtype, act_quant):
    _needs_fp8_dot(act_quant)
    x, w, scale, block, bias = _case(m, n, k, kind, dtype, seed=m * 1000 + n + k)
    got = fp8_linear(x, w, scale, block, bias, act_quant=act_quant)
    want = fp8_reference(x, w, scale, block, bias, act_quant=act_quant)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype, want))


def test_the_two_paths_differ_by_the_activations_rounding():
    _needs_fp8_dot(True)
    x, w, scale, block, bias = _case(4, 64, 256, "channel", torch.float32, seed=3)
    weight_only = fp8_linear(x, w, scale, block, bias, act_quant=False)
    fp8 = fp8_linear(x, w, scale, block, bias, act_quant=True)
    err = (fp8 - weight_only).norm() / weight_only.norm()
    assert 1e-4 < err < 0.05, err


def test_the_activation_quantizer_is_the_twin_bit_for_bit():
    """Rows with a zero row, tiny (subnormal FP8) values and values that round up across a power of two
    (Triton's interpreter casts 125.3 to 64 unless the kernel rounds first)."""
    _needs_fp8_dot(True)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 300, generator=g) * torch.tensor([1.0, 1e-3, 50.0, 1.0, 7.0])[:, None]
    x[3] = 0.0
    x[4, :4] = torch.tensor([125.3, -125.7, 250.9, 448.0])
    for group in (None, 128):
        q, s = quantize_fp8(x, group)
        rq, rs = quantize_fp8_per_token(x, group)
        assert torch.equal(s, rs)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), group
    assert (
        quantize_fp8(x.half())[0]
        .view(torch.uint8)
        .equal(quantize_fp8_per_token(x.half())[0].view(torch.uint8))
    )


def test_per_tensor_scale_equals_its_expansion_per_row():
    _needs_fp8_dot(True)
    x, w, scale, _, bias = _case(3, 40, 64, "tensor", torch.float32, seed=4)
    for act_quant in (False, True):
        one = fp8_linear(x, w, scale, None, bias, act_quant=act_quant)
        rows = fp8_linear(x, w, scale.expand(40).clone(), None, bias, act_quant=act_quant)
        assert torch.equal(one, rows)


def test_no_rows_and_no_bias():
    _needs_fp8_dot(True)
    x, w, scale, block, _ = _case(2, 20, 64, "block", torch.float16, seed=5, bias=False)
    torch.testing.assert_close(
        fp8_linear(x, w, scale, block, act_quant=True),
        fp8_reference(x, w, scale, block, act_quant=True),
        **_tol(torch.float16, x),
    )
    assert fp8_linear(x[:0], w, scale, block, act_quant=True).shape == (0, 20)
    assert fp8_linear(x[:0], w, scale, block).shape == (0, 20)


def test_block_scales_per_row_give_each_fused_part_its_own_blocks():
    """q (1.5 blocks of rows) and k fused: the fused linear over per-row scales (each part's block rows
    expanded from its own row 0) computes each part's product on its own 128 x 128 grid."""
    _needs_fp8_dot(True)
    x, wq, sq, block, _ = _case(5, 192, 200, "block", torch.float32, seed=11, bias=False)
    _, wk, sk, _, _ = _case(5, 64, 200, "block", torch.float32, seed=12, bias=False)
    fused = torch.cat([wq, wk])
    rows = torch.cat([sq.repeat_interleave(128, 0)[:192], sk.repeat_interleave(128, 0)[:64]])
    for act_quant in (False, True):
        got = fp8_linear(x, fused, rows, (1, 128), act_quant=act_quant)
        parts = [fp8_reference(x, w, s, block, act_quant=act_quant) for w, s in ((wq, sq), (wk, sk))]
        torch.testing.assert_close(got, torch.cat(parts, dim=1), atol=1e-4, rtol=1e-5)


def test_the_gpu_tiles_match_too(monkeypatch):
    """The prefill's largest GPU tile (128 x 128, K steps of 64 inside 128-column blocks): masks only."""
    _needs_fp8_dot(True)
    from pagoda.kernels import quant_fp8

    monkeypatch.setattr(
        quant_fp8, "quant_linear_config", lambda limits, dtype, kind, m: QuantLinearConfig(128, 128, 64, 8, 1)
    )
    x, w, scale, block, bias = _case(130, 140, 300, "block", torch.float32, seed=6)
    for act_quant in (False, True):
        torch.testing.assert_close(
            fp8_linear(x, w, scale, block, bias, act_quant=act_quant),
            fp8_reference(x, w, scale, block, bias, act_quant=act_quant),
            atol=1e-4,
            rtol=1e-5,
        )


def test_the_path_follows_the_compute_capability():
    """FP8 x FP8 from 8.9 (L4, H100, B200), weight-only below (A100, T4) and on the CPU."""
    meta = torch.device("meta")
    for cc, fp8 in (((7, 5), False), ((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                    ((10, 0), True)):  # fmt: skip
        with recording_for(DeviceLimits(cc, 100 * 1024)):
            assert fp8_act_quant(meta) is fp8, cc
    assert fp8_act_quant(torch.device("cpu")) is False


def test_scales_that_do_not_fit_are_refused():
    x, w, scale, _, _ = _case(2, 40, 64, "channel", torch.float16, seed=9)
    with pytest.raises(ValueError, match="weight_scale must be"):
        fp8_linear(x, w, scale[:7])
    with pytest.raises(ValueError, match="block-wise weight_scale"):
        fp8_linear(x, w, torch.ones(2, 2), (128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, w.float(), scale)


def test_weight_only_decodes_every_fp8_value_exactly():
    """The weight-only path decodes FP8 bytes in integer arithmetic (no FP8 type below 8.9): every finite
    float8_e4m3fn value (normal, subnormal, signed zero), read through an identity product, comes out as
    torch's float32 of it."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # not the NaNs
    w = codes.view(torch.float8_e4m3fn).reshape(-1, 2)  # [127, 2]
    x = torch.eye(2)
    out = fp8_linear(x, w.contiguous(), torch.ones(w.shape[0]), act_quant=False)
    assert torch.equal(out.T, w.float())
