"""reshape_and_cache against its torch twin (interpreter)."""

import pytest
import torch
from pagoda.kernels.cache_write import reshape_and_cache
from pagoda.kernels.reference import reshape_and_cache_ref


def _inputs(num_tokens, num_kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # k and v as strided views of one fused qkv projection, the way the models produce them
    qkv = torch.randn((num_tokens, (4 + 2) * num_kv_heads, head_dim), generator=gen).to(dtype)
    k = qkv[:, 4 * num_kv_heads : 5 * num_kv_heads]
    v = qkv[:, 5 * num_kv_heads :]
    return k, v


# 96: Phi-3's head size, no power of two (the kernel pads its lanes to 128 and must not write past a head);
# 256: Gemma's, one KV head (Gemma 3 270M)
@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim"),
    [(8, 1, 64), (16, 3, 64), (32, 2, 128), (16, 2, 96), (8, 1, 256)],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_writes_exactly_the_given_slots(block_size, num_kv_heads, head_dim, dtype):
    num_blocks, num_tokens = 6, 13
    k, v = _inputs(num_tokens, num_kv_heads, head_dim, dtype, seed=block_size)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(1))[:num_tokens]
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    expected = cache.clone()
    reshape_and_cache(k, v, cache, slots)
    reshape_and_cache_ref(k, v, expected, slots)
    torch.testing.assert_close(cache, expected, equal_nan=True, atol=0, rtol=0)
    # every written slot holds real data; every other slot is untouched (still NaN)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots] = True
    flat = cache.view(2, num_blocks * block_size, -1)
    assert not torch.isnan(flat[:, written]).any()
    assert torch.isnan(flat[:, ~written]).all()


def test_negative_slots_are_padding_and_skipped():
    k, v = _inputs(4, 2, 64, torch.float16)
    cache = torch.zeros((2, 2, 8, 2, 64), dtype=torch.float16)
    slots = torch.tensor([3, -1, 9, -1])
    reshape_and_cache(k, v, cache, slots)
    flat = cache.view(2, 16, 2, 64)
    torch.testing.assert_close(flat[0, 3], k[0])
    torch.testing.assert_close(flat[1, 9], v[2])
    assert int((flat.abs().sum(dim=(2, 3)) > 0).sum()) == 4  # 2 tokens x (K and V)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_quantization_with_scale(cache_dtype):
    # the interpreter's fp32 -> fp8 cast rounds a few values differently from torch (REFERENCE.md), so
    # compare dequantized values within one FP8 step, and exactly on the GPU (bench-kernels)
    k, v = _inputs(12, 2, 64, torch.float16, seed=4)
    k = k * 40  # with scale 0.05 some values pass the e4m3 range (448) and must saturate, not turn NaN
    cache = torch.zeros((2, 4, 8, 2, 64), dtype=cache_dtype)
    expected = cache.clone()
    slots = torch.arange(3, 15)
    reshape_and_cache(k, v, cache, slots, k_scale=0.05, v_scale=0.02)
    reshape_and_cache_ref(k, v, expected, slots, k_scale=0.05, v_scale=0.02)
    got, want = cache.float(), expected.float()
    assert torch.isfinite(got).all()
    fmax = torch.finfo(cache_dtype).max
    assert got.abs().max() <= fmax and (got.abs() == fmax).any() == (want.abs() == fmax).any()
    step = 2.0 ** -(3 if cache_dtype == torch.float8_e4m3fn else 2)  # relative spacing of the format
    one_step = (got - want).abs() <= want.abs() * step + 1e-6
    carried = (got * 2 == want) | (got == want * 2)  # the interpreter's known carry-into-exponent slip
    assert (one_step | carried).all()
    assert (got == want).float().mean() > 0.95


def test_rejects_a_cache_of_the_wrong_shape():
    k, v = _inputs(2, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="kv_cache shape"):
        reshape_and_cache(k, v, torch.zeros((2, 4, 8, 3, 64), dtype=torch.float16), torch.arange(2))
