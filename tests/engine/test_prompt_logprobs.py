"""Prompt logprobs of a one-token prompt: `[None]` as vLLM answers, and such a request is like any other
once its prompt logprobs are known (a recompute after preemption reuses its cached blocks)."""

from __future__ import annotations

import pytest
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.step import SchedulerOutput


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20)


def test_a_one_token_prompt_has_prompt_logprobs_none(llm) -> None:
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    one, two = llm.generate([[42], [42, 43]], params, use_tqdm=False)
    assert one.prompt_logprobs == [None]
    assert len(two.prompt_logprobs) == 2 and two.prompt_logprobs[0] is None and 43 in two.prompt_logprobs[1]


def test_a_one_token_prompt_with_prompt_logprobs_uses_the_prefix_cache_on_recompute(llm) -> None:
    engine = llm.engine
    block = engine.kv.block_size
    params = SamplingParams(max_tokens=3 * block, temperature=0, prompt_logprobs=1, ignore_eos=True)
    engine.add_request("one", [42], params)
    whole = None
    while whole is None or len(whole.outputs[0].token_ids) < 2 * block:  # two full blocks in the cache
        for delta in engine.step():
            if whole is None:
                whole = delta
            else:
                whole.add(delta)
    assert whole.prompt_logprobs == [None]
    req = engine.scheduler.requests["one"]
    engine.scheduler._preempt(req, SchedulerOutput())  # as when the pool runs out: recomputed later
    stats = engine.core.step().iteration_stats
    assert stats.prefix_cache_hits >= 2 * block  # not recomputed from its first token
    assert stats.num_prompt_tokens <= block
    engine.abort_request("one")
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.check_invariants()
