"""Paged decode kernel against its torch twin (interpreter)."""

import pytest
import torch
from pagoda.kernels.paged_decode import choose_num_splits, paged_decode_attention
from pagoda.kernels.reference import paged_decode_attention_ref


def _run(case, out=None, **kw):
    return paged_decode_attention(
        case.q, case.kv_cache, case.block_tables, case.seq_lens, case.scale, out=out, **kw
    )


@pytest.mark.parametrize(("block_size", "group"), [(8, 1), (8, 8), (16, 4), (16, 1), (32, 8), (64, 4)])
def test_decode_matches_twin_across_block_sizes_and_gqa(paged, block_size, group):
    # ragged: a single token, a length ending exactly on a block boundary, one just past it, a longer one
    lens = [1, block_size, block_size + 1, 2 * block_size + 5]
    case = paged.make(lens, block_size=block_size, group=group, num_kv_heads=2, seed=block_size + group)
    out = _run(case, out=paged.poisoned_like(case.q), num_splits=1)
    ref = paged_decode_attention_ref(case.q, case.kv_cache, case.seq_lens, case.block_tables, case.scale)
    torch.testing.assert_close(out, ref, **paged.tolerance(case.q.dtype))


@pytest.mark.parametrize("num_splits", [2, 8])
def test_split_kv_merge_matches_twin(paged, num_splits):
    # 8 splits over a 1-token sequence leave most splits empty: the merge must weigh them 0
    case = paged.make([1, 70, 133], block_size=16, group=4, num_kv_heads=1, seed=num_splits)
    out = _run(case, out=paged.poisoned_like(case.q), num_splits=num_splits)
    ref = paged_decode_attention_ref(case.q, case.kv_cache, case.seq_lens, case.block_tables, case.scale)
    torch.testing.assert_close(out, ref, **paged.tolerance(case.q.dtype))


