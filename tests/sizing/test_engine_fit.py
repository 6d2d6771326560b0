"""The engine's start-up fit on this CPU machine, with the real default model (SmolLM2-135M-Instruct)."""

import pytest
from pagoda.engine.sizing import SizingError, fit_max_model_len, num_blocks_for

KV_PER_TOKEN = 46_080  # SmolLM2-135M in float32 (pinned below: `auto` is bfloat16 on CPUs with AVX512-BF16)
BLOCK = 16
KV_MEMORY = 8 * KV_PER_TOKEN * BLOCK + 12_345  # eight blocks and change: 128 tokens


@pytest.fixture(scope="module")
def torch_threads():
    import torch

    torch.set_num_threads(2)


def test_impossible_max_model_len_is_refused_with_the_fit_message(torch_threads):
    from pagoda.engine import LLM

    with pytest.raises(SizingError) as e:
        LLM(model=None, max_model_len=4096, kv_cache_memory_bytes=KV_MEMORY, device="cpu", dtype="float32")
    msg = str(e.value)
    assert "max_model_len=4096" in msg
    assert "needs 180.00 MiB of KV cache" in msg  # 4096 x 46,080 B
    assert "only 5.64 MiB is available for the KV cache" in msg
    assert "the largest max_model_len that fits is 128" in msg
    assert "--max-model-len" in msg and "--kv-cache-memory-bytes" in msg


def test_auto_picks_a_length_that_serves_a_request_of_that_length(torch_threads):
    from pagoda.engine import LLM, SamplingParams

    expected = fit_max_model_len("auto", 8192, KV_PER_TOKEN, KV_MEMORY, BLOCK)
    assert expected == 128 == num_blocks_for(KV_MEMORY, KV_PER_TOKEN, BLOCK) * BLOCK
    llm = LLM(
        model=None, max_model_len="auto", kv_cache_memory_bytes=KV_MEMORY, device="cpu", dtype="float32"
    )
    assert llm.engine.max_model_len == expected
    prompt = [(7 * i) % 1000 + 100 for i in range(expected - 1)]  # fills the context with the one new token
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False
    )
    assert len(out) == 1
    assert len(out[0].prompt_token_ids) + len(out[0].outputs[0].token_ids) == expected
    # one token more than the context is refused, not truncated
    with pytest.raises(ValueError, match="maximum context length is 128"):
        llm.generate([{"prompt_token_ids": prompt + [5]}], SamplingParams(max_tokens=1), use_tqdm=False)
