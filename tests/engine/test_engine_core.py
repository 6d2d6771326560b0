"""The engine core's shape: a step is schedule -> execute -> update, outputs are deltas, and the engine
runs without a tokenizer when every prompt is token ids."""

from __future__ import annotations

import pytest
from pagoda.engine import LLM, SamplingParams
from pagoda.engine.config import EngineConfig
from pagoda.engine.frontend.llm_engine import LLMEngine

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def test_skip_tokenizer_init_serves_token_ids_from_a_dir_without_a_tokenizer(tiny_model):
    path = tiny_model("llama")
    for name in TOKENIZER_FILES:
        (path / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="tokenizer.json"):
        LLM(str(path), device="cpu", kv_cache_memory_bytes=4 << 20)
    llm = LLM(str(path), device="cpu", kv_cache_memory_bytes=4 << 20, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate(["a text prompt"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate([[5, 6]], SamplingParams(stop=["x"]), use_tqdm=False)


def test_step_outputs_are_deltas_that_add_up_to_the_whole_output():
    """Each step hands out only what it added; folding the deltas gives what LLM.generate returns."""
    engine = LLMEngine(EngineConfig(device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20))
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=12, n=2, logprobs=1, ignore_eos=True)
    engine.add_request("r", "The capital of France is", params)
    whole = None
    steps_with_output = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            steps_with_output += 1
            for c in delta.outputs:
                assert len(c.token_ids) <= 1  # a decode step adds one token per sequence
                assert len(c.logprobs) == len(c.token_ids)
            if whole is None:
                whole = delta
            else:
                whole.add(delta)
    assert whole is not None and whole.finished
    assert steps_with_output == 12
    assert sorted(c.index for c in whole.outputs) == [0, 1]
    for c in whole.outputs:
        assert len(c.token_ids) == 12 and len(c.logprobs) == 12 and c.finish_reason == "length"
        assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    engine.scheduler.check_invariants()


def test_abort_ends_with_a_final_delta_and_frees_everything():
    engine = LLMEngine(EngineConfig(device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20))
    engine.add_request("r", "Tell me a story", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("r")
    (final,) = engine.step()
    assert final.finished and final.outputs[0].finish_reason == "abort" and final.outputs[0].token_ids == []
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_invariants()
