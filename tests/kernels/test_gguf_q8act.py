"""The int8-activation GGUF product (kernels/cpu/quant_gguf_q8act.c) on every library variant this CPU runs,
AVX-512 with and without AVX512-VNNI: its activation quantizer against a torch one of the same rule, and its
product against a float64 reference of the same math (the int8-rounded activations times the decoded
weights)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from pagoda.kernels import gguf_reference as ref
from pagoda.kernels.cpu import loader
from pagoda_testkit.native import (
    cpu_variant,  # noqa: F401 (fixture: each CPU kernel variant)
    gguf_product,
)

EPS32 = 2.0**-24
TYPES = [ref.Q4_0, ref.Q4_1, ref.Q8_0]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> int8 values [M, K] and float32 scales [M, K / 32]: per 32 values d = amax / 127,
    q = round(x / d) to nearest even (as x times float32 1 / d), 0 where the block is all zero."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    return q.reshape(x.shape), d


def random_blocks(ggml_type: int, n: int, k: int, seed: int) -> torch.Tensor:
    """Random codes of every bit pattern (Q8_0's -128 included) with finite float16 scales."""
    rng = np.random.default_rng(seed)
    nbytes = ref.BLOCKS[ggml_type][1]
    b = rng.integers(0, 256, size=(n * k // 32, nbytes), dtype=np.uint8)
    d = rng.uniform(-0.05, 0.05, len(b)) if ggml_type != ref.Q4_1 else rng.uniform(0, 0.01, len(b))
    b[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if ggml_type == ref.Q4_1:
        b[:, 2:4] = rng.uniform(-0.08, 0, len(b)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(b.reshape(n, -1))


def reference(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product of the int8-rounded activations with the decoded weights, and a bound on float32's
    rounding of it: each block's terms (the integer dot, Q4_1's offset, and the code offset the vector
    variants take out again: up to 128 * |d| * |sum(xq)|), summed over K / 32 blocks."""
    k = x.shape[1]
    q, d = quantize(x)
    xq = (q.double().reshape(q.shape[0], -1, 32) * d.double()[..., None]).reshape(q.shape)
    w = ref.dequantize_gguf(blocks, ggml_type, k)
    want = xq @ w.T
    nscales = 2 if ggml_type == ref.Q4_1 else 1  # d, and Q4_1's m
    scales = blocks[:, : 2 * nscales].contiguous().numpy().view(np.float16).astype(np.float64)
    sums = q.double().reshape(q.shape[0], -1, 32).sum(-1) * d.double()  # dx * sum(xq) per block
    magnitude = xq.abs() @ w.abs().T + 128 * sums.abs().sum(-1, keepdim=True) * float(np.abs(scales).max())
    return want, magnitude * (k // 32 + 8) * EPS32


@pytest.fixture
def lib(cpu_variant):  # noqa: F811
    return cpu_variant.lib


def vnni_modes(lib) -> list[int]:
    """The AVX-512 variant runs with AVX512-VNNI where the CPU has it and without (as on a CPU that has not)."""
    has = "avx512_vnni" in loader.cpu_flags()
    assert lib.pagoda_gguf_q8_vnni(1) == (has and lib.pagoda_cpu_variant() == b"avx512")
    return [1, 0] if has and lib.pagoda_cpu_variant() == b"avx512" else [0]


def test_activation_quantizer(lib):
    """The C quantizer writes exactly the torch rule's values (ties and all-zero blocks included)."""
    torch.manual_seed(0)
    x = torch.randn(3, 96) * torch.tensor([1.0, 1e-3, 40.0])[:, None]
    x[1, :32] = 0.0
    x[2, 32:64] = torch.arange(32) - 15.5  # amax 16.5: many values land on halves of a step
    q = torch.empty(3, 96, dtype=torch.int8)
    d = torch.empty(3, 3)
    assert lib.pagoda_gguf_quantize_q8(x.data_ptr(), 3, 96, 96, q.data_ptr(), d.data_ptr()) == 0
    want_q, want_d = quantize(x)
    assert torch.equal(d, want_d)
    assert torch.equal(q, want_q)
    assert int(q.abs().max()) == 127


@pytest.mark.parametrize("ggml_type", TYPES, ids=[ref.NAMES[t] for t in TYPES])
@pytest.mark.parametrize(("m", "k"), [(1, 576), (2, 224), (3, 1536), (5, 32), (9, 576)])
def test_product_against_float64(lib, ggml_type, m, k):
    """Every row count (the four-row passes and their remainders), an odd number of blocks (AVX-512's pairs
    of blocks end on a half), and every code pattern."""
    torch.manual_seed(k + m)
    n = 37
    blocks = random_blocks(ggml_type, n, k, seed=m)
    x = torch.randn(m, k) * 3
    want, bound = reference(x, blocks, ggml_type)
    try:
        for vnni in vnni_modes(lib):
            lib.pagoda_gguf_q8_vnni(vnni)
            got = gguf_product(lib, x, blocks, ggml_type, symbol="pagoda_gguf_linear_q8")
            err = (got.double() - want).abs()
            assert torch.all(err <= bound), (vnni, float((err / bound).max()))
    finally:
        lib.pagoda_gguf_q8_vnni(1)


def test_blocks_the_gguf_package_quantized_and_strided_rows(lib):
    """Real Q4_1 / Q8_0 blocks of one weight in a wider row-stride buffer, and x with a row stride: the
    product is within int8 rounding of the exact one (the quantization error, bounded loosely)."""
    torch.manual_seed(1)
    w = torch.randn(40, 256)
    x_wide = torch.randn(2, 300)
    x = x_wide[:, :256]
    exact = x.double() @ w.double().T
    for ggml_type in (ref.Q4_1, ref.Q8_0):
        b = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(ggml_type)))
        wide = torch.zeros(40, b.shape[1] + 6, dtype=torch.uint8)
        wide[:, : b.shape[1]] = b
        want, bound = reference(x.contiguous(), b, ggml_type)
        got = gguf_product(lib, x, wide, ggml_type, symbol="pagoda_gguf_linear_q8")
        assert torch.all((got.double() - want).abs() <= bound)
        rel = float((got.double() - exact).norm() / exact.norm())
        assert rel < (0.15 if ggml_type == ref.Q4_1 else 0.02), rel


def test_refusals(lib):
    x = torch.zeros(1, 256)
    y = torch.zeros(1, 4)
    blocks = torch.zeros(4, 256 // 256 * 144, dtype=torch.uint8)
    call = lib.pagoda_gguf_linear_q8
    assert call(x.data_ptr(), 1, 256, 256, blocks.data_ptr(), 4, 144, ref.Q4_K, y.data_ptr(), 4, 1) == 1
    assert call(x.data_ptr(), 1, 48, 256, blocks.data_ptr(), 4, 144, ref.Q8_0, y.data_ptr(), 4, 1) == 2
    assert call(x.data_ptr(), 1, 256, 256, blocks.data_ptr(), 4, 100, ref.Q8_0, y.data_ptr(), 4, 1) == 2
