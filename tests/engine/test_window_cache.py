"""The engine with a window group (Gemma 2/3's sliding layers keep only their window's blocks) gives the tokens
of the full layout and of transformers: prompts and generations several windows long (window 6, blocks of
8), prefix hits, preemption and resume, n > 1 forks; the sliding layers' pool holds a few blocks a sequence.
"""

from __future__ import annotations

import pytest
import torch
from pagoda.engine import LLM, SamplingParams
from pagoda_testkit import tiny_gemma

_BUILT: dict = {}


def _build(name: str, tmp_path_factory):
    if name not in _BUILT:
        path = tmp_path_factory.mktemp(name)
        hf, ids, _ = tiny_gemma.build(name, path)
        _BUILT[name] = name, path, hf, ids
    return _BUILT[name]


@pytest.fixture(scope="module", params=tiny_gemma.FAMILIES)
def family(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Gemma 3 alone (4 sliding and 2 global layers), for the tests past token parity."""
    return _build("gemma3", tmp_path_factory)


def _llm(path, mode: str, **kw) -> LLM:
    args = dict(
        device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20,
        skip_tokenizer_init=True, block_size=8, max_num_seqs=8, sliding_window_cache=mode,
    )  # fmt: skip
    args.update(kw)
    return LLM(str(path), **args)


def _run(llm: LLM, prompts, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def _watch(kv) -> dict:
    """Check the manager's invariants after every allocation; record the window pool's peak use."""
    seen = {"peak": 0, "calls": 0, "decode_held": 0}
    allocate = kv.allocate_slots

    def spy(seq_id, n):
        decode = kv.get_num_tokens(seq_id) == n - 1
        ok = allocate(seq_id, n)
        seen["peak"] = max(seen["peak"], kv.window_pool.num_used_blocks)
        seen["calls"] += 1
        if ok and decode:
            held = sum(1 for b in kv.get_window_block_table(seq_id) if b)
            seen["decode_held"] = max(seen["decode_held"], held)
        kv.check_invariants()
        return ok

    kv.allocate_slots = spy
    return seen


def test_greedy_tokens_match_transformers_and_the_full_layout(family):
    name, path, hf, ids = family
    prompts = [ids[0, :20].tolist(), ids[1, :9].tolist(), ids[0, :20].tolist() + [5, 6, 7]]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expect = [[tiny_gemma.hf_greedy(hf, p, 30)] for p in prompts]
    full = _llm(path, "off")
    try:
        assert full.engine.core.plan.num_window_blocks == 0
        assert _run(full, prompts, greedy) == expect
    finally:
        full.engine.close()
    llm = _llm(path, "auto")
    try:
        core = llm.engine.core
        sliding = [i for i in range(len(core.runner.kv_caches)) if core.model_config.layer_sliding_window(i)]
        assert core.plan.window == 6 and core.plan.window_layers == tuple(sliding)
        sizes = [c.kv.shape[1] for c in core.runner.kv_caches]
        assert {sizes[i] for i in sliding} == {core.plan.num_window_blocks}
        assert core.plan.num_blocks > 170  # the full layout's 170 blocks, now only in the full layers
        seen = _watch(core.scheduler.kv)
        assert _run(llm, prompts, greedy) == expect
        # the prompts' first step: 3 + 2 + 3 window blocks and the null block; a decode (keys p - 5 .. p)
        # reads at most 2 blocks of 8 and holds no more
        assert seen["calls"] > 30 and seen["peak"] == 1 + 3 + 2 + 3
        assert seen["decode_held"] == 2
        kv = core.scheduler.kv
        kv.check_invariants()
        hits = kv.prefix_cache_hits
        assert _run(llm, prompts, greedy) == expect  # again, from the prefix cache
        assert kv.prefix_cache_hits > hits
    finally:
        llm.engine.close()


def test_a_tight_cache_preempts_and_resumes_with_the_same_tokens(family):
    _, path, hf, ids = family
    prompts = [ids[i % 2, : 9 + 3 * i].tolist() for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expect = [[tiny_gemma.hf_greedy(hf, p, 24)] for p in prompts]
    # room for one or two sequences of 48 tokens: the others wait or are preempted and recomputed
    llm = _llm(path, "auto", kv_cache_memory_bytes=1 << 18, max_model_len=48)
    try:
        core = llm.engine.core
        assert core.plan.num_window_blocks > 0
        _watch(core.scheduler.kv)
        assert _run(llm, prompts, greedy) == expect
        assert core.scheduler.total_preemptions > 0
    finally:
        llm.engine.close()


def test_forks_share_then_copy_window_blocks(gemma3):
    _, path, _, ids = gemma3
    prompts = [ids[0, :20].tolist(), ids[1, :13].tolist()]
    params = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=24, ignore_eos=True)
    results = {}
    for mode in ("off", "auto"):
        llm = _llm(path, mode)
        try:
            if mode == "auto":
                _watch(llm.engine.core.scheduler.kv)
            results[mode] = _run(llm, prompts, params)
        finally:
            llm.engine.close()
    assert results["auto"] == results["off"]
    assert all(len({tuple(c) for c in out}) > 1 for out in results["auto"])  # the samples differ


def test_streaming_requests_are_refused_with_a_window_group(gemma3):
    _, path, _, ids = gemma3
    llm = _llm(path, "auto")
    try:
        params = SamplingParams(temperature=0, max_tokens=4, kv_eviction="streaming")
        with pytest.raises(ValueError, match="sliding layers' KV cache keeps only their window"):
            llm.generate([ids[0, :9].tolist()], params, use_tqdm=False)
    finally:
        llm.engine.close()


def test_offload_tiers_keep_the_full_layout(gemma3):
    _, path, _, _ = gemma3
    llm = _llm(path, "auto", kv_offload_host_bytes=1 << 20)
    try:
        core = llm.engine.core
        assert core.plan.num_window_blocks == 0 and core.scheduler.kv.window_pool is None
        assert "offload" in core.window_cache_reason
    finally:
        llm.engine.close()


def test_null_block_is_never_written(gemma3):
    """Block 0 of the sliding layers' caches stays zero: out-of-window table entries read it under the mask,
    which must see finite values."""
    _, path, _, ids = gemma3
    llm = _llm(path, "auto")
    try:
        core = llm.engine.core
        llm.generate([ids[0, :20].tolist()], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
        assert core.plan.window_layers
        for i in core.plan.window_layers:
            assert torch.count_nonzero(core.runner.kv_caches[i].kv[:, 0]) == 0
            assert torch.count_nonzero(core.runner.kv_caches[i].kv[:, 1]) > 0
    finally:
        llm.engine.close()


def test_published_block_events_claim_only_what_both_pools_hold(gemma3):
    from pagoda.engine.kv_cache.publisher import KVEventPublisher

    _, path, _, ids = gemma3
    llm = _llm(path, "auto", kv_cache_memory_bytes=1 << 18, max_model_len=64)  # a window pool of ~15 blocks
    try:
        core = llm.engine.core
        publisher = KVEventPublisher(core.scheduler)
        prompts = [ids[0].tolist(), ids[1].tolist()]
        llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
        kv = core.scheduler.kv
        both = set(kv.block_pool.cached) & set(kv.window_pool.cached)
        claimed = {bytes.fromhex(h) for h in publisher.snapshot()["tiers"].get("device", [])}
        assert claimed == both
        either = set(kv.block_pool.cached) | set(kv.window_pool.cached)
        assert 0 < len(both) < len(either)  # one pool let blocks go that the other still holds
    finally:
        llm.engine.close()


def test_usage_metrics_report_each_pool_and_the_fuller_one(gemma3):
    """vllm:kv_cache_usage_perc is the fuller pool's usage (either pool running out blocks admission);
    pagoda:kv_cache_usage_perc{pool} each pool's, the window pool's reserved null block counted in neither."""
    from pagoda.engine.core.stats import IterationStats
    from pagoda.engine.metrics.prometheus import PrometheusStatLogger

    _, path, _, ids = gemma3
    llm = _llm(path, "auto")
    try:
        core = llm.engine.core
        kv = core.scheduler.kv
        full_blocks, window_blocks = core.plan.num_blocks, core.plan.num_window_blocks
        assert window_blocks < full_blocks
        seen: list = []
        allocate = kv.allocate_slots

        def spy(seq_id, n):
            ok = allocate(seq_id, n)
            used = (kv.block_pool.num_used_blocks, kv.window_pool.num_used_blocks)
            seen.append((used, core.get_scheduler_stats()))
            return ok

        kv.allocate_slots = spy
        prompts = [ids[0].tolist(), ids[1].tolist()]
        llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
        assert len(seen) > 20
        window_fuller = 0
        for (full_used, window_used), stats in seen:
            pools = {"full": full_used / full_blocks, "window": (window_used - 1) / (window_blocks - 1)}
            assert stats.kv_pool_usage == pytest.approx(pools)
            assert stats.kv_cache_usage == pytest.approx(max(pools.values()))
            window_fuller += pools["window"] > pools["full"]
        # the window pool is the smaller: a prompt's blocks fill it faster than the full one
        assert window_fuller > 0
        # the exporter: one series per pool beside vLLM's gauge, which follows the fuller pool
        (_, stats) = max(seen, key=lambda s: s[1].kv_cache_usage)
        assert stats.kv_pool_usage["window"] > stats.kv_pool_usage["full"]
        exporter = PrometheusStatLogger("m", max_model_len=64)
        exporter.record(stats, IterationStats())
        labels = {"model_name": "m", "engine": "0"}
        sample = exporter.registry.get_sample_value
        assert stats.kv_cache_usage > 0
        assert sample("vllm:kv_cache_usage_perc", labels) == pytest.approx(stats.kv_pool_usage["window"])
        for pool in ("full", "window"):
            got = sample("pagoda:kv_cache_usage_perc", {**labels, "pool": pool})
            assert got == pytest.approx(stats.kv_pool_usage[pool])
        assert stats.kv_cache_usage == max(stats.kv_pool_usage.values())
        assert stats.num_blocks_total == full_blocks  # the block gauges stay the full-attention pool's
    finally:
        llm.engine.close()
    # one pool: no per-pool series
    llm = _llm(path, "off", kv_cache_memory_bytes=1 << 18, max_model_len=64)
    try:
        stats = llm.engine.core.get_scheduler_stats()
        assert stats.kv_pool_usage == {} and stats.kv_cache_usage == 0
    finally:
        llm.engine.close()


def _tiny_mistral(path) -> tuple:
    """A tiny random-weight Mistral whose every layer slides (window 6): (hf model, prompt ids [2, 29])."""
    import transformers

    cfg = transformers.MistralConfig(
        vocab_size=tiny_gemma.VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-5, sliding_window=6, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    hf = transformers.MistralForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.copy_((0.05 if "embed" in name else 0.15) * torch.randn(p.shape, generator=g))
    hf.save_pretrained(path, safe_serialization=True)
    ids = torch.randint(3, tiny_gemma.VOCAB, (2, tiny_gemma.SEQ), generator=torch.Generator().manual_seed(5))
    return hf, ids


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral")
    return (path, *_tiny_mistral(path))


def test_an_all_sliding_model_keeps_only_window_blocks(mistral):
    """Every layer slides: every layer's cache is the window pool's, the full group's blocks are bookkeeping
    (no tensor), and the tokens are transformers' and the full layout's, again from the prefix cache."""
    path, hf, ids = mistral
    prompts = [ids[0, :20].tolist(), ids[1, :9].tolist(), ids[0, :20].tolist() + [5, 6, 7]]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)  # up to 43 tokens: 7 windows
    expect = [[tiny_gemma.hf_greedy(hf, p, 20)] for p in prompts]
    assert all(len(set(e[0])) > 5 for e in expect)  # not one token repeated
    full = _llm(path, "off")
    try:
        assert full.engine.core.plan.num_window_blocks == 0
        assert _run(full, prompts, greedy) == expect
        full_layout_blocks = full.engine.core.plan.num_blocks
    finally:
        full.engine.close()
    llm = _llm(path, "auto")
    try:
        core = llm.engine.core
        assert core.plan.window == 6 and core.plan.window_layers == (0, 1, 2)
        # the whole budget is the window pool's: as many blocks as the full layout had
        assert core.plan.num_window_blocks == full_layout_blocks
        assert {c.kv.shape[1] for c in core.runner.kv_caches} == {full_layout_blocks}
        assert core.plan.profile.kv_allocated_bytes == core.runner.kv_cache_bytes
        # the full group's pool: tables of 128 tokens for every sequence, no memory
        assert core.plan.num_blocks >= 8 * (128 // 8)
        seen = _watch(core.scheduler.kv)
        assert _run(llm, prompts, greedy) == expect
        # the prompts' first step: 3 + 2 + 3 window blocks and the null block; then 2 a decoding sequence
        assert seen["peak"] == 1 + 3 + 2 + 3 and seen["decode_held"] == 2
        kv = core.scheduler.kv
        hits = kv.prefix_cache_hits
        assert _run(llm, prompts, greedy) == expect  # again, from the prefix cache
        assert kv.prefix_cache_hits > hits
        stats = core.get_scheduler_stats()
        assert set(stats.kv_pool_usage) == {"window"}  # the full pool holds no KV: not reported
        # the block gauges count the window pool, its null block left out
        assert stats.num_blocks_total == full_layout_blocks - 1
        assert stats.num_blocks_free + stats.num_blocks_cached == full_layout_blocks - 1  # all idle
        assert stats.num_blocks_cached > 0
    finally:
        llm.engine.close()


def test_an_all_sliding_model_preempts_and_forks_like_the_full_layout(mistral):
    """A window pool of 12 blocks: sequences wait, are preempted and recomputed; n = 2 seeded samples copy
    shared window blocks; every token equals the full layout's."""
    path, _, ids = mistral
    prompts = [ids[i % 2, : 9 + 3 * i].tolist() for i in range(4)]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=16, ignore_eos=True),
    ]
    results = {}
    for mode in ("off", "auto"):
        llm = _llm(path, mode, kv_cache_memory_bytes=12 * 6144, max_model_len=48)  # 12 blocks of 8
        try:
            core = llm.engine.core
            if mode == "auto":
                assert core.plan.num_window_blocks == 12 and core.plan.num_blocks >= 48 // 8
                _watch(core.scheduler.kv)
            results[mode] = [_run(llm, prompts, p) for p in params]
            results[mode, "preempted"] = core.scheduler.total_preemptions
        finally:
            llm.engine.close()
    assert results["auto"] == results["off"]
    assert results["auto", "preempted"] > 0
    assert all(len({tuple(c) for c in out}) > 1 for out in results["auto"][1])  # the samples differ