@pytest.mark.parametrize(
    ("head_dim", "dtype"),
    [(64, torch.float32), (128, torch.float16), (256, torch.float16), (256, torch.float32), (96, torch.float16),
     (80, torch.float32)],
)  # fmt: skip
def test_head_dims_and_dtypes(paged, head_dim, dtype):
    """Every head size the catalogue has, powers of two or not (Phi-3's 96: lanes padded to 128)."""
    case = paged.make([5, 32, 47], block_size=16, group=2, head_dim=head_dim, dtype=dtype, seed=head_dim)
    out = _run(case, out=paged.poisoned_like(case.q), num_splits=2)
    ref = paged_decode_attention_ref(case.q, case.kv_cache, case.seq_lens, case.block_tables, case.scale)
    torch.testing.assert_close(out, ref, **paged.tolerance(dtype))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fp8_cache_dequantized_with_scales(paged, cache_dtype, num_splits):
    case = paged.make([1, 16, 61], block_size=16, group=4, cache_dtype=cache_dtype, seed=7)
    k_scale, v_scale = 0.37, 1.9
    out = _run(case, out=paged.poisoned_like(case.q), num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
    ref = paged_decode_attention_ref(
        case.q, case.kv_cache, case.seq_lens, case.block_tables, case.scale, k_scale, v_scale
    )
    torch.testing.assert_close(out, ref, **paged.tolerance(case.q.dtype))
    # the scales really are applied: without them the answer is far off
    plain = paged_decode_attention_ref(case.q, case.kv_cache, case.seq_lens, case.block_tables, case.scale)
    assert (plain.float() - ref.float()).abs().max() > 0.1


@pytest.mark.parametrize(("window", "num_splits"), [(1, 1), (7, 4), (16, 1), (40, 4)])
def test_sliding_window(paged, window, num_splits):
    case = paged.make([3, 16, 33, 64], block_size=8, group=4, seed=window)
    out = _run(case, out=paged.poisoned_like(case.q), num_splits=num_splits, sliding_window=window)
    ref = paged_decode_attention_ref(
        case.q, case.kv_cache, case.seq_lens, case.block_tables, case.scale, sliding_window=window
    )
    torch.testing.assert_close(out, ref, **paged.tolerance(case.q.dtype))


@pytest.mark.parametrize(
    ("head_dim", "group", "window", "num_splits", "dtype"),
    [(64, 4, None, 1, torch.float32), (128, 2, 7, 4, torch.float16), (256, 4, None, 2, torch.float16),
     (256, 4, 20, 1, torch.float32)],
)  # fmt: skip
def test_logit_softcap(paged, head_dim, group, window, num_splits, dtype):
    """Gemma 2's soft-capped scores (Gemma 3 270M's shape: 4 query heads on 1 KV head, head_dim 256), split
    or not, with and without a window: the kernel matches the twin, and the cap changes the answer."""
    case = paged.make([3, 16, 45], block_size=16, group=group, num_kv_heads=1, head_dim=head_dim, dtype=dtype,
                      seed=head_dim + group)  # fmt: skip
    outs = {}
    for cap in (None, 0.7):
        outs[cap] = _run(case, out=paged.poisoned_like(case.q), num_splits=num_splits, sliding_window=window,
                         logit_softcap=cap)  # fmt: skip
        ref = paged_decode_attention_ref(case.q, case.kv_cache, case.seq_lens, case.block_tables, case.scale,
                                         sliding_window=window, logit_softcap=cap)  # fmt: skip
        torch.testing.assert_close(outs[cap], ref, **paged.tolerance(dtype))
    assert (outs[0.7].float() - outs[None].float()).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("group", "window", "num_splits", "dtype"),
    [(4, None, 1, torch.float32), (4, 7, 4, torch.float32), (2, None, 2, torch.float16), (8, 20, 1, torch.float16)],
)  # fmt: skip
def test_attention_sinks(paged, group, window, num_splits, dtype):
    """gpt-oss's learned sinks (a logit per query head in the denominator), split or not (the merge adds them
    once), with and without a window: the kernel matches the twin, and the sinks change the answer."""
    case = paged.make([3, 16, 45], block_size=16, group=group, num_kv_heads=2, head_dim=64, dtype=dtype,
                      seed=group + (window or 0))  # fmt: skip
    heads = case.q.shape[1]
    sinks = torch.linspace(-3.0, 4.0, heads, dtype=torch.float32)
    sinks[0] = 30.0  # far above every score: the sink takes (almost) all the weight, nothing overflows
    outs = {}
    for name, s in (("none", None), ("sinks", sinks)):
        outs[name] = _run(case, out=paged.poisoned_like(case.q), num_splits=num_splits, sliding_window=window,
                          sinks=s)  # fmt: skip
        ref = paged_decode_attention_ref(case.q, case.kv_cache, case.seq_lens, case.block_tables, case.scale,
                                         sliding_window=window, sinks=s)  # fmt: skip
        torch.testing.assert_close(outs[name], ref, **paged.tolerance(dtype))
    assert (outs["sinks"].float() - outs["none"].float()).abs().max() > 1e-2


def test_serves_a_subset_of_a_mixed_batch_and_leaves_other_rows_alone(paged):
    # sequence 1 is a 3-token prefill chunk in the flat batch; the decode launch must skip its rows
    case = paged.make([9, 20, 17], query_lens=[1, 3, 1], block_size=8, group=4, seed=3)
    out = paged.poisoned_like(case.q)
    seq_ids = torch.tensor([0, 2], dtype=torch.int32)
    paged_decode_attention(
        case.q,
        case.kv_cache,
        case.block_tables,
        case.seq_lens,
        case.scale,
        out=out,
        query_start_loc=case.query_start_loc,
        seq_ids=seq_ids,
        num_splits=2,
    )
    for seq, row in ((0, 0), (2, 4)):
        ref = paged_decode_attention_ref(
            case.q[row : row + 1],
            case.kv_cache,
            case.seq_lens[seq : seq + 1],
            case.block_tables[seq : seq + 1],
            case.scale,
        )
        torch.testing.assert_close(out[row : row + 1], ref, **paged.tolerance(case.q.dtype))
    assert torch.isnan(out[1:4]).all()


def test_split_heuristic_fills_the_gpu_only_when_needed():
    gpu = torch.device("cpu")  # 4 "SMs" off-GPU
    assert choose_num_splits(64, 8, 4096, gpu) == 1
    assert choose_num_splits(1, 1, 4096, gpu) == 8
    assert choose_num_splits(1, 1, 100, gpu) == 1  # too short to be worth splitting


def test_rejects_mismatched_head_dim(paged):
    case = paged.make([4], head_dim=64)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(
            case.q[..., :32].contiguous(), case.kv_cache, case.block_tables, case.seq_lens, 1.0
        )
