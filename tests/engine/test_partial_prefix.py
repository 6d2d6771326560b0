"""Sub-block prefix reuse on the real default model: same greedy tokens, fewer tokens computed."""

from __future__ import annotations

from pagoda.engine.frontend.llm import LLM
from pagoda.engine.sampling_params import SamplingParams

SYSTEM = (
    "You are a careful assistant for a bakery in a mountain village. Answer in two sentences, name the "
    "bread you mean, and never invent prices."
)
QUESTIONS = ["What rises overnight?", "Which loaf keeps a week?", "Why is rye dense?"]


def _greedy(llm: LLM) -> tuple[list[list[int]], list[int]]:
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs, cached = [], []
    for q in QUESTIONS:  # one at a time: each finds the previous ones' blocks cached
        prompt = tok(SYSTEM + "\n" + q).input_ids
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        outs.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens)
    return outs, cached


def test_greedy_tokens_equal_with_and_without_sub_block_reuse():
    kw = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    with_reuse = LLM(**kw)
    on, cached_on = _greedy(with_reuse)
    off, cached_off = _greedy(LLM(**kw, enable_partial_prefix_reuse=False))
    assert on == off
    tok = with_reuse.get_tokenizer()
    shared = len(tok(SYSTEM + "\n").input_ids)
    bs = with_reuse.engine.scheduler.kv.block_size
    assert shared % bs != 0  # the test is about a prefix that is not block-aligned
    # Without sub-block reuse a hit stops at the last whole block; with it, at the shared tokens (at least:
    # the question may share a first token too).
    assert cached_off[1:] == [shared // bs * bs] * 2
    assert all(c >= shared for c in cached_on[1:])
    assert cached_on[0] == cached_off[0] == 0
    assert with_reuse.engine.scheduler.kv.partial_reuse_tokens == sum(cached_on) - sum(cached_off)
    # The hit counters behind vllm:prefix_cache_hits count the reused tokens too.
    assert with_reuse.engine.scheduler.kv.prefix_cache_hits == sum(cached_on)
