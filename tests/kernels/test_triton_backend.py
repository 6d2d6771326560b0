"""The triton attention backend against the torch backend, and the engine end to end (interpreter)."""

import pytest
import torch
from pagoda.engine.attention import get_attention_backend
from pagoda.engine.attention.base import AttentionMetadata, LayerKVCache
from pagoda.engine.attention.torch_backend import TorchAttentionBackend


def _mixed_step(paged, cache_dtype, dtype=torch.float16, seed=0):
    """A flat batch of two decodes around two prefill chunks (one behind a cached prefix)."""
    seq_lens, query_lens = [17, 40, 1, 24], [1, 9, 1, 24]
    case = paged.make(seq_lens, query_lens, block_size=8, group=4, num_kv_heads=2, dtype=dtype,
                      cache_dtype=cache_dtype, seed=seed)  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 1)
    t = case.q.shape[0]
    k = torch.randn((t, 2, 64), generator=gen).to(dtype)
    v = torch.randn((t, 2, 64), generator=gen).to(dtype)
    slots = []
    for s, (n, ql) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for pos in range(n - ql, n):
            slots.append(int(case.block_tables[s, pos // 8]) * 8 + pos % 8)
    meta = AttentionMetadata(
        num_seqs=4, num_tokens=t, query_start_loc=case.query_start_loc, seq_lens=case.seq_lens,
        context_lens=case.seq_lens - torch.tensor(query_lens, dtype=torch.int32),
        block_tables=case.block_tables, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_list=query_lens,
        seq_lens_list=seq_lens,
    )  # fmt: skip
    return case, k, v, meta


@pytest.mark.parametrize(
    ("cache_dtype", "window"), [(None, None), (None, 5), (torch.float8_e4m3fn, None), (torch.float8_e5m2, 9)]
)
def test_backend_matches_torch_backend_on_a_mixed_batch(paged, cache_dtype, window):
    case, k, v, meta = _mixed_step(paged, cache_dtype)
    scales = (1.0, 1.0) if cache_dtype is None else (0.02, 0.03)
    tri_cache = LayerKVCache(case.kv_cache.clone(), *scales)
    ref_cache = LayerKVCache(case.kv_cache.clone(), *scales)
    backend = get_attention_backend("triton", "cpu")
    assert backend.name == "triton"
    out = backend.forward(case.q, k, v, tri_cache, meta, case.scale, sliding_window=window)
    ref = TorchAttentionBackend().forward(case.q, k, v, ref_cache, meta, case.scale, sliding_window=window)
    assert not torch.isnan(out).any()
    if cache_dtype is None:
        assert torch.equal(tri_cache.kv, ref_cache.kv)
        torch.testing.assert_close(out, ref, **paged.tolerance(case.q.dtype))
    else:
        # the interpreter's fp32 -> fp8 cast rounds a few values differently (REFERENCE.md): compare the
        # attention over the *same* cache by running torch on the cache the kernel wrote
        ref = _torch_attention_over(tri_cache, case, meta, window)
        torch.testing.assert_close(out, ref, **paged.tolerance(case.q.dtype))
        assert (tri_cache.kv.float() == ref_cache.kv.float()).float().mean() > 0.95


@pytest.mark.parametrize(("window", "dtype"), [(None, torch.float32), (5, torch.float16)])
def test_backend_logit_softcap_matches_torch_backend(paged, window, dtype):
    """The soft-cap keyword reaches both kernels of a mixed batch (decodes and prefill chunks) and gives the
    torch backend's answer, which differs from the uncapped one."""
    case, k, v, meta = _mixed_step(paged, None, dtype=dtype, seed=2)
    backend = get_attention_backend("triton", "cpu")
    outs = {}
    for cap in (None, 0.6):
        cache = LayerKVCache(case.kv_cache.clone())
        outs[cap] = backend.forward(case.q, k, v, cache, meta, case.scale, window, logit_softcap=cap)
        ref = TorchAttentionBackend().forward(
            case.q, k, v, LayerKVCache(case.kv_cache.clone()), meta, case.scale, window, logit_softcap=cap
        )
        torch.testing.assert_close(outs[cap], ref, **paged.tolerance(dtype))
    assert (outs[0.6].float() - outs[None].float()).abs().max() > 1e-2


def _torch_attention_over(written, case, meta, window):
    from pagoda.kernels.reference import paged_prefill_attention_ref

    return paged_prefill_attention_ref(
        case.q, written.kv, meta.query_start_loc, meta.seq_lens, meta.block_tables, case.scale,
        written.k_scale, written.v_scale, window,
    )  # fmt: skip


@pytest.mark.parametrize(("sliding_window", "kv_cache_dtype"), [(None, "auto"), (12, "auto"), (None, "int8")])
def test_engine_greedy_tokens_match_torch_backend(tiny_llama, sliding_window, kv_cache_dtype):
    from pagoda.engine import LLM, SamplingParams

    model_dir = tiny_llama(sliding_window)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 512, (20,), generator=gen).tolist()
    # ragged prompts, one of exactly a block (16), two sharing a 20-token prefix (prefix-cache hit)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 16, 37)]
    prompts += [shared + [7, 8, 9], shared + [10]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            model=str(model_dir), attention_backend=backend, device="cpu", dtype="float32", block_size=16,
            kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=32, max_model_len=128,
            kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == 6 for t in tokens["torch"])
    assert tokens["triton"] == tokens["torch"]


def test_streaming_eviction_gives_the_torch_backends_tokens(tiny_llama):
    """Attention sinks past max-model-len (sinks rotated to follow the window, positions past the evicted
    tokens) read the cache the same way on both backends: the same greedy tokens through 3 evictions."""
    from pagoda.engine import LLM, SamplingParams

    model_dir = tiny_llama()
    prompt = torch.randint(3, 512, (36,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=44, ignore_eos=True, kv_eviction="streaming")
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            model=str(model_dir), attention_backend=backend, device="cpu", dtype="float32", block_size=16,
            kv_cache_memory_bytes=4 << 20, max_model_len=64,
        )  # fmt: skip
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        tokens[backend] = list(out.outputs[0].token_ids)
        assert llm.engine.scheduler.kv.num_used_blocks == 0
    assert len(tokens["torch"]) == 44
    assert tokens["triton"] == tokens["torch"]
