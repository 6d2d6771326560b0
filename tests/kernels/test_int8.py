"""INT8 KV cache: per-token, per-head scales beside the blocks. Kernels against their torch twins
(interpreter), the twins against plain math, and every slot no sequence owns poisoned (NaN scales, -128
values, which quantization never produces), so a kernel that reads past a sequence fails loudly."""

import pytest
import torch
from pagoda.kernels.cache_write import reshape_and_cache
from pagoda.kernels.paged_decode import paged_decode_attention
from pagoda.kernels.paged_prefill import paged_prefill_attention
from pagoda.kernels.reference import (
    gather_sequence_kv,
    naive_dense_attention,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    quantize_int8,
    reshape_and_cache_ref,
)


def int8_case(paged, seq_lens, query_lens=None, seed=0, **kw):
    """A paged case whose cache is INT8 with its scales; unowned slots poisoned."""
    case = paged.make(seq_lens, query_lens, dtype=kw.pop("dtype", torch.float16), seed=seed, **kw)
    gen = torch.Generator().manual_seed(seed + 100)
    # per-token magnitudes that vary a lot, as real keys do (outlier tokens, quiet tokens)
    real = (
        torch.randn(case.kv_cache.shape, generator=gen)
        * torch.rand(case.kv_cache.shape[:4] + (1,), generator=gen)
        * 4
    )
    q, scales = quantize_int8(real)
    _, num_blocks, block_size, _, _ = q.shape
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for s, n in enumerate(seq_lens):
        pos = torch.arange(n)
        owned[case.block_tables[s, pos // block_size].long() * block_size + pos % block_size] = True
    q.view(2, -1, *q.shape[3:])[:, ~owned] = -128
    scales.view(2, -1, scales.shape[3])[:, ~owned] = float("nan")
    case.kv_cache = q
    return case, scales


def test_quantize_round_trip_within_half_a_step_and_zero_rows():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[2, 1] = 0.0
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (7, 3)
    torch.testing.assert_close(s, x.abs().amax(-1) * (1.0 / 127), atol=0, rtol=0)
    assert q.abs().max() == 127 and (q != -128).all()
    err = (q.float() * s[..., None] - x).abs()
    assert (err <= s[..., None] * 0.5 * (1 + 1e-6)).all()
    assert s[2, 1] == 0 and (q[2, 1] == 0).all()
    # ties go to even, as torch.round does
    q2, _ = quantize_int8(torch.tensor([[127.0, 0.5, 1.5, -2.5]]))
    assert q2.tolist() == [[127, 0, 2, -2]]


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim"), [(8, 1, 64), (16, 3, 64), (32, 2, 128), (16, 2, 96)]
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cache_write_matches_twin_and_touches_only_its_slots(block_size, num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(block_size + head_dim)
    num_blocks, num_tokens = 5, 11
    qkv = torch.randn((num_tokens, 6 * num_kv_heads, head_dim), generator=gen) * 3
    qkv[3, 4 * num_kv_heads] = 0.0  # a zero K row: scale 0, values 0
    qkv = qkv.to(dtype)
    k, v = qkv[:, 4 * num_kv_heads : 5 * num_kv_heads], qkv[:, 5 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.full(shape, -128, dtype=torch.int8)
    scales = torch.full(shape[:4], float("nan"))
    want, want_scales = cache.clone(), scales.clone()
    reshape_and_cache(k, v, cache, slots, kv_scales=scales)
    reshape_and_cache_ref(k, v, want, slots, kv_scales=want_scales)
    torch.testing.assert_close(scales, want_scales, equal_nan=True, atol=0, rtol=0)
    assert torch.equal(cache, want)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots] = True
    flat, flat_s = cache.view(2, num_blocks * block_size, -1), scales.view(2, num_blocks * block_size, -1)
    assert (flat[:, ~written] == -128).all() and torch.isnan(flat_s[:, ~written]).all()
    assert (flat[:, written] != -128).all() and not torch.isnan(flat_s[:, written]).any()
    # dequantized, the cache holds K within half a step of each row's scale
    back = flat[0, slots].view(num_tokens, num_kv_heads, head_dim).float() * flat_s[0, slots][..., None]
    assert ((back - k.float()).abs() <= flat_s[0, slots][..., None] * 0.5 + 1e-6).all()


def test_cache_write_refuses_an_int8_cache_without_scales():
    k = torch.randn(2, 1, 64)
    with pytest.raises(ValueError, match="scales"):
        reshape_and_cache(k, k, torch.zeros((2, 2, 8, 1, 64), dtype=torch.int8), torch.arange(2))
    with pytest.raises(ValueError, match="kv_scales"):
        reshape_and_cache(
            k,
            k,
            torch.zeros((2, 2, 8, 1, 64), dtype=torch.int8),
            torch.arange(2),
            kv_scales=torch.zeros(2, 2, 8),
        )


@pytest.mark.parametrize(
    ("block_size", "group", "num_splits"), [(8, 1, 1), (16, 4, 1), (16, 4, 4), (32, 8, 2)]
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_matches_twin(paged, block_size, group, num_splits, dtype):
    lens = [1, block_size, block_size + 1, 2 * block_size + 5]
    case, scales = int8_case(paged, lens, block_size=block_size, group=group, num_kv_heads=2, dtype=dtype,
                             seed=block_size + group)  # fmt: skip
    out = paged_decode_attention(
        case.q, case.kv_cache, case.block_tables, case.seq_lens, case.scale, out=paged.poisoned_like(case.q),
        kv_scales=scales, num_splits=num_splits,
    )  # fmt: skip
    ref = paged_decode_attention_ref(
        case.q, case.kv_cache, case.seq_lens, case.block_tables, case.scale, kv_scales=scales
    )
    assert not torch.isnan(ref).any()
    torch.testing.assert_close(out, ref, **paged.tolerance(dtype))


def test_decode_with_sliding_window(paged):
    case, scales = int8_case(paged, [3, 16, 33, 64], block_size=8, group=4, seed=5)
    kw = dict(kv_scales=scales, sliding_window=7)
    out = paged_decode_attention(
        case.q, case.kv_cache, case.block_tables, case.seq_lens, case.scale, out=paged.poisoned_like(case.q),
        num_splits=4, **kw,
    )  # fmt: skip
    ref = paged_decode_attention_ref(
        case.q, case.kv_cache, case.seq_lens, case.block_tables, case.scale, **kw
    )
    torch.testing.assert_close(out, ref, **paged.tolerance(case.q.dtype))


@pytest.mark.parametrize(("block_size", "group", "window"), [(8, 1, None), (16, 4, None), (8, 4, 5)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_matches_twin(paged, block_size, group, window, dtype):
    seq_lens = [21, 2 * block_size + 7, 2 * block_size, 9]
    query_lens = [21, 12, block_size, 1]
    case, scales = int8_case(paged, seq_lens, query_lens, block_size=block_size, group=group, num_kv_heads=1,
                             dtype=dtype, seed=group + block_size)  # fmt: skip
    out = paged_prefill_attention(
        case.q, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables, case.scale,
        max_query_len=max(query_lens), out=paged.poisoned_like(case.q), kv_scales=scales, sliding_window=window,
    )  # fmt: skip
    ref = paged_prefill_attention_ref(
        case.q, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables, case.scale,
        sliding_window=window, kv_scales=scales,
    )  # fmt: skip
    assert not torch.isnan(ref).any()
    torch.testing.assert_close(out, ref, **paged.tolerance(dtype))


def test_twin_is_dense_attention_over_the_dequantized_cache(paged):
    case, scales = int8_case(paged, [13, 30], [13, 5], block_size=8, group=4, dtype=torch.float32, seed=11)
    out = paged_prefill_attention_ref(
        case.q, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables, case.scale,
        kv_scales=scales,
    )  # fmt: skip
    starts = case.query_start_loc.tolist()
    table = case.block_tables
    for s, seq_len in enumerate(case.seq_lens.tolist()):
        k, v = gather_sequence_kv(case.kv_cache, table[s], seq_len, kv_scales=scales)
        pos = 9 if seq_len > 9 else seq_len - 1  # one token by hand: int8 value x its own scale
        blk, off = int(table[s, pos // 8]), pos % 8
        torch.testing.assert_close(k[pos], case.kv_cache[0, blk, off].float() * scales[0, blk, off][:, None])
        want = naive_dense_attention(case.q[starts[s] : starts[s + 1]], k, v, case.scale)
        torch.testing.assert_close(out[starts[s] : starts[s + 1]].double(), want, atol=1e-5, rtol=1e-5)
    # the scales matter: the same int8 values with unit scales give a different answer
    plain = paged_prefill_attention_ref(
        case.q, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables, case.scale,
        kv_scales=torch.ones_like(scales),
    )  # fmt: skip
    assert (plain - out).abs().max() > 0.1


@pytest.mark.parametrize("window", [None, 9])
def test_triton_backend_matches_torch_backend_on_a_mixed_batch(paged, window):
    """Two decodes around two prefill chunks (one behind a cached prefix): cache writes identical, outputs
    within tolerance, and the torch backend's gathered (dequantizing) path is what both read."""
    from pagoda.engine.attention import get_attention_backend
    from pagoda.engine.attention.base import AttentionMetadata, LayerKVCache
    from pagoda.engine.attention.torch_backend import TorchAttentionBackend

    seq_lens, query_lens = [17, 40, 1, 24], [1, 9, 1, 24]
    case, scales = int8_case(paged, seq_lens, query_lens, block_size=8, group=4, num_kv_heads=2, seed=3)
    gen = torch.Generator().manual_seed(4)
    t = case.q.shape[0]
    k = (torch.randn((t, 2, 64), generator=gen) * 2).half()
    v = torch.randn((t, 2, 64), generator=gen).half()
    slots = [int(case.block_tables[s, p // 8]) * 8 + p % 8
             for s, (n, ql) in enumerate(zip(seq_lens, query_lens, strict=True)) for p in range(n - ql, n)]  # fmt: skip
    meta = AttentionMetadata(
        num_seqs=4, num_tokens=t, query_start_loc=case.query_start_loc, seq_lens=case.seq_lens,
        context_lens=case.seq_lens - torch.tensor(query_lens, dtype=torch.int32),
        block_tables=case.block_tables, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_list=query_lens,
        seq_lens_list=seq_lens,
    )  # fmt: skip
    # the torch backend gathers whole blocks and masks (0 x NaN would be NaN): finite garbage, large scales
    # (within fp16 once dequantized, as any scale a real row got)
    scales = torch.nan_to_num(scales, nan=50.0)
    tri = LayerKVCache(case.kv_cache.clone(), scales=scales.clone())
    ref = LayerKVCache(case.kv_cache.clone(), scales=scales.clone())
    out = get_attention_backend("triton", "cpu").forward(case.q, k, v, tri, meta, case.scale, window)
    want = TorchAttentionBackend().forward(case.q, k, v, ref, meta, case.scale, window)
    assert torch.equal(tri.kv, ref.kv)
    torch.testing.assert_close(tri.scales, ref.scales, equal_nan=True, atol=0, rtol=0)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, want, **paged.tolerance(case.q.dtype))


@pytest.mark.parametrize(("head_dim", "window"), [(256, None), (64, 5)])
def test_decode_and_prefill_with_soft_cap_match_twin(paged, head_dim, window):
    """Gemma 2's soft-cap over an INT8 cache: each key's scale applies before the cap, in both kernels
    (Gemma 3 270M's 4 query heads on 1 KV head at head_dim 256)."""
    seq_lens, query_lens = [1, 19, 40], [1, 19, 6]
    case, scales = int8_case(paged, seq_lens, query_lens, block_size=16, group=4, num_kv_heads=1,
                             head_dim=head_dim, dtype=torch.float32, seed=head_dim)  # fmt: skip
    kw = dict(kv_scales=scales, sliding_window=window, logit_softcap=0.9)
    out = paged_prefill_attention(
        case.q, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables, case.scale,
        max_query_len=max(query_lens), out=paged.poisoned_like(case.q), **kw,
    )  # fmt: skip
    ref = paged_prefill_attention_ref(
        case.q, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables, case.scale, **kw
    )
    torch.testing.assert_close(out, ref, **paged.tolerance(case.q.dtype))
    last = case.query_start_loc[1:] - 1  # each sequence's last token, as a decode
    dec = paged_decode_attention(
        case.q[last], case.kv_cache, case.block_tables, case.seq_lens, case.scale, num_splits=2, **kw
    )
    torch.testing.assert_close(dec, ref[last], **paged.tolerance(case.q.dtype))
    plain = paged_decode_attention_ref(
        case.q[last], case.kv_cache, case.seq_lens, case.block_tables, case.scale, kv_scales=scales,
        sliding_window=window,
    )  # fmt: skip
    assert (plain - dec).abs().max() > 1e-2
