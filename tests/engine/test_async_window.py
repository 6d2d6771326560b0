"""Async scheduling over the window group (Gemma 3's sliding layers keep only their window): the step planned
ahead frees and reuses window blocks while the step before it still runs, and gives the synchronous tokens."""

from __future__ import annotations

from pagoda.engine import LLM, SamplingParams
from pagoda_testkit import tiny_gemma


def _tokens(path, async_scheduling: bool) -> tuple[list[list[int]], int]:
    llm = LLM(
        str(path), device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2 << 20,
        skip_tokenizer_init=True, block_size=8, max_num_seqs=4, async_scheduling=async_scheduling,
    )  # fmt: skip
    kv = llm.engine.core.scheduler.kv
    assert kv.window_pool is not None  # the window group is built
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 3 for j in range(20 + 9 * i)]} for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], kv.window_pool.num_used_blocks


def test_async_steps_give_the_synchronous_tokens_with_the_window_group(tmp_path) -> None:
    tiny_gemma.build("gemma3", tmp_path)
    sync, left_sync = _tokens(tmp_path, False)
    overlapped, left = _tokens(tmp_path, True)
    assert overlapped == sync and all(len(t) == 40 for t in sync)
    assert left == left_sync == 1  # every window block went back when the sequences ended (1: the null block)
