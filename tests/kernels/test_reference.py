"""The torch twins against textbook dense attention: the twins are the definition, so check them too."""

import pytest
import torch
from pagoda.kernels.reference import (
    gather_sequence_kv,
    naive_dense_attention,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    reshape_and_cache_ref,
)


@pytest.mark.parametrize("softcap", [None, 0.3])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_twin_matches_dense_attention(paged, window, group, softcap):
    case = paged.make([13, 30, 16], [13, 5, 1], block_size=8, group=group, dtype=torch.float32, seed=group)
    out = paged_prefill_attention_ref(
        case.q, case.kv_cache, case.query_start_loc, case.seq_lens, case.block_tables, case.scale,
        sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    starts = case.query_start_loc.tolist()
    for s, seq_len in enumerate(case.seq_lens.tolist()):
        k, v = gather_sequence_kv(case.kv_cache, case.block_tables[s], seq_len)
        want = naive_dense_attention(case.q[starts[s] : starts[s + 1]], k, v, case.scale, window, softcap)
        torch.testing.assert_close(out[starts[s] : starts[s + 1]].double(), want, atol=1e-5, rtol=1e-5)


def test_softcap_bounds_the_scores_the_twin_attends_with(paged):
    """A cap far below the scores flattens them toward c: the output moves toward the plain mean of V."""
    case = paged.make([24], block_size=8, group=1, dtype=torch.float32, seed=5)
    args = (case.q * 20, case.kv_cache, case.seq_lens, case.block_tables, case.scale)
    plain = paged_decode_attention_ref(*args)
    capped = paged_decode_attention_ref(*args, logit_softcap=1e-3)
    huge = paged_decode_attention_ref(*args, logit_softcap=1e9)
    _, v = gather_sequence_kv(case.kv_cache, case.block_tables[0], 24)
    torch.testing.assert_close(capped[0], v.mean(0).repeat_interleave(case.q.shape[1] // v.shape[1], 0),
                               atol=1e-3, rtol=0)  # fmt: skip
    torch.testing.assert_close(huge, plain, atol=1e-5, rtol=1e-5)
    assert (plain - capped).abs().max() > 0.1


def test_decode_twin_is_the_last_row_of_dense_attention(paged):
    case = paged.make([1, 8, 21], block_size=8, group=4, dtype=torch.float32, seed=4)
    out = paged_decode_attention_ref(case.q, case.kv_cache, case.seq_lens, case.block_tables, case.scale)
    for s, seq_len in enumerate(case.seq_lens.tolist()):
        k, v = gather_sequence_kv(case.kv_cache, case.block_tables[s], seq_len)
        want = naive_dense_attention(case.q[s : s + 1], k, v, case.scale)
        torch.testing.assert_close(out[s : s + 1].double(), want, atol=1e-5, rtol=1e-5)


def test_gather_follows_the_block_table(paged):
    case = paged.make([20], block_size=8, dtype=torch.float32)
    k, v = gather_sequence_kv(case.kv_cache, case.block_tables[0], 20)
    table = case.block_tables[0].tolist()
    for pos in (0, 7, 8, 19):
        torch.testing.assert_close(k[pos], case.kv_cache[0, table[pos // 8], pos % 8])
        torch.testing.assert_close(v[pos], case.kv_cache[1, table[pos // 8], pos % 8])


def test_cache_write_twin_round_trips_with_fp8_scales():
    k = torch.randn(5, 2, 16) * 3
    v = torch.randn(5, 2, 16)
    cache = torch.zeros((2, 3, 4, 2, 16), dtype=torch.float8_e4m3fn)
    slots = torch.tensor([0, 5, 6, 11, 2])
    reshape_and_cache_ref(k, v, cache, slots, k_scale=0.01, v_scale=0.004)
    back = cache.view(2, 12, 2, 16).float()
    # within half an e4m3 step (1/16 relative), values past 448 x scale saturated rather than NaN
    torch.testing.assert_close(back[0, slots] * 0.01, k.clamp(-4.48, 4.48), rtol=0.0625, atol=1e-3)
    torch.testing.assert_close(back[1, slots] * 0.004, v.clamp(-1.792, 1.792), rtol=0.0625, atol=1e-3)
