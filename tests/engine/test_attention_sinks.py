"""Attention sinks (StreamingLLM) on the real default model and a tiny sliding-window Mistral.

Measured on the default model (SmolLM2-135M, CPU, float32, max_model_len 64, 256 tokens = 4x, temperature 0.8,
seeds 1, 2, 3; distinct-2 over the last quarter of the output), with the first design's 48-token window:
0.98, 0.95, 0.87 with 16 sink tokens; 0.25, 0.25, 0.60 with the same window and no sinks (a naive sliding window: the text falls into a loop such
as "The mountain is no mountain anymore."). Greedy runs of this model repeat a sentence either way (0.67
with sinks; 0.75 without, where the text has turned into digit strings, which distinct-n cannot see). The
bound below (0.75) lies between the two groups.
"""

from __future__ import annotations

import pytest
from pagoda.engine.frontend.llm import LLM
from pagoda.engine.sampling_params import SamplingParams

PROMPT = "Write a long story about a dragon who learns to bake bread in a small mountain village."
MAX_LEN = 64


def distinct_2(tokens: list[int]) -> float:
    pairs = list(zip(tokens, tokens[1:], strict=False))
    return len(set(pairs)) / max(1, len(pairs))


def _stream(llm: LLM, params: SamplingParams) -> tuple[list[int], list[int]]:
    """(output tokens, used blocks after every step) of one request run alone."""
    eng = llm.engine
    eng.add_request("r", PROMPT, params)
    tokens, used = [], []
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens += out.outputs[0].token_ids
        used.append(eng.scheduler.kv.num_used_blocks)
        eng.scheduler.check_invariants()
    return tokens, used


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32", max_model_len=MAX_LEN, kv_cache_memory_bytes=8 << 20)


def test_four_times_max_model_len_keeps_blocks_flat_and_text_fluent(llm):
    params = SamplingParams(
        temperature=0.8, seed=1, max_tokens=4 * MAX_LEN, ignore_eos=True, kv_eviction="streaming"
    )
    tokens, used = _stream(llm, params)
    assert len(tokens) == 4 * MAX_LEN
    bs = llm.engine.scheduler.kv.block_size
    # Sinks (16 tokens = one block) as written and rotated + window (32) = max_model_len: never more than
    # 64 / 16 blocks, and the cache is full from the first eviction on.
    assert max(used[:-1]) == MAX_LEN // bs
    assert used[-1] == 0
    fluent = distinct_2(tokens[-len(tokens) // 4 :])
    assert fluent > 0.75
    tok_ids = llm.get_tokenizer()(PROMPT).input_ids + tokens
    dropped = len(tok_ids) - 1 - MAX_LEN  # at least this many tokens left the cache
    assert dropped > 0
    # Never poison the prefix cache: the kept view (sinks + last window) must not be found cached past the
    # sink block, its window KV was computed with context that a fresh request would not have.
    kv = llm.engine.scheduler.kv
    for start in range(2 * bs, len(tok_ids) - MAX_LEN, bs):  # start == bs is the original prefix
        view = tok_ids[:bs] + tok_ids[start : start + MAX_LEN - bs]
        assert kv.find_cached_prefix(view) <= bs
    # The same run without sinks (window only) collapses into repetition.
    params.kv_sink_tokens = 0
    naive, _ = _stream(llm, params)
    assert distinct_2(naive[-len(naive) // 4 :]) < fluent - 0.3


def test_without_streaming_the_same_request_stops_at_max_model_len(llm):
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=4 * MAX_LEN, ignore_eos=True)
    tokens, _ = _stream(llm, params)
    prompt_len = len(llm.get_tokenizer()(PROMPT).input_ids)
    assert len(tokens) == MAX_LEN - prompt_len


def test_bad_sizes_are_refused_at_the_door(llm):
    eng = llm.engine
    for kw, field in [
        (dict(kv_window_tokens=8), "kv_window_tokens"),  # under two blocks
        (dict(kv_window_tokens=60), "kv_window_tokens"),  # 16 sinks + 60 > 64
        (dict(kv_sink_tokens=40, kv_window_tokens=32), "kv_window_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            eng.add_request("bad", PROMPT, SamplingParams(kv_eviction="streaming", **kw))
    with pytest.raises(ValueError, match="kv_eviction"):
        SamplingParams(kv_eviction="sliding")
    with pytest.raises(ValueError, match="kv_sink_tokens"):
        SamplingParams(kv_sink_tokens=-1)
    assert not eng.has_unfinished_requests()
    # Server-wide sizes no request could use stop the start, with the same words.
    with pytest.raises(ValueError, match="kv_window_tokens"):
        LLM(device="cpu", dtype="float32", max_model_len=MAX_LEN, kv_cache_memory_bytes=8 << 20, kv_eviction="streaming",
            kv_window_tokens=60)  # fmt: skip


def test_sliding_window_model_keeps_its_own_window(tiny_model):
    """Mistral with sliding_window=24: once the sinks fall out of its window, eviction must not change a
    single greedy token (the window keeps its keys and true distances), against a run with room to spare.
    A 48-token window keeps at least 33 tokens after an eviction, more than the model's 24; the sinks take
    their 16 tokens twice (as written and rotated), so that needs a max_model_len of 80."""
    path = str(tiny_model("mistral"))
    prompt = list(range(3, 23))
    n = 4 * MAX_LEN
    streaming = LLM(path, device="cpu", dtype="float32", max_model_len=MAX_LEN + 16, kv_cache_memory_bytes=4 << 20,
                    skip_tokenizer_init=True, kv_eviction="streaming", kv_window_tokens=48)  # fmt: skip
    roomy = LLM(
        path,
        device="cpu",
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=4 << 20,
        skip_tokenizer_init=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    (a,) = streaming.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    (b,) = roomy.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert len(a.outputs[0].token_ids) == n
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert streaming.engine.scheduler.kv.num_used_blocks == 0


def test_preempted_streaming_sequences_restart_from_their_kept_tokens(tiny_model):
    """Two streaming sequences in a 6-block pool (each wants 4): one is preempted after its evictions and
    recomputes only sinks + window (cache positions), then both run to 4x max_model_len."""
    path = str(tiny_model("llama"))
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=MAX_LEN, kv_cache_memory_bytes=6 * 16 * 512,
              skip_tokenizer_init=True, kv_eviction="streaming")  # fmt: skip
    eng = llm.engine
    assert eng.scheduler.kv.num_blocks == 6
    params = SamplingParams(temperature=0.0, max_tokens=4 * MAX_LEN, ignore_eos=True)
    eng.add_request("a", None, params, prompt_token_ids=list(range(3, 23)))
    for _ in range(60):  # a alone goes past its first eviction
        eng.step()
    req_a = eng.scheduler.requests["a"]
    assert req_a.seqs[0].kv_dropped > 0
    eng.add_request("b", None, params, prompt_token_ids=list(range(30, 50)))
    lengths = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            lengths[out.request_id] = lengths.get(out.request_id, 0) + len(out.outputs[0].token_ids)
        eng.scheduler.check_invariants()
        assert eng.scheduler.kv.num_used_blocks <= 6
    assert req_a.num_preemptions > 0  # a restarted after evictions: from its kept tokens only
    assert lengths["b"] == 4 * MAX_LEN and lengths["a"] == 4 * MAX_LEN - 60
