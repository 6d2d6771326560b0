"""Greedy tokens do not depend on how the engine batches, chunks, caches or preempts."""

from __future__ import annotations

import pytest
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.frontend.llm_engine import LLMEngine
from pagoda_testkit.prompts import MIXED_PROMPTS

PROMPTS = MIXED_PROMPTS
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
BYTES_PER_BLOCK16 = 46080 * 16  # SmolLM2-135M in fp32


def greedy(**kwargs) -> tuple[list[list[int]], LLM]:
    base = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=48 << 20)
    llm = LLM(**{**base, **kwargs})
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    tokens, _ = greedy()
    assert all(len(t) == 24 for t in tokens)
    return tokens


def test_prefix_caching_on_and_off(reference):
    off, _ = greedy(enable_prefix_caching=False)
    assert off == reference
    tokens, llm = greedy(enable_prefix_caching=True)
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert tokens == reference and again == reference
    assert llm.engine.kv.prefix_cache_hits > 0  # the second pass was served from cached blocks


@pytest.mark.parametrize("chunk", [8, 64, None])
def test_chunk_sizes(reference, chunk):
    tokens, _ = greedy(max_num_batched_tokens=chunk or 256, enable_chunked_prefill=chunk is not None)
    assert tokens == reference


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(reference, block_size):
    tokens, _ = greedy(block_size=block_size)
    assert tokens == reference


def test_preemption_by_tiny_pool(reference):
    tokens, llm = greedy(kv_cache_memory_bytes=10 * BYTES_PER_BLOCK16, max_model_len=96)
    assert llm.engine.scheduler.total_preemptions > 0
    assert tokens == reference
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_requests_arriving_and_finishing_mid_batch(reference):
    engine = LLMEngine(
        EngineConfig(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=48 << 20)
    )
    lengths = [24, 5, 24, 11, 24, 17]  # some finish early while others keep going
    done: dict[str, list[int]] = {}
    pending = list(enumerate(PROMPTS))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request every third step
            i, prompt = pending.pop(0)
            engine.add_request(
                str(i), prompt, SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True)
            )
        for delta in engine.step():  # deltas: each carries the token(s) this step added
            done.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
        step += 1
    for i in range(len(PROMPTS)):
        assert done[str(i)] == reference[i][: lengths[i]]
    assert engine.kv.num_free_blocks == engine.num_blocks  # every block free or cached
    engine.scheduler.check_invariants()
