"""The default model kept in its own Q4_1 blocks (`--quantization gguf`) end to end on the CPU: the offline
engine gives the dequantized model's greedy tokens, and `pagoda serve --quantization gguf` answers the
official client with them."""

from __future__ import annotations

import openai
import pytest

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three primary colors are"]


@pytest.fixture(scope="module")
def offline() -> list[str]:
    from pagoda.engine import LLM, SamplingParams
    from pagoda.engine.quantization.gguf_linear import GGUFLinear

    params = SamplingParams(temperature=0, max_tokens=16)
    texts, weights = {}, {}
    for method in (None, "gguf"):
        llm = LLM(
            device="cpu",
            dtype="float32",
            quantization=method,
            max_model_len=256,
            kv_cache_memory_bytes=16 << 20,
        )
        model = llm.engine.core.runner.model
        assert isinstance(model.layers[0].mlp.down_proj, GGUFLinear) == (method == "gguf")
        weights[method] = llm.engine.core.runner.weights_bytes()
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        texts[method] = [o.outputs[0].text for o in outs]
        del llm
    # Q4_1 linears and a Q8_0 LM head (the float32 embedding stays for lookups): under half the bytes
    assert weights["gguf"] < 0.55 * weights[None]
    assert texts["gguf"] == texts[None]  # exact kernels: the dequantized model's greedy tokens
    return texts["gguf"]


def test_server_keeping_gguf_blocks_answers_the_official_client(start_pagoda, offline):
    srv = start_pagoda("--quantization", "gguf", "--dtype", "float32")
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    for prompt, want in zip(PROMPTS, offline, strict=True):
        got = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == want
    assert "Paris" in offline[0]
