"""GGUF's quantized blocks: the float64 reference against the gguf package's decoder, and the C product and
decoder of kernels/cpu/quant_gguf.c against the reference on every library variant this CPU runs."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from pagoda.kernels import gguf_reference as ref
from pagoda_testkit.native import (
    cpu_variant,  # noqa: F401 (fixture: each CPU kernel variant)
)
from pagoda_testkit.native import gguf_product as _product

TYPES = sorted(ref.BLOCKS)
EPS32 = 2.0**-24  # float32's unit roundoff


def random_blocks(ggml_type: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Valid blocks of every type: random bytes with each float16 scale set to a finite value of a realistic
    size (the quantized values and sub-block scales are any bit pattern, as the format allows)."""
    rng = np.random.default_rng(seed)
    qk, nbytes = ref.BLOCKS[ggml_type]
    nb = n * k // qk
    b = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)

    def scale(offset: int, lo: float, hi: float) -> None:
        b[:, offset : offset + 2] = rng.uniform(lo, hi, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)

    if ggml_type in (ref.Q8_0, ref.Q4_0, ref.Q5_0):
        scale(0, -0.05, 0.05)
    elif ggml_type == ref.Q4_1:
        scale(0, 0.0, 0.01)
        scale(2, -0.08, 0.0)
    elif ggml_type == ref.Q4_K:
        scale(0, 0.0, 0.002)
        scale(2, 0.0, 0.002)
    else:  # Q6_K
        scale(208, -0.002, 0.002)
    return torch.from_numpy(b.reshape(n, -1))


def gguf_float32(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    return torch.from_numpy(
        np.asarray(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(ggml_type)), np.float32)
    )


@pytest.mark.parametrize("ggml_type", TYPES, ids=[ref.NAMES[t] for t in TYPES])
def test_reference_matches_the_gguf_package(ggml_type):
    """The float64 decoder agrees with gguf's float32 one to float32's rounding of each weight."""
    k = 512
    blocks = random_blocks(ggml_type, 7, k)
    want = gguf_float32(blocks, ggml_type).double()
    got = ref.dequantize_gguf(blocks, ggml_type, k)
    assert got.shape == (7, k)
    assert torch.all((got - want).abs() <= got.abs() * EPS32), ref.NAMES[ggml_type]


@pytest.mark.parametrize(
    "ggml_type", [ref.Q8_0, ref.Q4_0, ref.Q4_1, ref.Q5_0], ids=["Q8_0", "Q4_0", "Q4_1", "Q5_0"]
)
def test_reference_of_blocks_the_gguf_package_quantized(ggml_type):
    """Round trip through gguf's own quantizer: the reference is within a quantization step of the data."""
    torch.manual_seed(0)
    w = torch.randn(5, 256)
    blocks = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(ggml_type)))
    got = ref.dequantize_gguf(blocks, ggml_type, 256)
    assert torch.equal(got.float(), gguf_float32(blocks, ggml_type))
    step = (w.reshape(-1, 32).amax(1) - w.reshape(-1, 32).amin(1)) / (15 if ggml_type != ref.Q8_0 else 127)
    err = (got.float() - w).reshape(-1, 32).abs().amax(1)
    assert torch.all(err <= step + 1e-6)


def test_reference_refuses_what_it_does_not_hold():
    with pytest.raises(ValueError, match="multiples of 256"):
        ref.row_bytes(ref.Q4_K, 576)
    with pytest.raises(ValueError, match="no GGUF block layout"):
        ref.row_bytes(10, 256)  # Q2_K
    with pytest.raises(ValueError, match="uint8"):
        ref.dequantize_gguf(torch.zeros(2, 20, dtype=torch.int8), ref.Q4_1, 32)


@pytest.mark.parametrize("ggml_type", TYPES, ids=[ref.NAMES[t] for t in TYPES])
@pytest.mark.parametrize("m", [1, 3, 17, 70, 130])
def test_product_on_every_variant(ggml_type, m, cpu_variant):  # noqa: F811
    """y = x W^T over the blocks, decode (M <= 8) and prefill (chunked; k-major panels from 128 rows) paths, an odd N (a thread's share
    and the tiles end mid-way), against the float64 reference: each output within the float32 summation
    bound of K terms, (K + 2) u sum |x||w| (the weight's own rounding to float32 included)."""
    qk = ref.BLOCKS[ggml_type][0]
    k, n = (2 * qk if qk == 256 else 5 * qk), 37
    blocks = random_blocks(ggml_type, n, k, seed=m)
    torch.manual_seed(m)
    x_wide = torch.randn(m, k + 16)
    x = x_wide[:, 8 : 8 + k]  # a row stride longer than K
    w = ref.dequantize_gguf(blocks, ggml_type, k)
    got = _product(cpu_variant.lib, x, blocks, ggml_type)
    want = x.double() @ w.T
    bound = (k + 2) * EPS32 * (x.double().abs() @ w.abs().T)
    assert torch.all((got.double() - want).abs() <= bound), (got.double() - want).abs().div(bound).max()


@pytest.mark.parametrize("ggml_type", TYPES, ids=[ref.NAMES[t] for t in TYPES])
def test_dequantize_is_the_gguf_packages_float32(ggml_type, cpu_variant):  # noqa: F811
    """The C decoder gives gguf's float32 weights bit for bit (the dequantized model's own weights)."""
    k = 512
    blocks = random_blocks(ggml_type, 33, k, seed=3)
    out = torch.empty(33, k)
    rc = cpu_variant.lib.pagoda_gguf_dequantize(
        blocks.data_ptr(), 33, k, blocks.stride(0), ggml_type, out.data_ptr(), out.stride(0), 2
    )
    assert rc == 0 and torch.equal(out, gguf_float32(blocks, ggml_type))


def test_product_refuses_unknown_types_and_ragged_rows(cpu_variant):  # noqa: F811
    lib, x, y = cpu_variant.lib, torch.randn(1, 64), torch.empty(1, 4)
    blocks = random_blocks(ref.Q4_1, 4, 64)
    args = (x.data_ptr(), 1, 64, 64, blocks.data_ptr(), 4, blocks.stride(0))
    assert lib.pagoda_gguf_linear(*args, 10, y.data_ptr(), 4, 1) == 1  # Q2_K
    assert (
        lib.pagoda_gguf_linear(
            x.data_ptr(), 1, 48, 64, blocks.data_ptr(), 4, 40, ref.Q4_1, y.data_ptr(), 4, 1
        )
        == 2
    )
    assert (
        lib.pagoda_gguf_linear(
            x.data_ptr(), 1, 64, 64, blocks.data_ptr(), 4, 39, ref.Q4_1, y.data_ptr(), 4, 1
        )
        == 2
    )
