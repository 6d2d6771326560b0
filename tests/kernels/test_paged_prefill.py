"""Paged (chunked-)prefill kernel against its torch twin (interpreter)."""

import pytest
import torch
from pagoda.kernels.paged_prefill import paged_prefill_attention
from pagoda.kernels.reference import paged_prefill_attention_ref


def _check(paged, case, **kw):
    out = paged_prefill_attention(
        case.q,
        case.kv_cache,
        case.query_start_loc,
        case.seq_lens,
        case.block_tables,
        case.scale,
        max_query_len=max(case.query_lens),
        out=paged.poisoned_like(case.q),
        **kw,
    )
    ref = paged_prefill_attention_ref(
        case.q,
        case.kv_cache,
        case.query_start_loc,
        case.seq_lens,
        case.block_tables,
        case.scale,
        kw.get("k_scale", 1.0),
        kw.get("v_scale", 1.0),
        kw.get("sliding_window"),
        logit_softcap=kw.get("logit_softcap"),
        sinks=kw.get("sinks"),
    )
    torch.testing.assert_close(out, ref, **paged.tolerance(case.q.dtype))
    return out


@pytest.mark.parametrize(("block_size", "group"), [(8, 1), (16, 4), (32, 8), (64, 4)])
def test_ragged_chunked_prefill_matches_twin(paged, block_size, group):
    # full prompts, chunks behind a cached prefix (one ending on a block boundary), a 1-token query
    seq_lens = [21, 2 * block_size + 7, 2 * block_size, 9]
    query_lens = [21, 12, block_size, 1]
    case = paged.make(seq_lens, query_lens, block_size=block_size, group=group, num_kv_heads=1, seed=group)
    _check(paged, case)


@pytest.mark.parametrize(
    ("head_dim", "dtype"),
    [
        (64, torch.float32),
        (128, torch.float16),
        (256, torch.float16),
        (96, torch.float16),
        (80, torch.float32),
    ],
)
def test_head_dims_and_dtypes(paged, head_dim, dtype):
    """Every head size the catalogue has, powers of two or not (Phi-3's 96: lanes padded to 128)."""
    case = paged.make([19, 40], [19, 7], block_size=16, group=2, head_dim=head_dim, dtype=dtype, seed=3)
    _check(paged, case)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_dequantized_with_scales(paged, cache_dtype):
    case = paged.make([30, 17], [30, 5], block_size=8, group=4, cache_dtype=cache_dtype, seed=5)
    _check(paged, case, k_scale=0.41, v_scale=2.3)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(paged, window):
    case = paged.make([37, 24], [37, 6], block_size=8, group=4, num_kv_heads=1, seed=window)
    _check(paged, case, sliding_window=window)


def test_tiles_larger_and_smaller_than_blocks(paged):
    case = paged.make([45, 33], [45, 20], block_size=32, group=2, num_kv_heads=1, seed=9)
    _check(paged, case, block_m=32, block_n=16)
    _check(paged, case, block_m=16, block_n=64)


def test_tiles_smaller_than_tl_dot_are_refused(paged):
    """The interpreter would run an 8-key tile; an H100's compiler refuses it (tl.dot needs K >= 16)."""
    case = paged.make([45, 33], [45, 20], block_size=16, group=2, num_kv_heads=1, seed=9)
    with pytest.raises(ValueError, match="at least 16"):
        _check(paged, case, block_m=32, block_n=8)


def test_serves_only_the_given_sequences(paged):
    case = paged.make([9, 30, 17], [1, 12, 4], block_size=8, group=4, num_kv_heads=1, seed=2)
    out = paged.poisoned_like(case.q)
    paged_prefill_attention(
        case.q,
        case.kv_cache,
        case.query_start_loc,
        case.seq_lens,
        case.block_tables,
        case.scale,
        max_query_len=12,
        out=out,
        seq_ids=torch.tensor([1, 2], dtype=torch.int32),
    )
    ref = paged_prefill_attention_ref(
        case.q, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables, case.scale
    )
    assert torch.isnan(out[0]).all()
    torch.testing.assert_close(out[1:], ref[1:], **paged.tolerance(case.q.dtype))


@pytest.mark.parametrize(
    ("head_dim", "group", "window", "dtype"),
    [(64, 4, None, torch.float32), (128, 2, 5, torch.float16), (256, 4, None, torch.float16),
     (256, 4, 9, torch.float32)],
)  # fmt: skip
def test_logit_softcap(paged, head_dim, group, window, dtype):
    """Gemma 2's soft-capped scores (Gemma 3 270M's shape: 4 query heads on 1 KV head, head_dim 256): the
    kernel matches the twin with the cap, with and without a window, and the cap changes the answer."""
    case = paged.make([21, 40], [21, 7], block_size=16, group=group, num_kv_heads=1, head_dim=head_dim,
                      dtype=dtype, seed=head_dim + group)  # fmt: skip
    capped = _check(paged, case, sliding_window=window, logit_softcap=0.7)
    plain = _check(paged, case, sliding_window=window)
    assert (capped.float() - plain.float()).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("group", "window", "dtype"), [(4, None, torch.float32), (2, 5, torch.float16), (8, 9, torch.float32)]
)
def test_attention_sinks(paged, group, window, dtype):
    """gpt-oss's learned sinks, chunks behind a cached prefix, with and without a window: the kernel matches
    the twin with the sinks, and they change the answer."""
    case = paged.make([21, 40], [21, 7], block_size=16, group=group, num_kv_heads=2, head_dim=64, dtype=dtype,
                      seed=group)  # fmt: skip
    sinks = torch.linspace(-3.0, 4.0, case.q.shape[1], dtype=torch.float32)
    sinks[-1] = 30.0
    with_sinks = _check(paged, case, sliding_window=window, sinks=sinks)
    plain = _check(paged, case, sliding_window=window)
    assert (with_sinks.float() - plain.float()).abs().max() > 1e-2
